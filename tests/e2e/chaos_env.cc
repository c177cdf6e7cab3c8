#include "tests/e2e/chaos_env.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mount.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "tests/e2e/cluster.h"

namespace hsdp::e2e {
namespace {

namespace fs = std::filesystem;

constexpr char kTagPrefix[] = "hsdpchaos";
constexpr char kSubnet[] = "10.251.9";
constexpr int kFirstHost = 10;
constexpr char kFillerName[] = "filler";

std::string Tool(const std::string& name) {
  for (const char* dir : {"/usr/sbin/", "/sbin/", "/usr/bin/", "/bin/"}) {
    const std::string path = absl::StrCat(dir, name);
    if (access(path.c_str(), X_OK) == 0) return path;
  }
  return "";
}

// Namespaces of an earlier run whose process is gone (killed before its
// destructor ran).
void RemoveStaleNamespaces(const std::string& ip) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator("/var/run/netns", ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(kTagPrefix, 0) != 0) continue;
    const std::string rest = name.substr(std::strlen(kTagPrefix));
    int pid = 0;
    if (!absl::SimpleAtoi(rest.substr(0, rest.find('-')), &pid)) continue;
    if (kill(pid, 0) == 0 || errno != ESRCH) continue;
    Wait(Spawn({ip, "netns", "del", name}, "/dev/null"));
  }
}

}  // namespace

PodNetwork::PodNetwork(std::string tag, std::string scratch_dir)
    : tag_(std::move(tag)), scratch_dir_(std::move(scratch_dir)) {}

absl::StatusOr<std::unique_ptr<PodNetwork>> PodNetwork::Create(
    const std::string& scratch_dir) {
  if (geteuid() != 0) {
    return absl::FailedPreconditionError(
        "needs root to create network namespaces");
  }
  const std::string ip = Tool("ip");
  if (ip.empty() || Tool("tc").empty()) {
    return absl::FailedPreconditionError("iproute2 (ip, tc) is not installed");
  }
  RemoveStaleNamespaces(ip);
  std::unique_ptr<PodNetwork> net(
      new PodNetwork(absl::StrCat(kTagPrefix, getpid()), scratch_dir));
  const std::string sw = net->Namespace("sw");
  if (net->Run({ip, "netns", "add", sw}) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("ip netns add failed (see ", scratch_dir, "/net.log)"));
  }
  net->namespaces_.push_back(sw);
  if (net->Run({ip, "-n", sw, "link", "add", "br0", "type", "bridge"}) != 0 ||
      net->Run({ip, "-n", sw, "link", "set", "br0", "up"}) != 0) {
    return absl::FailedPreconditionError("cannot create a bridge");
  }
  return net;
}

PodNetwork::~PodNetwork() {
  const std::string ip = Tool("ip");
  for (const std::string& ns : namespaces_) Run({ip, "netns", "del", ns});
}

std::string PodNetwork::Namespace(const std::string& pod) const {
  return absl::StrCat(tag_, "-", pod);
}

int PodNetwork::Run(const std::vector<std::string>& argv) const {
  return Wait(Spawn(argv, scratch_dir_ + "/net.log"), std::chrono::seconds(30));
}

absl::StatusOr<std::string> PodNetwork::AddPod(const std::string& name) {
  const std::string ip = Tool("ip");
  const std::string ns = Namespace(name);
  const std::string sw = Namespace("sw");
  const int index = static_cast<int>(pods_.size());
  const std::string address = absl::StrCat(kSubnet, ".", kFirstHost + index);
  const std::string peer = absl::StrCat("p", index);
  if (Run({ip, "netns", "add", ns}) != 0) {
    return absl::InternalError(absl::StrCat("ip netns add ", ns));
  }
  namespaces_.push_back(ns);
  const std::vector<std::vector<std::string>> steps = {
      {ip, "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name",
       peer, "netns", sw},
      {ip, "-n", ns, "addr", "add", address + "/24", "dev", "eth0"},
      {ip, "-n", ns, "link", "set", "eth0", "up"},
      {ip, "-n", ns, "link", "set", "lo", "up"},
      {ip, "-n", sw, "link", "set", peer, "master", "br0"},
      {ip, "-n", sw, "link", "set", peer, "up"}};
  for (const auto& step : steps) {
    if (Run(step) != 0) {
      return absl::InternalError(
          absl::StrCat("setting up pod ", name, ": ", step[3], " failed"));
    }
  }
  pods_.push_back(name);
  return address;
}

