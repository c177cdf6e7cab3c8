// End-to-end: real hsdp-coordinator, hsdp-worker and hsdpctl processes on
// loopback.
//
// One baseline run (coordinator + 4 workers as 2x2) is shared by the runs
// compared against it:
//   parity with the single-process reference (final parameters and losses
//   within 1e-5), a policy change mid-run (bitwise identical losses, higher
//   peak with reshard off), a coordinator SIGKILLed and restarted (every step
//   once, bitwise identical losses), checkpoint + kill every worker + restart
//   (continues from the checkpoint, identical losses),
// and the bad-use cases each end in a one-line error and a non-zero exit.
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <torch/serialize/input-archive.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "gtest/gtest.h"

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr char kBinDir[] = HSDP_BIN_DIR;
constexpr int kWorkers = 4;
constexpr char kMesh[] = "2x2";
// Small enough for 4 processes on 2 cores, large enough to shard unevenly (seq
// 24 rows). Four blocks: with reshard after forward, backward holds the current
// block and the prefetched one (plus root) unsharded — fewer than all of them,
// so turning reshard off visibly raises the peak.
constexpr char kDims[] = "32,4,2,24";
constexpr int kSteps = 40;
constexpr auto kRunTimeout = std::chrono::seconds(150);

// ---- processes
// ---------------------------------------------------------------------------------

struct Proc {
  pid_t pid = -1;
  std::string log;
};

Proc Spawn(const std::vector<std::string>& argv, const std::string& log) {
  const pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    dup2(fd, STDOUT_FILENO);
    dup2(fd, STDERR_FILENO);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  return Proc{pid, log};
}

