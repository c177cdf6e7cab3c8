// Elastic training end to end (real coordinator and hsdp-worker processes):
// a worker killed with SIGKILL in a 2x2 job leaves the survivors training in
// the same processes on 1x2 with the same global batch, bitwise equal to a
// job that switched to 1x2 at that step; a replacement worker joins, is
// healed bitwise from its peers and trains; a 1x2 job that loses a worker
// (no copy of its shard left) stops with a clear error.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "tests/e2e/cluster.h"

namespace hsdp::e2e {
namespace {

constexpr int kElasticSteps = 30;
// Every rank's share of the global batch: 2x2 x 1 microbatch, or 1x2 x 2.
constexpr int kGlobalMicrobatches = 4;
// Failures not noticed by a collective are noticed by heartbeats within this.
const std::vector<std::string> kCoordinatorFlags = {
    "--heartbeat-timeout", "4", "--reform-window", "2", "--join-wait", "30"};

// The step at which `lines` first trained on `world` ranks.
int64_t FirstStepOn(const std::vector<ReportLine>& lines, int world) {
  for (const ReportLine& l : lines)
    if (l.world == world) return l.step;
  return -1;
}

TEST(ElasticE2eTest, KillOneOf2x2SurvivorsGoOnBitwiseAsA1x2JobFromThatStep) {
  Cluster c("elastic-kill");
  c.StartCoordinator(4, "2x2", 0, "", kCoordinatorFlags);
  c.StartWorkers(4, {}, kElasticSteps);
  ASSERT_TRUE(c.WaitForSteps(8));
  Kill(c.workers()[3]);
  std::vector<Proc> workers = c.workers();
  // The survivors (same processes) finish; worker 2 stood by without its
  // replica partner and stops when the job finishes.
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(Wait(workers[r]), 0) << ReadFile(workers[r].log);
  }
  c.workers().clear();
  for (int r = 0; r < 2; ++r) {
    const std::string log = ReadFile(workers[r].log);
    EXPECT_NE(log.find("enters generation 1"), std::string::npos) << log;
  }
  EXPECT_NE(ReadFile(workers[2].log).find("stands by"), std::string::npos);

  const std::vector<ReportLine> survivor = ReadReportLines(c.report(0));
  ASSERT_EQ(survivor.size(), static_cast<size_t>(kElasticSteps));
  for (int s = 0; s < kElasticSteps; ++s) EXPECT_EQ(survivor[s].step, s);
  const int64_t k = FirstStepOn(survivor, 2);
  ASSERT_GT(k, 0);
  for (const ReportLine& l : survivor) {
    EXPECT_EQ(l.world, l.step < k ? 4 : 2) << "step " << l.step;
  }
  ExpectExactLedger({c.report(0), c.report(1), c.report(2), c.report(3)},
                    kElasticSteps, kGlobalMicrobatches, /*killed_file=*/3);