std::vector<std::string> PodNetwork::Exec(
    const std::string& pod, const std::vector<std::string>& argv) const {
  std::vector<std::string> out = {Tool("ip"), "netns", "exec", Namespace(pod)};
  out.insert(out.end(), argv.begin(), argv.end());
  return out;
}

absl::StatusOr<std::string> PodNetwork::Impair(const std::string& pod,
                                               int delay_ms, int loss_percent) {
  const std::vector<std::string> tc = {Tool("tc"), "qdisc", "replace",
                                       "dev",      "eth0",  "root"};
  if (netem_ != 0) {
    std::vector<std::string> argv = tc;
    argv.insert(argv.end(), {"netem", "delay", absl::StrCat(delay_ms, "ms"),
                             absl::StrCat(delay_ms / 4, "ms"), "loss",
                             absl::StrCat(loss_percent, "%")});
    if (Run(Exec(pod, argv)) == 0) {
      netem_ = 1;
      return absl::StrCat("netem delay ", delay_ms, "ms loss ", loss_percent,
                          "%");
    }
    netem_ = 0;  // "Specified qdisc kind is unknown": not in this kernel
  }
  // A slow link (64 kbit/s, 8 KB bucket): packets queue and are dropped when
  // they would wait longer than delay_ms.
  std::vector<std::string> argv = tc;
  argv.insert(argv.end(), {"tbf", "rate", "64kbit", "burst", "8kb", "latency",
                           absl::StrCat(delay_ms, "ms")});
  if (Run(Exec(pod, argv)) != 0) {
    return absl::InternalError(absl::StrCat("tc qdisc on pod ", pod));
  }
  return absl::StrCat("tbf 64kbit latency ", delay_ms, "ms");
}

void PodNetwork::Repair(const std::string& pod) {
  Run(Exec(pod, {Tool("tc"), "qdisc", "del", "dev", "eth0", "root"}));
}

absl::Status PodNetwork::SetLink(const std::string& pod, bool up) {
  if (Run({Tool("ip"), "-n", Namespace(pod), "link", "set", "eth0",
           up ? "up" : "down"}) != 0) {
    return absl::InternalError(absl::StrCat("ip link set on pod ", pod));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<SizedTmpfs>> SizedTmpfs::Mount(
    const std::string& dir, int64_t bytes) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  const std::string options = absl::StrCat("size=", bytes);
  if (mount("tmpfs", dir.c_str(), "tmpfs", 0, options.c_str()) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("mount tmpfs on ", dir, ": ", std::strerror(errno)));
  }
  return std::unique_ptr<SizedTmpfs>(new SizedTmpfs(dir));
}

SizedTmpfs::~SizedTmpfs() { umount2(dir_.c_str(), MNT_DETACH); }

int64_t SizedTmpfs::Fill() {
  const std::string path = dir_ + "/" + kFillerName;
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  if (fd < 0) return 0;
  static const std::string kChunk(1 << 16, '\0');
  int64_t written = 0;
  // Down to single bytes: a write smaller than a page can still fit.
  for (size_t size = kChunk.size(); size > 0;) {
    const ssize_t n = write(fd, kChunk.data(), size);
    if (n > 0) {
      written += n;
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      size /= 2;
    }
  }
  close(fd);
  return written;
}

void SizedTmpfs::Free() {
  std::error_code ec;
  fs::remove(dir_ + "/" + kFillerName, ec);
}

}  // namespace hsdp::e2e
