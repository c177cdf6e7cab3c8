// hsdp-launch as a user runs it, with a worker SIGKILLed mid-run: by default
// the launcher starts it again with its own command line, it rejoins and is
// healed, the survivors' processes train every step, the job finishes and the
// launcher exits 0 with the sample ledger over every report file exact. With
// --max-restarts 0 the first failure stops the job. A non-finite loss fails
// the job and the launcher with the coordinator's reason.
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "tests/e2e/cluster.h"

namespace hsdp::e2e {
namespace {

namespace fs = std::filesystem;

constexpr int kLaunchSteps = 150;
// 2x2 with one microbatch per rank; a 1x2 generation keeps the same global
// batch (two per rank).
constexpr int kGlobalMicrobatches = 4;
constexpr int kKilledRank = 3;
// The worker is killed once it reported this many steps.
constexpr int kKillAfterSteps = 20;
constexpr auto kLaunchTimeout = std::chrono::seconds(120);

// The pid of the child of `parent` whose command line contains `needle`, or
// -1.
pid_t ChildWith(pid_t parent, const std::string& needle) {
  for (const auto& entry : fs::directory_iterator("/proc")) {
    pid_t pid = 0;
    if (!absl::SimpleAtoi(entry.path().filename().string(), &pid)) continue;
    // /proc/PID/stat: "pid (comm) state ppid ...".
    const std::string stat = ReadFile(entry.path().string() + "/stat");
    const size_t close = stat.rfind(')');
    if (close == std::string::npos) continue;
    const std::vector<std::string> fields =
        absl::StrSplit(stat.substr(close + 2), ' ');
    pid_t ppid = 0;
    if (fields.size() < 2 || !absl::SimpleAtoi(fields[1], &ppid) ||
        ppid != parent) {
      continue;
    }
    std::string cmdline = ReadFile(entry.path().string() + "/cmdline");
    std::replace(cmdline.begin(), cmdline.end(), '\0', ' ');
    if (cmdline.find(needle) != std::string::npos) return pid;
  }
  return -1;
}

std::vector<std::string> LaunchArgv(const std::string& run_dir,
                                    const std::vector<std::string>& extra,
                                    int64_t steps) {
  std::vector<std::string> argv = {Bin("hsdp-launch"),
                                   "--workers",
                                   "4",
                                   "--mesh",
                                   "2x2",
                                   "--steps",
                                   std::to_string(steps),
                                   "--run-dir",
                                   run_dir,
                                   "--metrics-port",
                                   "-1"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  for (const char* flag : {"--", "--dims", kDims, "--microbatch-size", "2"}) {
    argv.push_back(flag);
  }
  return argv;
}

bool IsJsonObject(const std::string& line) {
  return nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false)
      .is_object();
}

// Kills rank `kKilledRank`'s first process once it reported
// `kKillAfterSteps` steps; false if it never did.
bool KillWorkerMidRun(const Proc& launch, const std::string& run_dir) {
  const std::string report =
      absl::StrCat(run_dir, "/worker-", kKilledRank, ".jsonl");
  const auto deadline = Clock::now() + std::chrono::seconds(60);
  while (StepsReported(report) < kKillAfterSteps && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (StepsReported(report) < kKillAfterSteps) return false;
  const pid_t worker = ChildWith(launch.pid, "--report-file " + report);
  if (worker <= 0) return false;
  kill(worker, SIGKILL);
  return true;
}

TEST(LaunchE2eTest, AKilledWorkerIsRestartedHealedAndTheJobFinishes) {
  Cluster scratch("launch-restart");
  const std::string run_dir = scratch.dir() + "/run";
  const std::string log = scratch.dir() + "/launch.log";
  // The coordinator's re-form window, from the environment it inherits. The
  // killed worker's connection closed, so the survivors re-form on 1x2 as
  // soon as they reported in; the restarted worker joins after that and the
  // job grows back to 2x2 at a step boundary.
  setenv("HSDP_REFORM_WINDOW", "2", /*overwrite=*/1);
  Proc launch = Spawn(LaunchArgv(run_dir, {}, kLaunchSteps), log);
  unsetenv("HSDP_REFORM_WINDOW");
  ASSERT_TRUE(KillWorkerMidRun(launch, run_dir)) << ReadFile(log);
  ASSERT_EQ(Wait(launch, kLaunchTimeout), 0) << ReadFile(log);

  const std::string out = ReadFile(log);
  EXPECT_NE(out.find("worker 3 failed (killed by signal 9)"), std::string::npos)
      << out;
  EXPECT_NE(out.find("restarting it (restart 1 of 3"), std::string::npos)
      << out;
  EXPECT_NE(out.find("hsdp-launch: generation 1: "), std::string::npos) << out;
  EXPECT_NE(out.find("after worker 3 was lost (killed by signal 9)"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("worker 3 rejoined (restart 1)"), std::string::npos)
      << out;
  EXPECT_NE(out.find("restarts 1"), std::string::npos) << out;  // progress
  EXPECT_NE(out.find("all 4 workers finished (1 failure, 1 restart"),
            std::string::npos)
      << out;

  // The survivors trained to the end in their first processes: the complete
  // replica group (ranks 0 and 1) every step; the killed rank's replica
  // partner every step but those the job ran on 1x2, while it stood by.
  constexpr int kPartnerRank = kKilledRank - 1;
  std::set<int64_t> on_1x2;
  for (int r = 0; r < 4; ++r) {
    if (r == kKilledRank) continue;
    EXPECT_FALSE(
        fs::exists(absl::StrCat(run_dir, "/worker-", r, ".restart-1.jsonl")));
    const std::vector<ReportLine> lines =
        ReadReportLines(absl::StrCat(run_dir, "/worker-", r, ".jsonl"));
    if (r == kPartnerRank) continue;
    ASSERT_EQ(lines.size(), static_cast<size_t>(kLaunchSteps)) << "rank " << r;
    for (int s = 0; s < kLaunchSteps; ++s) {
      EXPECT_EQ(lines[s].step, s);
      if (lines[s].world == 2) on_1x2.insert(s);
    }
  }
  const std::vector<ReportLine> partner = ReadReportLines(
      absl::StrCat(run_dir, "/worker-", kPartnerRank, ".jsonl"));
  std::set<int64_t> partner_steps;
  for (const ReportLine& l : partner) {
    EXPECT_TRUE(partner_steps.insert(l.step).second) << "step " << l.step;
  }
  for (int s = 0; s < kLaunchSteps; ++s) {
    EXPECT_NE(partner_steps.count(s) > 0, on_1x2.count(s) > 0) << "step " << s;
  }
  // The restarted process was healed in its first step and trained to the
  // end.
  const std::string killed =
      absl::StrCat(run_dir, "/worker-", kKilledRank, ".jsonl");
  const std::string restarted =
      absl::StrCat(run_dir, "/worker-", kKilledRank, ".restart-1.jsonl");
  EXPECT_GE(StepsReported(killed), kKillAfterSteps);
  EXPECT_LT(StepsReported(killed), kLaunchSteps);
  const std::vector<ReportLine> healed = ReadReportLines(restarted);
  ASSERT_FALSE(healed.empty());
  EXPECT_FALSE(healed.front().heal_crc.empty());
  EXPECT_GT(healed.front().generation, 0);
  EXPECT_EQ(healed.back().step, kLaunchSteps - 1);
  // Every report file the run wrote: none besides these five.
  std::vector<std::string> reports;
  for (const auto& entry : fs::directory_iterator(run_dir)) {
    if (entry.path().extension() == ".jsonl") {
      reports.push_back(entry.path().string());
    }
  }
  std::sort(reports.begin(), reports.end());
  ASSERT_EQ(reports.size(), 5u);
  const int killed_index = static_cast<int>(
      std::find(reports.begin(), reports.end(), killed) - reports.begin());
  ExpectExactLedger(reports, kLaunchSteps, kGlobalMicrobatches, killed_index);
}

// `hsdp-launch --relay`: the workers' streams go through one hsdp-relay and
// the losses are bitwise those of the same job without it; the relay killed
// mid-run leaves the workers going on by call to the end, losses unchanged.
TEST(LaunchE2eTest, ARelayCarriesTheStreamsAndChangesNoNumberEvenWhenItDies) {
  constexpr int64_t kSteps = 30;
  Cluster scratch("launch-relay");
  auto losses = [](const std::string& run_dir) {
    std::vector<std::vector<StepRecord>> per_rank;
    for (int r = 0; r < 4; ++r) {
      per_rank.push_back(
          ReadReport(absl::StrCat(run_dir, "/worker-", r, ".jsonl")));
    }
    return per_rank;
  };
  const std::string plain_dir = scratch.dir() + "/plain";
  Proc plain =
      Spawn(LaunchArgv(plain_dir, {}, kSteps), scratch.dir() + "/plain.log");
  ASSERT_EQ(Wait(plain, kLaunchTimeout), 0)
      << ReadFile(scratch.dir() + "/plain.log");
  const std::vector<std::vector<StepRecord>> base = losses(plain_dir);

  const std::string relay_dir = scratch.dir() + "/relay";
  const std::string log = scratch.dir() + "/relay-launch.log";
  Proc launch = Spawn(LaunchArgv(relay_dir, {"--relay"}, kSteps), log);
  ASSERT_EQ(Wait(launch, kLaunchTimeout), 0) << ReadFile(log);
  EXPECT_NE(ReadFile(log).find("hsdp-launch: relay on unix:"),
            std::string::npos)
      << ReadFile(log);
  // The relay says what it carried when it stops (at the end of the job).
  const std::string relay_log = ReadFile(relay_dir + "/relay.log");
  EXPECT_NE(relay_log.find("local schedule streams over 1 upstream"),
            std::string::npos)
      << relay_log;
  std::vector<std::string> reports;
  for (int r = 0; r < 4; ++r) {
    reports.push_back(absl::StrCat(relay_dir, "/worker-", r, ".jsonl"));
  }
  ExpectSameLosses(reports, base, kSteps);

  // The relay dies after step 10: the job finishes, same numbers.
  const std::string killed_dir = scratch.dir() + "/relay-killed";
  const std::string killed_log = scratch.dir() + "/relay-killed.log";
  Proc again = Spawn(LaunchArgv(killed_dir, {"--relay"}, kSteps), killed_log);
  const auto deadline = Clock::now() + std::chrono::seconds(60);
  while (StepsReported(killed_dir + "/worker-0.jsonl") < 10 &&
         Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const pid_t relay = ChildWith(again.pid, "hsdp-relay --coordinator");
  ASSERT_GT(relay, 0) << ReadFile(killed_log);
  kill(relay, SIGKILL);
  ASSERT_EQ(Wait(again, kLaunchTimeout), 0) << ReadFile(killed_log);
  EXPECT_NE(ReadFile(killed_log).find("the relay exited (killed by signal 9)"),
            std::string::npos)
      << ReadFile(killed_log);
  reports.clear();
  for (int r = 0; r < 4; ++r) {
    reports.push_back(absl::StrCat(killed_dir, "/worker-", r, ".jsonl"));
  }
  ExpectSameLosses(reports, base, kSteps);
}

TEST(LaunchE2eTest, MaxRestartsZeroStopsAtTheFirstFailure) {
  Cluster scratch("launch-fail-fast");
  const std::string run_dir = scratch.dir() + "/run";
  const std::string log = scratch.dir() + "/launch.log";
  Proc launch =
      Spawn(LaunchArgv(run_dir, {"--max-restarts", "0"}, 100000), log);
  ASSERT_TRUE(KillWorkerMidRun(launch, run_dir)) << ReadFile(log);
  EXPECT_EQ(Wait(launch, std::chrono::seconds(60)), 1) << ReadFile(log);
  const std::string out = ReadFile(log);
  EXPECT_NE(out.find("hsdp-launch: worker 3 failed (killed by signal 9)"),
            std::string::npos)
      << out;
  EXPECT_EQ(out.find("restarting"), std::string::npos) << out;
  EXPECT_FALSE(fs::exists(run_dir + "/worker-3.restart-1.jsonl"));
}

// A loss that turns non-finite (SGD with a learning rate no model survives)
// stops the job: the coordinator marks it FAILED with the worker's line, which
// names the step, rank and microbatch; the launcher restarts no one, says
// that reason and exits non-zero; every report line is still JSON.
TEST(LaunchE2eTest, ANonFiniteLossFailsTheJobAndTheLauncher) {
  Cluster scratch("launch-nonfinite");
  const std::string run_dir = scratch.dir() + "/run";
  const std::string log = scratch.dir() + "/launch.log";
  Proc launch =
      Spawn(LaunchArgv(run_dir, {"--optimizer", "sgd", "--lr", "1e30"},
                       /*steps=*/50),
            log);
  EXPECT_EQ(Wait(launch, kLaunchTimeout), 1) << ReadFile(log);
  const std::string out = ReadFile(log);
  const size_t failed = out.find("hsdp-launch: the job failed: step ");
  ASSERT_NE(failed, std::string::npos) << out;
  const std::string reason =
      out.substr(failed, out.find('\n', failed) - failed);
  EXPECT_NE(reason.find(": the loss is "), std::string::npos) << reason;
  EXPECT_NE(reason.find(", microbatch "), std::string::npos) << reason;
  EXPECT_NE(reason.find("--on-nonfinite skip-step"), std::string::npos)
      << reason;
  EXPECT_EQ(out.find("restarting"), std::string::npos) << out;
  for (int r = 0; r < 4; ++r) {
    const std::string report = absl::StrCat(run_dir, "/worker-", r, ".jsonl");
    for (const std::string& line : Lines(ReadFile(report))) {
      EXPECT_TRUE(IsJsonObject(line)) << report << ": " << line;
    }
  }
}

}  // namespace
}  // namespace hsdp::e2e