// Exit code, 128 + signal, or -1 on timeout (the process is then killed).
int Wait(const Proc& p, std::chrono::seconds timeout = kRunTimeout) {
  const auto deadline = Clock::now() + timeout;
  int status = 0;
  while (waitpid(p.pid, &status, WNOHANG) == 0) {
    if (Clock::now() > deadline) {
      kill(p.pid, SIGKILL);
      waitpid(p.pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

void Kill(const Proc& p, int sig = SIGKILL) {
  kill(p.pid, sig);
  int status;
  waitpid(p.pid, &status, 0);
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> out;
  for (absl::string_view l : absl::StrSplit(text, '\n', absl::SkipEmpty()))
    out.emplace_back(l);
  return out;
}

std::string Bin(const std::string& name) {
  return absl::StrCat(kBinDir, "/", name);
}

// ---- report lines
// ------------------------------------------------------------------------------

std::string Field(const std::string& line, const std::string& key) {
  const std::string needle = absl::StrCat("\"", key, "\":");
  size_t at = line.find(needle);
  if (at == std::string::npos) return "";
  at += needle.size();
  if (line[at] == '"')
    return line.substr(at + 1, line.find('"', at + 1) - at - 1);
  return line.substr(at, line.find_first_of(",}", at) - at);
}

struct StepRecord {
  int64_t step = 0;
  std::string loss_hex;
  double loss = 0;
  int64_t peak = 0;
  std::string reshard_after_forward;
};

std::vector<StepRecord> ReadReport(const std::string& path) {
  std::vector<StepRecord> out;
  for (const std::string& line : Lines(ReadFile(path))) {
    StepRecord r;
    EXPECT_TRUE(absl::SimpleAtoi(Field(line, "step"), &r.step)) << line;
    r.loss_hex = Field(line, "loss_hex");
    EXPECT_TRUE(absl::SimpleAtod(Field(line, "loss"), &r.loss)) << line;
    absl::SimpleAtoi(Field(line, "peak_memory_bytes"), &r.peak);
    r.reshard_after_forward = Field(line, "reshard_after_forward");
    out.push_back(r);
  }
  return out;
}

int64_t StepsReported(const std::string& path) {
  return static_cast<int64_t>(Lines(ReadFile(path)).size());
}

// ---- a local cluster
// ---------------------------------------------------------------------------

class Cluster {
 public:
  explicit Cluster(const std::string& name) {
    dir_ = (fs::path(::testing::TempDir()) /
            absl::StrCat("hsdp-e2e-", name, "-", getpid()))
               .string();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  ~Cluster() {
    for (const Proc& p : workers_) kill(p.pid, SIGKILL);
    if (coordinator_.pid > 0) kill(coordinator_.pid, SIGKILL);
    for (const Proc& p : workers_) waitpid(p.pid, nullptr, 0);
    if (coordinator_.pid > 0) waitpid(coordinator_.pid, nullptr, 0);
    // Keep the logs of a failed test for inspection; clean up after a passing
    // one.
    if (!::testing::Test::HasFailure()) {
      std::error_code ec;
      fs::remove_all(dir_, ec);
    }
  }

  // Starts the coordinator (port 0 picks one; a restart passes the old port).
  void StartCoordinator(int world, const std::string& mesh, int port = 0,
                        const std::string& policy_file = "") {
    const std::string port_file = dir_ + "/port";
    fs::remove(port_file);
    std::vector<std::string> args = {Bin("hsdp-coordinator"),
                                     "--job-id",
                                     "e2e",
                                     "--world-size",
                                     std::to_string(world),
                                     "--mesh",
                                     mesh,
                                     "--listen",
                                     absl::StrCat("127.0.0.1:", port),
                                     "--port-file",
                                     port_file,
                                     "--state-dir",
                                     dir_ + "/state",
                                     "--metrics-listen",
                                     "",
                                     "--heartbeat-timeout",
                                     "30"};
    if (!policy_file.empty()) {
      args.push_back("--policy-file");
      args.push_back(policy_file);
    }
    coordinator_ = Spawn(args, dir_ + "/coordinator.log");
    const auto deadline = Clock::now() + std::chrono::seconds(20);
    while (Clock::now() < deadline) {
      std::string text = ReadFile(port_file);
      if (absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &port_) &&
          port_ > 0)
        return;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ADD_FAILURE() << "coordinator did not start: "
                  << ReadFile(dir_ + "/coordinator.log");
  }

  void StartWorkers(int n, const std::vector<std::string>& extra = {},
                    int64_t steps = kSteps) {
    workers_.clear();
    for (int r = 0; r < n; ++r) {
      std::vector<std::string> args = {Bin("hsdp-worker"),
                                       "--coordinator",
                                       address(),
                                       "--job-id",
                                       "e2e",
                                       "--rank-hint",
                                       std::to_string(r),
                                       "--model",
                                       "gpt-tiny",
                                       "--dims",
                                       kDims,
                                       "--steps",
                                       std::to_string(steps),
                                       "--microbatch-size",
                                       "2",
                                       "--gloo-hostname",
                                       "127.0.0.1",
                                       "--report-file",
                                       report(r),
                                       "--collective-timeout",
                                       "60",
                                       "--coordinator-timeout",
                                       "60"};
      args.insert(args.end(), extra.begin(), extra.end());
      workers_.push_back(
          Spawn(args, absl::StrCat(dir_, "/worker-", r, ".log")));
    }
  }

  // Waits for every worker; expects exit 0 from each.
  void WaitWorkers() {
    for (size_t r = 0; r < workers_.size(); ++r) {
      EXPECT_EQ(Wait(workers_[r]), 0)
          << "worker " << r << ": " << ReadFile(workers_[r].log);
    }
    workers_.clear();
  }

  // Blocks until rank 0 reported at least `steps` steps (or the time runs out).
  bool WaitForSteps(int64_t steps, int rank = 0) {
    const auto deadline = Clock::now() + kRunTimeout;
    while (Clock::now() < deadline) {
      if (StepsReported(report(rank)) >= steps) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  }

  int Ctl(const std::vector<std::string>& args, std::string* output = nullptr) {
    std::vector<std::string> argv = {Bin("hsdpctl"), "--coordinator",
                                     address()};
    argv.insert(argv.end(), args.begin(), args.end());
    const std::string log = dir_ + "/hsdpctl.out";
    fs::remove(log);
    const int rc = Wait(Spawn(argv, log), std::chrono::seconds(30));
    if (output != nullptr) *output = ReadFile(log);
    return rc;
  }

  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }
  int port() const { return port_; }
  std::string report(int r) const {
    return absl::StrCat(dir_, "/worker-", r, ".jsonl");
  }
  const std::string& dir() const { return dir_; }
  Proc& coordinator() { return coordinator_; }
  std::vector<Proc>& workers() { return workers_; }

 private:
  std::string dir_;
  Proc coordinator_;
  int port_ = 0;
  std::vector<Proc> workers_;
};

// The baseline 2x2 run every other run is compared with; run once per test
// binary.
const std::vector<std::vector<StepRecord>>& Baseline() {
  static auto* reports = [] {
    auto* out = new std::vector<std::vector<StepRecord>>;
    Cluster c("baseline");
    c.StartCoordinator(kWorkers, kMesh);
    c.StartWorkers(kWorkers);
    c.WaitWorkers();
    for (int r = 0; r < kWorkers; ++r) out->push_back(ReadReport(c.report(r)));
    return out;
  }();
  return *reports;
}

// Every rank reported steps 0..kSteps-1 exactly once with losses bitwise equal
// to the baseline.
void ExpectSameAsBaseline(const Cluster& c) {
  const auto& base = Baseline();
  for (int r = 0; r < kWorkers; ++r) {
    std::vector<StepRecord> got = ReadReport(c.report(r));
    ASSERT_EQ(got.size(), static_cast<size_t>(kSteps)) << "rank " << r;
    for (int s = 0; s < kSteps; ++s) {
      EXPECT_EQ(got[s].step, s) << "rank " << r;
      EXPECT_EQ(got[s].loss_hex, base[r][s].loss_hex)
          << "rank " << r << " step " << s;
    }
  }
}

std::map<std::string, at::Tensor> LoadParams(const std::string& path) {
  torch::serialize::InputArchive archive;
  archive.load_from(path);
  std::map<std::string, at::Tensor> out;
  for (const std::string& key : archive.keys()) {
    at::Tensor t;
    archive.read(key, t);
    out[key] = t;
  }
  return out;
}

TEST(E2eTest, ShardedTwoByTwoMatchesSingleProcessReference) {
  // Short: AdamW normalises updates, so fp32 rounding differences between a
  // sharded and an unsharded gradient sum grow with the step count; the parity
  // bound is for a few steps.
  constexpr int kParitySteps = 12;
  Cluster c("parity");
  c.StartCoordinator(kWorkers, kMesh);
  c.StartWorkers(kWorkers, {"--final-params", c.dir() + "/final.pt"},
                 kParitySteps);
  c.WaitWorkers();
  const std::vector<StepRecord> sharded_steps = ReadReport(c.report(0));
  ASSERT_EQ(sharded_steps.size(), static_cast<size_t>(kParitySteps));
  const std::string ref_params = c.dir() + "/ref.pt";
  const std::string ref_report = c.dir() + "/ref.jsonl";
  Proc ref = Spawn({Bin("hsdp-worker"), "--reference", "--world-size",
                    std::to_string(kWorkers), "--microbatches", "1", "--model",
                    "gpt-tiny", "--dims", kDims, "--steps",
                    std::to_string(kParitySteps), "--microbatch-size", "2",
                    "--report-file", ref_report, "--final-params", ref_params},
                   c.dir() + "/ref.log");
  ASSERT_EQ(Wait(ref), 0) << ReadFile(ref.log);

  std::vector<StepRecord> ref_steps = ReadReport(ref_report);
  ASSERT_EQ(ref_steps.size(), static_cast<size_t>(kParitySteps));
  for (int s = 0; s < kParitySteps; ++s) {
    EXPECT_NEAR(sharded_steps[s].loss, ref_steps[s].loss, 1e-5) << "step " << s;
  }
  EXPECT_LT(ref_steps.back().loss, ref_steps.front().loss - 0.5);  // it learns

  auto sharded = LoadParams(c.dir() + "/final.pt");
  auto reference = LoadParams(ref_params);
  ASSERT_EQ(sharded.size(), reference.size());
  for (const auto& [name, t] : reference) {
    ASSERT_TRUE(sharded.count(name)) << name;
    ASSERT_TRUE(sharded[name].sizes().equals(t.sizes())) << name;
    const double diff = (sharded[name] - t).abs().max().item<double>();
    EXPECT_LT(diff, 1e-5) << name;
  }
}

TEST(E2eTest, PolicyChangeMidRunKeepsLossesBitwiseAndRaisesPeak) {
  Baseline();
  Cluster c("policy");
  c.StartCoordinator(kWorkers, kMesh);
  c.StartWorkers(kWorkers);
  ASSERT_TRUE(c.WaitForSteps(4));
  std::string out;
  ASSERT_EQ(c.Ctl({"policy", "set", "--reshard-after-forward=false"}, &out), 0)
      << out;
  c.WaitWorkers();
  ExpectSameAsBaseline(c);

  // The change landed on one step for every rank, mid-run, and raised the peak
  // after it.
  std::vector<StepRecord> r0 = ReadReport(c.report(0));
  int changed = -1;
  for (int s = 0; s < kSteps; ++s) {
    if (r0[s].reshard_after_forward.find('1') == std::string::npos) {
      changed = s;
      break;
    }
  }
  ASSERT_GT(changed, 0) << "policy change never took effect";
  ASSERT_LT(changed, kSteps);
  for (int r = 1; r < kWorkers; ++r) {
    std::vector<StepRecord> rr = ReadReport(c.report(r));
    EXPECT_EQ(rr[changed].reshard_after_forward,
              r0[changed].reshard_after_forward);
    EXPECT_NE(rr[changed - 1].reshard_after_forward,
              r0[changed].reshard_after_forward);
  }
  EXPECT_GT(r0[changed].peak, r0[changed - 1].peak);
  EXPECT_GT(r0.back().peak, r0.front().peak);
}

TEST(E2eTest, CoordinatorKilledAndRestartedLosesNoStep) {
  Baseline();
  Cluster c("restart");
  c.StartCoordinator(kWorkers, kMesh);
  const int port = c.port();
  c.StartWorkers(kWorkers);
  ASSERT_TRUE(c.WaitForSteps(5));
  Kill(c.coordinator(), SIGKILL);
  // The kill must land mid-run for the test to mean anything.
  ASSERT_LT(StepsReported(c.report(0)), kSteps);
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  c.StartCoordinator(kWorkers, kMesh, port);
  c.WaitWorkers();
  ExpectSameAsBaseline(c);
}

TEST(E2eTest, CheckpointKillAllWorkersRestartContinuesIdentically) {
  Baseline();
  Cluster c("checkpoint");
  const std::string policy = c.dir() + "/policy.json";
  std::ofstream(policy) << "{\"checkpointInterval\": 5}\n";
  const std::string ckpt = c.dir() + "/ckpt";
  c.StartCoordinator(kWorkers, kMesh, 0, policy);
  const int port = c.port();
  c.StartWorkers(kWorkers, {"--checkpoint-dir", ckpt});
  ASSERT_TRUE(c.WaitForSteps(12));
  for (Proc& p : c.workers()) Kill(p);
  c.workers().clear();
  Kill(c.coordinator());
  const int64_t before = StepsReported(c.report(0));
  ASSERT_LT(before, kSteps) << "the workers finished before the kill";
  // The whole job restarts: the coordinator on its state directory, the workers
  // from the newest complete checkpoint.
  c.StartCoordinator(kWorkers, kMesh, port, policy);
  c.StartWorkers(kWorkers, {"--checkpoint-dir", ckpt});
  c.WaitWorkers();

  const auto& base = Baseline();
  for (int r = 0; r < kWorkers; ++r) {
    std::vector<StepRecord> got = ReadReport(c.report(r));
    // Steps after the checkpoint ran twice (before the kill and after the
    // restart); every copy of a step has the baseline's loss bits, and the run
    // finished.
    ASSERT_GT(got.size(), static_cast<size_t>(kSteps));
    EXPECT_EQ(got.back().step, kSteps - 1);
    int64_t resumed_at = -1;
    for (size_t i = 1; i < got.size(); ++i) {
      if (got[i].step <= got[i - 1].step && resumed_at < 0)
        resumed_at = got[i].step;
    }
    EXPECT_GT(resumed_at, 0)
        << "rank " << r << " did not resume from a checkpoint";
    EXPECT_TRUE(fs::exists(absl::StrFormat("%s/step-%08d/rank-%d-of-%d.pt",
                                           ckpt, resumed_at - 1, r, kWorkers)))
        << "rank " << r << " resumed at step " << resumed_at
        << " without that checkpoint";
    for (const StepRecord& s : got) {
      EXPECT_EQ(s.loss_hex, base[r][s.step].loss_hex)
          << "rank " << r << " step " << s.step;
    }
  }
  EXPECT_GE(before, 12);
}

// ---- bad use
// -----------------------------------------------------------------------------------

// Runs argv to completion; expects a non-zero exit and exactly one line on
// stderr/stdout that contains `needle`.
void ExpectOneLineError(const std::vector<std::string>& argv,
                        const std::string& needle, const std::string& name) {
  Cluster scratch("bad-" + name);  // a directory removed when the test passes
  const std::string log = scratch.dir() + "/output.log";
  const int rc = Wait(Spawn(argv, log), std::chrono::seconds(60));
  const std::string out = ReadFile(log);
  EXPECT_NE(rc, 0) << out;
  EXPECT_NE(rc, -1) << "timed out: " << out;
  EXPECT_EQ(Lines(out).size(), 1u) << out;
  EXPECT_NE(out.find(needle), std::string::npos) << out;
}

TEST(E2eBadUseTest, UnknownModel) {
  ExpectOneLineError({Bin("hsdp-worker"), "--model", "gpt-enormous",
                      "--coordinator", "127.0.0.1:1"},
                     "unknown model 'gpt-enormous'", "model");
}

TEST(E2eBadUseTest, MeshNotMatchingWorld) {
  ExpectOneLineError({Bin("hsdp-launch"), "--workers", "4", "--mesh", "3x2"},
                     "3x2", "launch-mesh");
  ExpectOneLineError(
      {Bin("hsdp-coordinator"), "--job-id", "x", "--world-size", "4", "--mesh",
       "3x2", "--listen", "127.0.0.1:0", "--metrics-listen", ""},
      "3x2", "coordinator-mesh");
}

TEST(E2eBadUseTest, UnreachableCoordinator) {
  ExpectOneLineError({Bin("hsdp-worker"), "--coordinator", "127.0.0.1:1",
                      "--job-id", "x", "--coordinator-timeout", "2"},
                     "unreachable", "unreachable");
}

TEST(E2eBadUseTest, DifferentModelThanTheJob) {
  Cluster c("badmodel");
  c.StartCoordinator(2, "1x2");
  // The first worker defines the job's model; the second brings another one.
  c.StartWorkers(1);
  std::this_thread::sleep_for(std::chrono::seconds(2));
  ExpectOneLineError({Bin("hsdp-worker"), "--coordinator", c.address(),
                      "--job-id", "e2e", "--model", "gpt-tiny", "--dims",
                      "64,2,4,24", "--coordinator-timeout", "5"},
                     "unit", "different-model");
}

}  // namespace

// ---- drain and the launcher
// ---------------------------------------------------------------------

TEST(E2eControlTest, DrainStopsEveryWorkerAtTheSameStep) {
  Cluster c("drain");
  c.StartCoordinator(kWorkers, kMesh);
  c.StartWorkers(kWorkers, {}, 100000);
  ASSERT_TRUE(c.WaitForSteps(3));
  std::string out;
  ASSERT_EQ(c.Ctl({"drain"}, &out), 0) << out;
  c.WaitWorkers();  // every worker exits 0
  // Stopped by the drain, early and on the same step everywhere.
  const int64_t steps = StepsReported(c.report(0));
  EXPECT_GE(steps, 3);
  EXPECT_LT(steps, 1000);
  for (int r = 1; r < kWorkers; ++r)
    EXPECT_EQ(StepsReported(c.report(r)), steps) << "rank " << r;
}

TEST(E2eLaunchTest, SigtermStopsEveryProcess) {
  Cluster scratch("launch-term");
  const std::string dir = scratch.dir() + "/run";
  Proc launch = Spawn({Bin("hsdp-launch"), "--workers", "2", "--mesh", "1x2",
                       "--steps", "100000", "--run-dir", dir, "--", "--dims",
                       kDims, "--microbatch-size", "2"},
                      scratch.dir() + "/launch.log");
  const std::string report = dir + "/worker-0.jsonl";
  const auto deadline = Clock::now() + std::chrono::seconds(60);
  while (StepsReported(report) < 2 && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_GE(StepsReported(report), 2);
  kill(launch.pid, SIGTERM);
  EXPECT_EQ(Wait(launch, std::chrono::seconds(20)), 128 + SIGTERM)
      << ReadFile(launch.log);
  // Nothing keeps training once the launcher is gone.
  const int64_t after = StepsReported(report);
  std::this_thread::sleep_for(std::chrono::seconds(1));
  EXPECT_EQ(StepsReported(report), after);
}

TEST(E2eLaunchTest, NamesTheFirstFailedWorker) {
  Cluster scratch("launch-fail");
  const std::string log = scratch.dir() + "/launch.log";
  Proc launch = Spawn({Bin("hsdp-launch"), "--workers", "2", "--model",
                       "gpt-bogus", "--run-dir", scratch.dir() + "/run"},
                      log);
  EXPECT_EQ(Wait(launch, std::chrono::seconds(60)), 1);
  const std::string out = ReadFile(log);
  EXPECT_NE(
      out.find(
          "failed (exit status 1): hsdp-worker: unknown model 'gpt-bogus'"),
      std::string::npos)
      << out;
  EXPECT_NE(out.find("worker "), std::string::npos) << out;
}

TEST(E2eControlTest, GradientAccumulationFromThePolicyMatchesReference) {
  Cluster c("microbatches");
  const std::string policy = c.dir() + "/policy.json";
  std::ofstream(policy) << "{\"microbatches\": 2}\n";
  c.StartCoordinator(kWorkers, kMesh, 0, policy);
  constexpr int kAccumSteps = 6;
  c.StartWorkers(kWorkers, {}, kAccumSteps);
  c.WaitWorkers();
  const std::string ref_report = c.dir() + "/ref.jsonl";
  Proc ref = Spawn(
      {Bin("hsdp-worker"), "--reference", "--world-size",
       std::to_string(kWorkers), "--microbatches", "2", "--model", "gpt-tiny",
       "--dims", kDims, "--steps", std::to_string(kAccumSteps),
       "--microbatch-size", "2", "--report-file", ref_report},
      c.dir() + "/ref.log");
  ASSERT_EQ(Wait(ref), 0) << ReadFile(ref.log);
  std::vector<StepRecord> sharded = ReadReport(c.report(0));
  std::vector<StepRecord> reference = ReadReport(ref_report);
  ASSERT_EQ(sharded.size(), static_cast<size_t>(kAccumSteps));
  ASSERT_EQ(reference.size(), static_cast<size_t>(kAccumSteps));
  for (int s = 0; s < kAccumSteps; ++s) {
    EXPECT_NEAR(sharded[s].loss, reference[s].loss, 1e-5) << "step " << s;
  }
  // Each step really ran two microbatches.
  EXPECT_NE(ReadFile(c.report(0)).find("\"microbatches\":2"),
            std::string::npos);
}