  // The reference: a 2x2 job checkpointed through step k - 1, then a 1x2 job
  // with 2 microbatches per rank (the same global batch) resumed from it.
  const std::string ckpt = c.dir() + "/reference-ckpt";
  Cluster a("elastic-ref-2x2");
  std::ofstream(a.dir() + "/policy.json") << "{\"checkpointInterval\": 1}\n";
  a.StartCoordinator(4, "2x2", 0, a.dir() + "/policy.json");
  a.StartWorkers(4, {"--checkpoint-dir", ckpt, "--sync-checkpoint"}, k);
  a.WaitWorkers();
  Cluster b("elastic-ref-1x2");
  std::ofstream(b.dir() + "/policy.json") << "{\"microbatches\": 2}\n";
  b.StartCoordinator(2, "1x2", 0, b.dir() + "/policy.json");
  b.StartWorkers(2, {"--checkpoint-dir", ckpt}, kElasticSteps);
  b.WaitWorkers();
  std::vector<ReportLine> reference = ReadReportLines(a.report(0));
  for (const ReportLine& l : ReadReportLines(b.report(0)))
    reference.push_back(l);
  ASSERT_EQ(reference.size(), static_cast<size_t>(kElasticSteps));
  for (int r = 0; r < 2; ++r) {
    const std::vector<ReportLine> got = ReadReportLines(c.report(r));
    ASSERT_EQ(got.size(), reference.size());
    for (size_t s = 0; s < got.size(); ++s) {
      EXPECT_EQ(got[s].loss_hex, reference[s].loss_hex)
          << "rank " << r << " step " << s << " (failure at step " << k << ")";
    }
  }
}

TEST(ElasticE2eTest, AReplacementJoinsIsHealedBitwiseAndTrains) {
  // Long enough for a new process to start and join while the others train.
  constexpr int kHealSteps = 4 * kElasticSteps;
  Cluster c("elastic-heal");
  c.StartCoordinator(4, "2x2", 0, "", kCoordinatorFlags);
  c.StartWorkers(4, {}, kHealSteps);
  ASSERT_TRUE(c.WaitForSteps(6));
  Kill(c.workers()[3]);
  std::vector<Proc> workers = c.workers();
  c.workers().clear();
  // Once the survivors train on 1x2, a new process takes the dead one's place.
  // Re-forming normally takes a second or two; the bound leaves room for a
  // survivor whose collective outlives the abort and ends at the collective
  // timeout (60 s, see Cluster), which this test is not about.
  const auto deadline = Clock::now() + std::chrono::seconds(150);
  while (Clock::now() < deadline &&
         FirstStepOn(ReadReportLines(c.report(0)), 2) < 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_GE(FirstStepOn(ReadReportLines(c.report(0)), 2), 0)
      << ReadFile(workers[0].log);
  const std::string replacement_report = c.dir() + "/replacement.jsonl";
  Proc replacement =
      c.StartWorker(3, {"--report-file", replacement_report}, kHealSteps);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(Wait(workers[r]), 0) << ReadFile(workers[r].log);
  }
  EXPECT_EQ(Wait(replacement), 0) << ReadFile(replacement.log);

  // Every rank that took part in a heal reported its state's CRC32C right
  // after it: equal within each shard index, targets included.
  const std::vector<std::string> reports = {c.report(0), c.report(1),
                                            c.report(2), replacement_report};
  std::map<std::pair<int64_t, int>, std::set<std::string>> crcs;
  std::map<std::pair<int64_t, int>, int> holders;
  for (const std::string& path : reports) {
    for (const ReportLine& l : ReadReportLines(path)) {
      if (l.heal_crc.empty()) continue;
      crcs[{l.generation, l.rank % 2}].insert(l.heal_crc);
      ++holders[{l.generation, l.rank % 2}];
    }
  }
  ASSERT_FALSE(crcs.empty()) << "no heal happened";
  for (const auto& [key, set] : crcs) {
    EXPECT_EQ(set.size(), 1u) << "generation " << key.first << " shard "
                              << key.second << ": states differ after heal";
    EXPECT_GE(holders[key], 2);
  }
  const std::vector<ReportLine> healed = ReadReportLines(replacement_report);
  ASSERT_FALSE(healed.empty());
  EXPECT_FALSE(healed.front().heal_crc.empty());
  EXPECT_EQ(healed.back().step, kHealSteps - 1);
  ExpectExactLedger(
      {c.report(0), c.report(1), c.report(2), c.report(3), replacement_report},
      kHealSteps, kGlobalMicrobatches, /*killed_file=*/3);

  // The same global batch every step: the losses follow single-process
  // training on it (the reduction order differs between meshes: fp32
  // tolerance).
  const std::string reference = c.dir() + "/reference.jsonl";
  ASSERT_EQ(
      RunReference(4, 1, kHealSteps, reference, "", c.dir() + "/reference.log"),
      0)
      << ReadFile(c.dir() + "/reference.log");
  const std::vector<StepRecord> want = ReadReport(reference);
  const std::vector<ReportLine> got = ReadReportLines(c.report(0));
  ASSERT_EQ(want.size(), got.size());
  for (size_t s = 0; s < got.size(); ++s) {
    EXPECT_NEAR(got[s].loss, want[s].loss, 1e-5) << "step " << s;
  }
}

// An operator drains a worker (hsdpctl evict): it leaves at a step boundary
// and exits 0; the others go on as 1x2 in their processes.
TEST(ElasticE2eTest, AnEvictedWorkerLeavesAtAStepBoundary) {
  Cluster c("elastic-evict");
  c.StartCoordinator(4, "2x2", 0, "", kCoordinatorFlags);
  c.StartWorkers(4, {}, kElasticSteps);
  ASSERT_TRUE(c.WaitForSteps(4));
  const std::regex id_of("rank 3 \\(worker ([0-9]+)\\) enters generation 0");
  std::smatch m;
  const std::string log3 = ReadFile(c.workers()[3].log);
  ASSERT_TRUE(std::regex_search(log3, m, id_of)) << log3;
  std::string out;
  ASSERT_EQ(c.Ctl({"evict", "--worker-id", m[1]}, &out), 0) << out;
  std::vector<Proc> workers = c.workers();
  c.workers().clear();
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(Wait(workers[r]), 0) << ReadFile(workers[r].log);
  }
  EXPECT_NE(ReadFile(workers[3].log).find("evicted by an operator"),
            std::string::npos);
  const std::vector<ReportLine> evicted = ReadReportLines(c.report(3));
  const std::vector<ReportLine> survivor = ReadReportLines(c.report(0));
  ASSERT_EQ(survivor.size(), static_cast<size_t>(kElasticSteps));
  ASSERT_FALSE(evicted.empty());
  // The evicted worker's last step is the survivors' last step on 2x2: a
  // boundary, nothing trained twice or lost.
  EXPECT_EQ(FirstStepOn(survivor, 2), evicted.back().step + 1);
  ExpectExactLedger({c.report(0), c.report(1), c.report(2), c.report(3)},
                    kElasticSteps, kGlobalMicrobatches, /*killed_file=*/-1);
}

TEST(ElasticE2eTest, ALost1x2WorkerStopsTheJobWithAClearError) {
  Cluster c("elastic-no-copy");
  c.StartCoordinator(2, "1x2", 0, "", kCoordinatorFlags);
  c.StartWorkers(2, {}, kElasticSteps);
  ASSERT_TRUE(c.WaitForSteps(4));
  Kill(c.workers()[1]);
  const Proc survivor = c.workers()[0];
  c.workers().clear();
  EXPECT_NE(Wait(survivor, std::chrono::seconds(60)), 0);
  const std::string log = ReadFile(survivor.log);
  EXPECT_NE(log.find("the job failed"), std::string::npos) << log;
  EXPECT_NE(log.find("no checkpoint to restart from"), std::string::npos)
      << log;
}

}  // namespace
}  // namespace hsdp::e2e
