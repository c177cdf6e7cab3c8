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
#include "tests/e2e/cluster.h"

namespace hsdp::e2e {
namespace {

namespace fs = std::filesystem;
constexpr int kWorkers = 4;
constexpr char kMesh[] = "2x2";

// The baseline 2x2 run every other run is compared with.
BaselineRun& Baseline() {
  static auto* baseline =
      new BaselineRun("baseline", kWorkers, kMesh, {}, kSteps);
  return *baseline;
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
  ASSERT_EQ(RunReference(kWorkers, 1, kParitySteps, ref_report, ref_params,
                         c.dir() + "/ref.log"),
            0)
      << ReadFile(c.dir() + "/ref.log");

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
  Baseline().Reports();
  Cluster c("policy");
  c.StartCoordinator(kWorkers, kMesh);
  c.StartWorkers(kWorkers);
  ASSERT_TRUE(c.WaitForSteps(4));
  std::string out;
  ASSERT_EQ(c.Ctl({"policy", "set", "--reshard-after-forward=false"}, &out), 0)
      << out;
  c.WaitWorkers();
  Baseline().ExpectSameAs(c);

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

// The heartbeat timeout is short: workers must reach the restarted
// coordinator well within it, or it declares them all lost. Twice: gRPC
// re-resolves the name before reconnecting, and after a first outage an idle
// channel reconnects only when a call waits for it.
TEST(E2eTest, CoordinatorKilledAndRestartedLosesNoStep) {
  Baseline().Reports();
  Cluster c("restart");
  const std::vector<std::string> flags = {"--heartbeat-timeout", "6"};
  c.StartCoordinator(kWorkers, kMesh, 0, "", flags);
  const int port = c.port();
  c.StartWorkers(kWorkers);
  for (const int at : {5, 20}) {
    ASSERT_TRUE(c.WaitForSteps(at));
    Kill(c.coordinator(), SIGKILL);
    // The kill must land mid-run for the test to mean anything.
    ASSERT_LT(StepsReported(c.report(0)), kSteps);
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    c.StartCoordinator(kWorkers, kMesh, port, "", flags);
  }
  c.WaitWorkers();
  Baseline().ExpectSameAs(c);
}

TEST(E2eTest, CheckpointKillAllWorkersRestartContinuesIdentically) {
  Baseline().Reports();
  Cluster c("checkpoint");
  const std::string policy = c.dir() + "/policy.json";
  std::ofstream(policy) << "{\"checkpointInterval\": 5}\n";
  const std::string ckpt = c.dir() + "/ckpt";
  c.StartCoordinator(kWorkers, kMesh, 0, policy);
  const int port = c.port();
  c.StartWorkers(kWorkers, {"--checkpoint-dir", ckpt});
  ASSERT_TRUE(c.WaitForSteps(12));
  // The coordinator goes first: alive, it would re-form the workers not yet
  // killed on a smaller mesh when the first ones die.
  Kill(c.coordinator());
  for (Proc& p : c.workers()) Kill(p);
  c.workers().clear();
  const int64_t before = StepsReported(c.report(0));
  ASSERT_LT(before, kSteps) << "the workers finished before the kill";
  // The whole job restarts: the coordinator on its state directory, the workers
  // from the newest complete checkpoint.
  // A worker slow to start on a loaded machine is waited for, so every rank
  // resumes from the checkpoint rather than joining later to be healed.
  c.StartCoordinator(kWorkers, kMesh, port, policy, {"--reform-window", "60"});
  c.StartWorkers(kWorkers, {"--checkpoint-dir", ckpt});
  c.WaitWorkers();

  const auto& base = Baseline().Reports();
  for (int r = 0; r < kWorkers; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    ExpectResumedFromCheckpoint(c.report(r), c.worker_log(r), ckpt, kSteps,
                                base[r]);
  }

  EXPECT_GE(before, 12);
}

// ---- bad use
// -----------------------------------------------------------------------------------

TEST(E2eBadUseTest, UnknownModel) {
  ExpectOneLineError({Bin("hsdp-worker"), "--model", "gpt-enormous",
                      "--coordinator", "127.0.0.1:1"},
                     "unknown model 'gpt-enormous'", "model");
}

TEST(E2eBadUseTest, WorkerBinaryNotAnExecutable) {
  ExpectOneLineError({Bin("hsdp-launch"), "--workers", "2", "--worker-binary",
                      "/nonexistent/my-worker"},
                     "--worker-binary /nonexistent/my-worker: no such file",
                     "launch-worker-binary-missing");
  ExpectOneLineError(
      {Bin("hsdp-launch"), "--workers", "2", "--worker-binary", "/tmp"},
      "--worker-binary /tmp: not a regular file", "launch-worker-binary-dir");
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
  ASSERT_EQ(RunReference(kWorkers, 2, kAccumSteps, ref_report, "",
                         c.dir() + "/ref.log"),
            0)
      << ReadFile(c.dir() + "/ref.log");
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

}  // namespace hsdp::e2e
