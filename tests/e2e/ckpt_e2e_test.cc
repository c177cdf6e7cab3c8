// Checkpoints end to end (real coordinator and hsdp-worker processes): a job
// saved on 2x2 resumes as a 1x3 job and says so in one line; a job without a
// checkpoint says why it started fresh; a directory of the pre-v1 per-rank
// format is refused, not skipped.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>

#include "tests/e2e/cluster.h"

namespace hsdp::e2e {
namespace {

constexpr int kFirstSteps = 12;
constexpr int kMoreSteps = 20;

std::vector<std::string> Logs(const std::vector<Proc>& workers) {
  std::vector<std::string> out;
  for (const Proc& p : workers) out.push_back(ReadFile(p.log));
  return out;
}

TEST(CkptE2eTest, SavedOn2x2ResumesOn1x3AndSaysSo) {
  Cluster first("ckpt-2x2");
  const std::string ckpt = first.dir() + "/../ckpt-e2e-reshard";
  std::filesystem::remove_all(ckpt);
  const std::string policy = first.dir() + "/policy.json";
  std::ofstream(policy) << "{\"checkpointInterval\": 5}\n";
  first.StartCoordinator(4, "2x2", 0, policy);
  first.StartWorkers(4, {"--checkpoint-dir", ckpt, "--keep-checkpoints", "2"},
                     kFirstSteps);
  std::vector<Proc> workers = first.workers();
  first.WaitWorkers();
  for (const std::string& log : Logs(workers)) {
    EXPECT_NE(log.find("started fresh: no checkpoint in"), std::string::npos)
        << log;
  }
  Kill(first.coordinator());

  Cluster second("ckpt-1x3");
  std::ofstream(second.dir() + "/policy.json")
      << "{\"checkpointInterval\": 5}\n";
  second.StartCoordinator(3, "1x3", 0, second.dir() + "/policy.json");
  second.StartWorkers(3, {"--checkpoint-dir", ckpt}, kMoreSteps);
  workers = second.workers();
  second.WaitWorkers();
  const std::regex resumed(
      "resumed from step ([0-9]+) \\(resharded from 2x2 to 1x3\\)");
  int64_t resumed_step = -1;
  for (const std::string& log : Logs(workers)) {
    std::smatch m;
    ASSERT_TRUE(std::regex_search(log, m, resumed)) << log;
    resumed_step = std::stoll(m[1]);
  }
  EXPECT_GE(resumed_step, 4);
  EXPECT_LT(resumed_step, kFirstSteps);
  const std::vector<StepRecord> got = ReadReport(second.report(0));
  ASSERT_FALSE(got.empty());
  EXPECT_EQ(got.front().step, resumed_step + 1);
  EXPECT_EQ(got.back().step, kMoreSteps - 1);
  Kill(second.coordinator());
  std::filesystem::remove_all(ckpt);
}

// Workers killed (SIGKILL) while checkpointing every step: every directory
// that looks complete verifies, and a new job resumes from the newest one,
// passing over the interrupted save if the kill left one.
TEST(CkptE2eTest, KillDuringWritesNeverLeavesACompleteLookingBadCheckpoint) {
  Cluster c("ckpt-kill");
  const std::string ckpt = c.dir() + "/ckpt";
  const std::string policy = c.dir() + "/policy.json";
  std::ofstream(policy) << "{\"checkpointInterval\": 1}\n";
  c.StartCoordinator(4, "2x2", 0, policy);
  c.StartWorkers(4, {"--checkpoint-dir", ckpt}, kSteps);
  ASSERT_TRUE(c.WaitForSteps(8));
  for (Proc& p : c.workers()) Kill(p);
  c.workers().clear();
  Kill(c.coordinator());
  int complete = 0, incomplete = 0;
  for (const auto& e : std::filesystem::directory_iterator(ckpt)) {
    if (!std::filesystem::exists(e.path() / "metadata.json")) {
      ++incomplete;
      continue;
    }
    ++complete;
    Proc verify = Spawn({Bin("hsdp-ckpt"), "verify", e.path().string()},
                        c.dir() + "/verify.log");
    EXPECT_EQ(Wait(verify), 0) << ReadFile(c.dir() + "/verify.log");
  }
  EXPECT_GT(complete, 0);
  RecordProperty("incomplete_after_kill", incomplete);

  Cluster again("ckpt-kill-resume");
  again.StartCoordinator(4, "2x2");
  again.StartWorkers(4, {"--checkpoint-dir", ckpt}, 12);
  std::vector<Proc> workers = again.workers();
  again.WaitWorkers();
  for (const std::string& log : Logs(workers)) {
    EXPECT_NE(log.find("(same mesh 2x2)"), std::string::npos) << log;
    if (incomplete > 0) {
      EXPECT_NE(log.find("passed over checkpoint"), std::string::npos) << log;
    }
  }
  Kill(again.coordinator());
}

TEST(CkptE2eTest, PreV1CheckpointIsRefusedNotSkipped) {
  Cluster c("ckpt-old");
  const std::string ckpt = c.dir() + "/ckpt";
  std::filesystem::create_directories(ckpt + "/step-00000005");
  std::ofstream(ckpt + "/step-00000005/rank-0-of-2.pt") << "old";
  c.StartCoordinator(2, "1x2");
  c.StartWorkers(2, {"--checkpoint-dir", ckpt}, 4);
  for (const Proc& p : c.workers()) {
    EXPECT_NE(Wait(p), 0);
    EXPECT_NE(ReadFile(p.log).find("pre-v1"), std::string::npos)
        << ReadFile(p.log);
  }
  c.workers().clear();
  Kill(c.coordinator());
}

}  // namespace
}  // namespace hsdp::e2e
