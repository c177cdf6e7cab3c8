#include "deploy/launch/cluster.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <thread>

#include "absl/strings/str_cat.h"

namespace hsdp::launch {
namespace {

// What a forked child exits with when the launcher died before it was set up.
constexpr int kExitOrphaned = 1;
// How long children get between SIGTERM and SIGKILL when we shut the cluster
// down.
constexpr auto kTerminateGrace = std::chrono::seconds(5);

}  // namespace

absl::StatusOr<pid_t> Spawn(const std::vector<std::string>& argv,
                            const std::string& log) {
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0)
    return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(kExitOrphaned);
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) {
      dup2(fd, STDOUT_FILENO);
      dup2(fd, STDERR_FILENO);
      close(fd);
    }
    std::vector<char*> args;
    for (const std::string& a : argv)
      args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    std::fprintf(stderr, "exec %s: %s\n", args[0], std::strerror(errno));
    _exit(127);
  }
  return pid;
}

absl::Status Respawn(Child& child, const std::string& report,
                     const std::string& log_line) {
  auto flag = std::find(child.argv.begin(), child.argv.end(), kReportFileFlag);
  if (flag != child.argv.end() && std::next(flag) != child.argv.end()) {
    *std::next(flag) = report;
  }
  std::ofstream(child.log, std::ios::app) << log_line << std::endl;
  absl::StatusOr<pid_t> pid = Spawn(child.argv, child.log);
  if (!pid.ok()) return pid.status();
  child.pid = *pid;
  child.running = true;
  return absl::OkStatus();
}

std::string LastLine(const std::string& path) {
  std::ifstream in(path);
  std::string line, last;
  while (std::getline(in, line)) {
    if (!line.empty()) last = line;
  }
  return last;
}

std::string FirstLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

std::string DescribeExit(int status) {
  if (WIFEXITED(status))
    return absl::StrCat("exit status ", WEXITSTATUS(status));
  if (WIFSIGNALED(status))
    return absl::StrCat("killed by signal ", WTERMSIG(status));
  return "stopped";
}

bool ExitedOk(int status) {
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

std::vector<size_t> Cluster::Reap() {
  std::vector<size_t> exited;
  for (size_t i = 0; i < children_.size(); ++i) {
    Child& c = children_[i];
    if (!c.running) continue;
    int status = 0;
    if (waitpid(c.pid, &status, WNOHANG) == c.pid) {
      c.running = false;
      c.exit_status = status;
      exited.push_back(i);
    }
  }
  return exited;
}

void Cluster::Terminate() {
  for (Child& c : children_) {
    if (c.running) kill(c.pid, SIGTERM);
  }
  const auto deadline = std::chrono::steady_clock::now() + kTerminateGrace;
  while (std::chrono::steady_clock::now() < deadline && AnyRunning()) {
    Reap();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  for (Child& c : children_) {
    if (!c.running) continue;
    kill(c.pid, SIGKILL);
    waitpid(c.pid, &c.exit_status, 0);
    c.running = false;
  }
}

bool Cluster::AnyRunning() const {
  return std::any_of(children_.begin(), children_.end(),
                     [](const Child& c) { return c.running; });
}

}  // namespace hsdp::launch
