// hsdp-launch: a local cluster on this machine, like `torchrun --standalone`.
//
//   hsdp-launch --workers 4 --mesh 2x2 --model gpt-tiny --steps 200 [-- extra
//   hsdp-worker flags]
//   hsdp-launch --workers 4 --mesh 2x2 --worker-binary ./my-worker --steps 200
//
// Starts hsdp-coordinator and N hsdp-worker processes (found next to this
// binary; --worker-binary runs a user's worker, one built on
// hsdp::train::WorkerMain, instead), shows one live progress line read from the
// workers' report files and the coordinator's status (generation, mesh),
// forwards Ctrl-C / SIGTERM to every child and cleans up. Everything a run
// writes (logs, reports, coordinator state) lands in --run-dir; the
// coordinator's dashboard URL is printed and written to RUN_DIR/dashboard.url.
//
// Elastic: a worker that dies is started again with its own command line (its
// report file aside: RUN_DIR/worker-R.restart-K.jsonl) up to --max-restarts
// times in all; it joins again and is healed by its peers while the others
// keep training. A worker that fails before the job's first committed step
// (a bad flag, an unknown model) is not restarted, and --max-restarts 0 stops
// every process at the first worker that fails. Exits 0 when the job finishes,
// and otherwise non-zero naming the worker that failed past the restarts (the
// last line of its log) or the coordinator's reason (a FAILED job).
//
// Single-threaded: the main loop polls children, report files and the
// coordinator's status; signal handlers only set a flag.
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/mesh.h"
#include "common/token.h"
#include "coordinator/service/grpc_status.h"
#include "hsdp/v1/control_service.grpc.pb.h"

namespace {

namespace fs = std::filesystem;

constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;
constexpr auto kPollInterval = std::chrono::milliseconds(200);
constexpr auto kCoordinatorStartTimeout = std::chrono::seconds(30);
// How long children get between SIGTERM and SIGKILL when we shut the cluster
// down.
constexpr auto kTerminateGrace = std::chrono::seconds(5);
constexpr double kMiB = 1024.0 * 1024.0;
// Restarts of dead workers in all, unless --max-restarts says otherwise.
constexpr int kDefaultMaxRestarts = 3;
// How often the coordinator's status is read, and how long one read may take.
constexpr auto kStatusInterval = std::chrono::seconds(1);
constexpr auto kStatusTimeout = std::chrono::seconds(2);
constexpr char kReportFileFlag[] = "--report-file";

volatile std::sig_atomic_t g_signal = 0;
void OnSignal(int sig) { g_signal = sig; }

struct Child {
  std::string name;
  pid_t pid = -1;
  std::string log;
  bool running = false;
  int exit_status = 0;  // raw waitpid status once exited
  // The worker's rank hint; -1 for the coordinator.
  int rank = -1;
  // Its command line (restarts run it again).
  std::vector<std::string> argv;
};

// Forks and execs `argv` with stdout+stderr appended to `log`. The child dies
// with the launcher (PDEATHSIG) so a SIGKILLed launcher leaves no orphans.
absl::StatusOr<pid_t> Spawn(const std::vector<std::string>& argv,
                            const std::string& log) {
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0)
    return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(kExitFailure);
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

std::string LastLine(const std::string& path) {
  std::ifstream in(path);
  std::string line, last;
  while (std::getline(in, line)) {
    if (!line.empty()) last = line;
  }
  return last;
}

std::string DescribeExit(int status) {
  if (WIFEXITED(status))
    return absl::StrCat("exit status ", WEXITSTATUS(status));
  if (WIFSIGNALED(status))
    return absl::StrCat("killed by signal ", WTERMSIG(status));
  return "stopped";
}

// Minimal field extraction from the worker's flat JSON report lines (no
// nesting, no escapes).
std::optional<double> JsonNumber(const std::string& line,
                                 const std::string& key) {
  const std::string needle = absl::StrCat("\"", key, "\":");
  const size_t at = line.find(needle);
  if (at == std::string::npos) return std::nullopt;
  const size_t begin = at + needle.size();
  const size_t end = line.find_first_of(",}", begin);
  double v;
  if (!absl::SimpleAtod(line.substr(begin, end - begin), &v))
    return std::nullopt;
  return v;
}

// --worker-binary: an absolute path to an executable regular file, or a
// one-line INVALID_ARGUMENT naming the flag. Made absolute because the workers
// are started with execv (no PATH search).
absl::StatusOr<std::string> ResolveWorkerBinary(const std::string& path) {
  std::error_code ec;
  const fs::path abs = fs::absolute(path, ec);
  if (ec) {
    return absl::InvalidArgumentError(
        absl::StrCat("--worker-binary ", path, ": ", ec.message()));
  }
  const fs::file_status st = fs::status(abs, ec);
  if (ec || !fs::exists(st)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--worker-binary ", path, ": no such file"));
  }
  if (!fs::is_regular_file(st)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--worker-binary ", path, ": not a regular file"));
  }
  if (access(abs.c_str(), X_OK) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--worker-binary ", path, ": not executable"));
  }
  return abs.lexically_normal().string();
}

std::string BinDir() {
  std::error_code ec;
  fs::path self = fs::read_symlink("/proc/self/exe", ec);
  return ec ? std::string(".") : self.parent_path().string();
}

class Cluster {
 public:
  ~Cluster() { Terminate(); }

  void Add(Child child) { children_.push_back(std::move(child)); }
  std::vector<Child>& children() { return children_; }

  // Reaps exited children; returns the indices (into children()) of those
  // that exited since the last call, in order.
  std::vector<size_t> Reap() {
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

  // SIGTERM to all running children, SIGKILL after the grace period.
  void Terminate() {
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

  bool AnyRunning() const {
    return std::any_of(children_.begin(), children_.end(),
                       [](const Child& c) { return c.running; });
  }

 private:
  std::vector<Child> children_;
};

bool ExitedOk(int status) {
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

// The coordinator's GetStatus, with the control token when there is one.
class StatusClient {
 public:
  StatusClient(const std::string& address, std::string token)
      : stub_(hsdp::v1::ControlService::NewStub(
            grpc::CreateChannel(address, grpc::InsecureChannelCredentials()))),
        token_(std::move(token)) {}

  absl::StatusOr<hsdp::v1::GetStatusResponse> Get() {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + kStatusTimeout);
    if (!token_.empty()) {
      context.AddMetadata("authorization", absl::StrCat("Bearer ", token_));
    }
    hsdp::v1::GetStatusResponse response;
    absl::Status status = hsdp::coordinator::FromGrpcStatus(
        stub_->GetStatus(&context, hsdp::v1::GetStatusRequest(), &response));
    if (!status.ok()) return status;
    return response;
  }

 private:
  std::unique_ptr<hsdp::v1::ControlService::Stub> stub_;
  const std::string token_;
};

// The file's contents without surrounding whitespace, or "" when it cannot be
// read.
std::string ReadToken(const std::string& path) {
  std::ifstream in(path);
  std::string token;
  in >> token;
  return token;
}

std::string MeshOf(const hsdp::v1::GetStatusResponse& status) {
  return absl::StrCat(status.replicas(), "x", status.mesh().shard());
}

// Reads what the workers append to their report files: the first step each
// generation trained, its world size, and which files have lines of it.
// Every member of a generation trains its first step, so the first line of a
// generation in any file names the generation's start step.
class ReportScanner {
 public:
  struct Generation {
    int64_t first_step = 0;
    int world_size = 0;
    std::set<std::string> files;
  };

  // Reads the complete lines appended to `paths` since the last call.
  void Scan(const std::vector<std::string>& paths) {
    for (const std::string& path : paths) {
      std::ifstream in(path, std::ios::binary);
      if (!in) continue;
      std::streamoff& offset = offsets_[path];
      in.seekg(offset);
      std::string line;
      while (std::getline(in, line)) {
        if (in.eof()) break;  // a line still being written: read it next time
        offset += static_cast<std::streamoff>(line.size()) + 1;
        const std::optional<double> generation = JsonNumber(line, "generation");
        const std::optional<double> step = JsonNumber(line, "step");
        if (!generation.has_value() || !step.has_value()) continue;
        auto [it, added] =
            generations_.try_emplace(static_cast<int64_t>(*generation));
        Generation& g = it->second;
        if (added || *step < g.first_step) {
          g.first_step = static_cast<int64_t>(*step);
        }
        g.world_size = static_cast<int>(
            JsonNumber(line, "world_size").value_or(g.world_size));
        g.files.insert(path);
      }
    }
  }

  const std::map<int64_t, Generation>& generations() const {
    return generations_;
  }

 private:
  std::map<std::string, std::streamoff> offsets_;
  std::map<int64_t, Generation> generations_;
};

struct Options {
  int workers = 0;
  std::string mesh;
  // Empty: the worker's default model (hsdp-worker: gpt-tiny); not passed on.
  std::string model;
  int64_t steps = 100;
  std::string policy_file;
  int port = 0;
  // /metrics and the dashboard; 0: a free port, -1: none.
  int metrics_port = 0;
  std::string control_token_file;
  std::string job_id = "local";
  std::string run_dir;
  std::string bin_dir;
  // Empty: hsdp-worker next to the coordinator.
  std::string worker_binary;
  // Restarts of dead workers in all; 0: the first failure stops the job.
  int max_restarts = kDefaultMaxRestarts;
  std::vector<std::string> worker_args;
};

// One status line: step, generation and mesh (once the coordinator said),
// restarts (when any), mean loss, tokens/s (sum over ranks), step time,
// per-rank peak memory (every byte LibTorch allocated / the process's RSS).
// `reports` are the live incarnations' report files.
std::string ProgressLine(
    const Options& o, const std::vector<std::string>& reports,
    const std::optional<hsdp::v1::GetStatusResponse>& status, int restarts) {
  double loss = 0, tps = 0, step_s = 0;
  int64_t step = -1;
  int have = 0;
  std::vector<std::string> mem;
  for (size_t r = 0; r < reports.size(); ++r) {
    const std::string line = LastLine(reports[r]);
    auto s = JsonNumber(line, "step");
    if (!s) {
      mem.push_back("-");
      continue;
    }
    ++have;
    step = step < 0 ? static_cast<int64_t>(*s) : std::min<int64_t>(step, *s);
    loss = JsonNumber(line, "loss").value_or(0);
    tps += JsonNumber(line, "tokens_per_second").value_or(0);
    step_s = std::max(step_s, JsonNumber(line, "step_seconds").value_or(0));
    mem.push_back(absl::StrFormat(
        "%.1f/%.0f", JsonNumber(line, "peak_memory_bytes").value_or(0) / kMiB,
        JsonNumber(line, "rss_peak_bytes").value_or(0) / kMiB));
  }
  if (have == 0) return "waiting for workers...";
  std::string job;
  if (status.has_value()) {
    absl::StrAppend(&job, "  gen ", status->generation(), " ", MeshOf(*status));
  }
  if (restarts > 0) absl::StrAppend(&job, "  restarts ", restarts);
  return absl::StrFormat(
      "step %d/%d%s  loss %.4f  %.0f tok/s  step %.3fs  peak MiB "
      "(allocated/rss) %s",
      step + 1, o.steps, job, loss, tps, step_s, absl::StrJoin(mem, " "));
}

// The first line of `path`, or "" when it cannot be read.
std::string FirstLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

absl::StatusOr<int> WaitForPort(const std::string& port_file,
                                Cluster& cluster) {
  const auto deadline =
      std::chrono::steady_clock::now() + kCoordinatorStartTimeout;
  while (std::chrono::steady_clock::now() < deadline) {
    std::ifstream in(port_file);
    std::string text;
    int port;
    if (in >> text && absl::SimpleAtoi(text, &port) && port > 0) return port;
    if (!cluster.Reap().empty()) {
      const Child& failed = cluster.children().front();
      return absl::UnavailableError(absl::StrCat(
          "coordinator failed to start (", DescribeExit(failed.exit_status),
          "): ", LastLine(failed.log)));
    }
    if (g_signal != 0) return absl::CancelledError("interrupted");
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return absl::DeadlineExceededError(
      "coordinator did not report its port within 30 s");
}

int Run(const Options& o) {
  absl::StatusOr<hsdp::MeshShape> mesh =
      hsdp::ParseMeshForWorld(o.mesh, o.workers);
  if (!mesh.ok()) {
    std::cerr << "hsdp-launch: " << mesh.status().message() << " (--workers "
              << o.workers << ")" << std::endl;
    return kExitUsage;
  }
  const std::string bin = o.bin_dir.empty() ? BinDir() : o.bin_dir;
  const std::string coordinator_bin = bin + "/hsdp-coordinator";
  std::string worker_bin = bin + "/hsdp-worker";
  if (!o.worker_binary.empty()) {
    absl::StatusOr<std::string> user_bin = ResolveWorkerBinary(o.worker_binary);
    if (!user_bin.ok()) {
      std::cerr << "hsdp-launch: " << user_bin.status().message() << std::endl;
      return kExitUsage;
    }
    worker_bin = *user_bin;
  }
  for (const std::string& b : {coordinator_bin, worker_bin}) {
    if (access(b.c_str(), X_OK) != 0) {
      std::cerr << "hsdp-launch: " << b
                << " not found (build it, or pass --bin-dir)" << std::endl;
      return kExitFailure;
    }
  }
  std::string run_dir = o.run_dir;
  if (run_dir.empty()) {
    char tmpl[] = "/tmp/hsdp-launch-XXXXXX";
    if (mkdtemp(tmpl) == nullptr) {
      std::cerr << "hsdp-launch: mkdtemp: " << std::strerror(errno)
                << std::endl;
      return kExitFailure;
    }
    run_dir = tmpl;
  }
  std::error_code ec;
  fs::create_directories(run_dir, ec);
  const std::string port_file = run_dir + "/coordinator.port";
  fs::remove(port_file, ec);
  const std::string dashboard_file = run_dir + "/dashboard.url";
  fs::remove(dashboard_file, ec);
  std::cerr << "hsdp-launch: run dir " << run_dir << std::endl;

  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);

  // A fresh job token per run for the coordinator and the workers, handed down
  // through the environment (argv is visible to every user of the machine).
  absl::StatusOr<std::string> job_token = hsdp::RandomToken();
  if (!job_token.ok()) {
    std::cerr << "hsdp-launch: job token: " << job_token.status().message()
              << std::endl;
    return kExitFailure;
  }
  unsetenv(hsdp::kJobTokenFileEnv);
  setenv(hsdp::kJobTokenEnv, job_token->c_str(), /*overwrite=*/1);

  Cluster cluster;
  std::vector<std::string> cargs = {coordinator_bin,
                                    "--job-id",
                                    o.job_id,
                                    "--world-size",
                                    std::to_string(o.workers),
                                    "--mesh",
                                    hsdp::MeshToString(*mesh),
                                    "--listen",
                                    absl::StrCat("127.0.0.1:", o.port),
                                    "--port-file",
                                    port_file,
                                    "--state-dir",
                                    run_dir + "/coordinator-state"};
  if (o.metrics_port >= 0) {
    // The coordinator writes the URL before its port file, so it is there
    // once WaitForPort returns.
    for (const std::string& a :
         {std::string("--metrics-listen"),
          absl::StrCat("127.0.0.1:", o.metrics_port),
          std::string("--dashboard-url-file"), dashboard_file}) {
      cargs.push_back(a);
    }
  } else {
    cargs.push_back("--metrics-listen");
    cargs.push_back("");
  }
  if (!o.control_token_file.empty()) {
    cargs.push_back("--control-token-file");
    cargs.push_back(o.control_token_file);
  }
  if (!o.policy_file.empty()) {
    cargs.push_back("--policy-file");
    cargs.push_back(o.policy_file);
  }
  Child coordinator;
  coordinator.name = "coordinator";
  coordinator.log = run_dir + "/coordinator.log";
  auto cpid = Spawn(cargs, coordinator.log);
  if (!cpid.ok()) {
    std::cerr << "hsdp-launch: " << cpid.status().message() << std::endl;
    return kExitFailure;
  }
  coordinator.pid = *cpid;
  coordinator.running = true;
  cluster.Add(coordinator);
  absl::StatusOr<int> port = WaitForPort(port_file, cluster);
  if (!port.ok()) {
    std::cerr << "hsdp-launch: " << port.status().message() << std::endl;
    return kExitFailure;
  }
  std::cerr << "hsdp-launch: coordinator on 127.0.0.1:" << *port << ", "
            << o.workers << " workers, mesh " << hsdp::MeshToString(*mesh)
            << ", worker " << worker_bin
            << (o.model.empty() ? std::string()
                                : absl::StrCat(", model ", o.model))
            << ", " << o.steps << " steps" << std::endl;
  if (o.metrics_port >= 0) {
    std::cerr << "hsdp-launch: dashboard " << FirstLine(dashboard_file)
              << std::endl;
  }

  // The live incarnation's report file of each rank.
  std::vector<std::string> reports;
  for (int r = 0; r < o.workers; ++r) {
    const std::string report = absl::StrCat(run_dir, "/worker-", r, ".jsonl");
    fs::remove(report, ec);
    reports.push_back(report);
    std::vector<std::string> wargs = {worker_bin,
                                      "--coordinator",
                                      absl::StrCat("127.0.0.1:", *port),
                                      "--job-id",
                                      o.job_id,
                                      "--rank-hint",
                                      std::to_string(r),
                                      "--steps",
                                      std::to_string(o.steps),
                                      "--gloo-hostname",
                                      "127.0.0.1",
                                      kReportFileFlag,
                                      report};
    if (!o.model.empty()) {
      wargs.push_back("--model");
      wargs.push_back(o.model);
    }
    // Checkpoints (policy interval or `hsdpctl checkpoint`) land in the run dir
    // unless the user chose a place; relaunching on the same --run-dir resumes
    // from them.
    if (std::find(o.worker_args.begin(), o.worker_args.end(),
                  "--checkpoint-dir") == o.worker_args.end()) {
      wargs.push_back("--checkpoint-dir");
      wargs.push_back(run_dir + "/checkpoints");
    }
    wargs.insert(wargs.end(), o.worker_args.begin(), o.worker_args.end());
    Child w;
    w.name = absl::StrCat("worker ", r);
    w.log = absl::StrCat(run_dir, "/worker-", r, ".log");
    w.rank = r;
    w.argv = wargs;
    auto wpid = Spawn(wargs, w.log);
    if (!wpid.ok()) {
      std::cerr << "hsdp-launch: " << wpid.status().message() << std::endl;
      return kExitFailure;
    }
    w.pid = *wpid;
    w.running = true;
    cluster.Add(w);
  }

  const bool tty = isatty(STDERR_FILENO);
  StatusClient coordinator_status(
      absl::StrCat("127.0.0.1:", *port),
      o.control_token_file.empty() ? "" : ReadToken(o.control_token_file));
  std::optional<hsdp::v1::GetStatusResponse> status;
  auto next_status = std::chrono::steady_clock::now();
  // What happened to the workers since the last generation line.
  std::vector<std::string> events;
  int failures = 0;
  int restarts = 0;
  // Every report file of every incarnation, and the restarted ones' ranks
  // and restart numbers.
  std::vector<std::string> all_reports = reports;
  std::map<std::string, std::pair<int, int>> restarted_reports;
  ReportScanner scanner;
  int64_t said_generation = 0;
  auto refresh_status = [&]() {
    absl::StatusOr<hsdp::v1::GetStatusResponse> now = coordinator_status.Get();
    if (now.ok()) status = *std::move(now);  // else the next poll tries again
  };
  // Says each generation that trained a step: its mesh, its start step, what
  // led to it and which restarted workers rejoined in it.
  auto say_generations = [&]() {
    scanner.Scan(all_reports);
    for (const auto& [number, g] : scanner.generations()) {
      if (number <= said_generation) continue;
      said_generation = number;
      const int shard = mesh->shard;
      std::string line = absl::StrCat("hsdp-launch: generation ", number, ": ",
                                      g.world_size / shard, "x", shard,
                                      " from step ", g.first_step);
      if (!events.empty()) {
        absl::StrAppend(&line, " after ", absl::StrJoin(events, ", "));
        events.clear();
      }
      for (const std::string& file : g.files) {
        auto restarted = restarted_reports.find(file);
        if (restarted == restarted_reports.end()) continue;
        absl::StrAppend(&line, "; worker ", restarted->second.first,
                        " rejoined (restart ", restarted->second.second, ")");
        restarted_reports.erase(restarted);
      }
      std::cerr << (tty ? "\r\033[K" : "") << line << std::endl;
    }
    // A restarted worker whose first report line came after its
    // generation's first line (its heal takes a moment longer).
    for (const auto& [number, g] : scanner.generations()) {
      for (const std::string& file : g.files) {
        auto restarted = restarted_reports.find(file);
        if (restarted == restarted_reports.end()) continue;
        std::cerr << (tty ? "\r\033[K" : "") << "hsdp-launch: generation "
                  << number << ": worker " << restarted->second.first
                  << " rejoined (restart " << restarted->second.second << ")"
                  << std::endl;
        restarted_reports.erase(restarted);
      }
    }
  };
  auto is_state = [&](hsdp::v1::JobState state) {
    return status.has_value() && status->state() == state;
  };

  std::string last_printed;
  auto last_print = std::chrono::steady_clock::now();
  auto show = [&](bool final_line) {
    const std::string line = ProgressLine(o, reports, status, restarts);
    const auto now = std::chrono::steady_clock::now();
    if (tty) {
      std::cerr << "\r\033[K" << line << (final_line ? "\n" : "") << std::flush;
    } else if (line != last_printed &&
               (final_line || now - last_print > std::chrono::seconds(5))) {
      // Logs and pipes get a line every few seconds instead of a
      // carriage-return animation.
      std::cerr << line << std::endl;
      last_print = now;
      last_printed = line;
    }
  };
  auto fail_job = [&](const std::string& why) {
    show(true);
    std::cerr << "hsdp-launch: " << why << std::endl;
    cluster.Terminate();
    return kExitFailure;
  };

  while (true) {
    if (g_signal != 0) {
      show(true);
      std::cerr << "hsdp-launch: " << strsignal(g_signal)
                << ", stopping all processes" << std::endl;
      cluster.Terminate();
      return 128 + g_signal;
    }
    for (const size_t index : cluster.Reap()) {
      Child& c = cluster.children()[index];
      if (c.rank < 0) {
        return fail_job(absl::StrCat("coordinator exited while workers run (",
                                     DescribeExit(c.exit_status),
                                     "): ", LastLine(c.log)));
      }
      if (ExitedOk(c.exit_status)) continue;
      ++failures;
      const std::string what =
          absl::StrCat(c.name, " failed (", DescribeExit(c.exit_status),
                       "): ", LastLine(c.log), " [log: ", c.log, "]");
      if (o.max_restarts == 0) return fail_job(what);
      // The coordinator says whether the job can go on at all.
      refresh_status();
      if (is_state(hsdp::v1::JOB_STATE_FAILED)) {
        return fail_job(absl::StrCat("the job failed: ", status->message(),
                                     " (", c.name, ": ",
                                     DescribeExit(c.exit_status), ")"));
      }
      if (status.has_value() && status->last_committed_step() < 0) {
        // Before the first step a failure is the set-up's (a flag, the
        // model): a new process would fail the same way.
        return fail_job(absl::StrCat(what,
                                     "; not restarted: the job has not "
                                     "committed a step yet"));
      }
      if (restarts >= o.max_restarts) {
        return fail_job(absl::StrCat(what, "; all ", o.max_restarts,
                                     " restarts (--max-restarts) are used"));
      }
      if (is_state(hsdp::v1::JOB_STATE_FINISHED) ||
          is_state(hsdp::v1::JOB_STATE_DRAINING)) {
        // No step is left for a new process to join.
        std::cerr << "hsdp-launch: " << what << "; not restarted: the job is "
                  << (is_state(hsdp::v1::JOB_STATE_FINISHED) ? "finished"
                                                             : "draining")
                  << std::endl;
        continue;
      }
      ++restarts;
      const std::string report = absl::StrCat(run_dir, "/worker-", c.rank,
                                              ".restart-", restarts, ".jsonl");
      fs::remove(report, ec);
      auto flag = std::find(c.argv.begin(), c.argv.end(), kReportFileFlag);
      if (flag != c.argv.end() && std::next(flag) != c.argv.end()) {
        *std::next(flag) = report;
      }
      reports[c.rank] = report;
      all_reports.push_back(report);
      restarted_reports[report] = {c.rank, restarts};
      std::ofstream(c.log, std::ios::app)
          << "hsdp-launch: restart " << restarts << " of " << o.max_restarts
          << " (the previous process " << DescribeExit(c.exit_status) << ")"
          << std::endl;
      auto pid = Spawn(c.argv, c.log);
      if (!pid.ok()) return fail_job(std::string(pid.status().message()));
      c.pid = *pid;
      c.running = true;
      events.push_back(absl::StrCat(c.name, " was lost (",
                                    DescribeExit(c.exit_status), ")"));
      std::cerr << (tty ? "\r\033[K" : "") << "hsdp-launch: " << what
                << "; restarting it (restart " << restarts << " of "
                << o.max_restarts << ", report " << report << ")" << std::endl;
    }
    bool workers_running = false;
    for (const Child& c : cluster.children()) {
      workers_running |= (c.running && c.rank >= 0);
    }
    if (!workers_running) break;
    if (std::chrono::steady_clock::now() >= next_status) {
      refresh_status();
      next_status = std::chrono::steady_clock::now() + kStatusInterval;
      if (is_state(hsdp::v1::JOB_STATE_FAILED)) {
        return fail_job(absl::StrCat("the job failed: ", status->message()));
      }
    }
    say_generations();
    show(false);
    std::this_thread::sleep_for(kPollInterval);
  }
  refresh_status();
  say_generations();
  show(true);
  if (is_state(hsdp::v1::JOB_STATE_FAILED)) {
    return fail_job(absl::StrCat("the job failed: ", status->message()));
  }
  // A worker that failed without a restart (the job had finished or was
  // draining) counts only if the job did not finish.
  bool all_ok = true;
  for (const Child& c : cluster.children()) {
    if (c.rank >= 0) all_ok &= ExitedOk(c.exit_status);
  }
  if (!all_ok && !is_state(hsdp::v1::JOB_STATE_FINISHED)) {
    return fail_job("the workers stopped before the job finished");
  }
  cluster.Terminate();  // the coordinator: graceful SIGTERM
  std::cerr << "hsdp-launch: all " << o.workers << " workers finished";
  if (failures > 0 || restarts > 0) {
    std::cerr << " (" << failures
              << (failures == 1 ? " failure, " : " failures, ") << restarts
              << (restarts == 1 ? " restart" : " restarts");
    if (status.has_value()) {
      std::cerr << "; generation " << status->generation() << ", "
                << MeshOf(*status);
    }
    std::cerr << ")";
  }
  std::cerr << "; reports in " << run_dir << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"hsdp-launch: run a coordinator and N workers on this machine"};
  app.add_option("--workers", o.workers, "number of worker processes")
      ->required();
  app.add_option("--mesh", o.mesh, "RxS (default 1xWORKERS)");
  app.add_option(
      "--model", o.model,
      "model name (default: the worker's, gpt-tiny for hsdp-worker)");
  app.add_option("--steps", o.steps, "training steps");
  app.add_option("--policy-file", o.policy_file,
                 "initial policy for the coordinator");
  app.add_option("--port", o.port, "coordinator port (0: ephemeral)");
  app.add_option("--metrics-port", o.metrics_port,
                 "port of the coordinator's /metrics and dashboard on "
                 "127.0.0.1 (0: ephemeral, -1: none)");
  app.add_option("--control-token-file", o.control_token_file,
                 "bearer token hsdpctl and the dashboard's policy form need");
  app.add_option("--job-id", o.job_id, "job id");
  app.add_option("--run-dir", o.run_dir,
                 "logs, reports and coordinator state (default: a temp dir)");
  app.add_option("--bin-dir", o.bin_dir,
                 "where hsdp-coordinator and hsdp-worker are");
  app.add_option("--worker-binary", o.worker_binary,
                 "the workers' executable: a user's worker built on "
                 "hsdp::train::WorkerMain (default: hsdp-worker in --bin-dir)");
  app.add_option("--max-restarts", o.max_restarts,
                 absl::StrCat("restarts of dead workers in all (default ",
                              kDefaultMaxRestarts,
                              "); 0: the first failure stops the job"));
  // Flags hsdp-launch does not know go to every worker as well (e.g.
  // --microbatch-size 8).
  app.allow_extras(true);
  try {
    // Everything after `--` goes to the workers verbatim (CLI11 would reorder
    // it).
    int launcher_argc = argc;
    for (int i = 1; i < argc; ++i) {
      if (std::string(argv[i]) == "--") {
        launcher_argc = i;
        o.worker_args.assign(argv + i + 1, argv + argc);
        break;
      }
    }
    app.parse(launcher_argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << "hsdp-launch: " << e.what() << " (see --help)" << std::endl;
    return kExitUsage;
  }
  for (const std::string& extra : app.remaining())
    o.worker_args.push_back(extra);
  if (o.workers <= 0 || o.steps < 0 || o.port < 0 || o.metrics_port < -1 ||
      o.max_restarts < 0) {
    std::cerr << "hsdp-launch: --workers must be > 0, --steps, --port and "
                 "--max-restarts >= 0, --metrics-port >= -1"
              << std::endl;
    return kExitUsage;
  }
  return Run(o);
}
