// The schedule log across generations: committed steps keep their records,
// uncommitted ones are sealed again (new records) for the next generation's
// world, superseded records stay readable, readers of an ended generation are
// aborted, the global batch follows the batch mode, a restart rebuilds the
// same view, and a generation whose shard groups span hosts is planned for
// the inter-host link.
#include <gtest/gtest.h>

#include <vector>

#include "common/policy.h"
#include "coordinator/core/schedule_log.h"
#include "tests/coordinator/core_test_util.h"

namespace hsdp::coordinator {
namespace {

using testing::FreshDir;
using testing::MakeUnits;
using testing::P;

constexpr absl::Duration kWait = absl::Seconds(20);

absl::Time Soon() { return absl::Now() + kWait; }

// A 3x2 job (W0 = 6).
std::unique_ptr<ScheduleLog> MakeLog(const hsdp::v1::Policy& policy,
                                     StateStore* store = nullptr,
                                     bool units = true) {
  ScheduleLog::Options options;
  options.world_size = 6;
  options.shard_size = 2;
  options.read_ahead = 8;
  auto log = ScheduleLog::Create(options, policy, store);
  EXPECT_TRUE(log.ok()) << log.status();
  if (units) {
    EXPECT_TRUE((*log)->SetUnits(MakeUnits(2)).ok());
  }
  return std::move(*log);
}

const hsdp::v1::StepSchedule& Read(ScheduleLog& log, int64_t step,
                                   const GenerationContext& g) {
  static hsdp::v1::StepSchedule empty;
  absl::StatusOr<ScheduleRead> read = log.GetSchedule(step, g, Soon());
  EXPECT_TRUE(read.ok()) << read.status();
  return read.ok() ? read->sealed->schedule : empty;
}

// Rank r's microbatch m: its global microbatch index, or -1 for padding —
// the rule StepSchedule documents, as a worker computes it.
int64_t GlobalMicrobatch(const hsdp::v1::StepSchedule& s, int rank, int m) {
  const int64_t slot = static_cast<int64_t>(rank) * s.microbatches_size() + m;
  return slot < s.global_microbatches() ? s.first_microbatch() + slot : -1;
}

TEST(ScheduleLogGenerationTest, FixedModeKeepsTheSampleSequence) {
  auto log = MakeLog(P("microbatches: 2"));
  const GenerationContext g0{0, 6, 0};
  for (int64_t step = 0; step < 3; ++step) {
    const hsdp::v1::StepSchedule& s = Read(*log, step, g0);
    EXPECT_EQ(s.world_size(), 6);
    EXPECT_EQ(s.microbatches_size(), 2);
    EXPECT_EQ(s.global_microbatches(), 12);
    EXPECT_EQ(s.first_microbatch(), 12 * step);
    EXPECT_EQ(s.batch_mode(), hsdp::v1::BATCH_MODE_FIXED);
  }
  log->RecordCommitted(1);
  // Generation 1: 2x2 from step 2 (step 2 was sealed in generation 0 but not
  // committed). U = 12 over 4 ranks: 3 microbatches each, same samples.
  const GenerationContext g1{1, 4, 2};
  ASSERT_TRUE(log->BeginGeneration(g1).ok());
  EXPECT_EQ(log->generation(), 1);
  const hsdp::v1::StepSchedule s2 = Read(*log, 2, g1);
  EXPECT_EQ(s2.generation(), 1);
  EXPECT_EQ(s2.world_size(), 4);
  EXPECT_EQ(s2.microbatches_size(), 3);
  EXPECT_TRUE(s2.microbatches(2).is_last_backward());
  EXPECT_EQ(s2.global_microbatches(), 12);
  EXPECT_EQ(s2.first_microbatch(), 24);
  // The same assignment a fresh 2x2 job with 3 microbatches has: rank r, m
  // -> microbatch 24 + 3r + m; every microbatch of the step exactly once.
  std::vector<int> seen(12, 0);
  for (int r = 0; r < 4; ++r) {
    for (int m = 0; m < 3; ++m) {
      const int64_t g = GlobalMicrobatch(s2, r, m);
      EXPECT_EQ(g, 24 + 3 * r + m);
      ++seen[g - 24];
    }
  }
  EXPECT_EQ(seen, std::vector<int>(12, 1));
  // Committed steps keep their generation-0 records; the superseded one is
  // still readable as it was.
  EXPECT_EQ(Read(*log, 1, g1).generation(), 0);
  absl::StatusOr<std::shared_ptr<const SealedSchedule>> old =
      log->GetSealed(2, 0);
  ASSERT_TRUE(old.ok()) << old.status();
  EXPECT_EQ((*old)->schedule.world_size(), 6);
  EXPECT_EQ((*log->GetSealed(2))->schedule.generation(), 1);
  EXPECT_EQ(log->GetSealed(2, 5).status().code(), absl::StatusCode::kNotFound);
  // Readers of the ended generation re-form.
  EXPECT_EQ(log->GetSchedule(3, g0, Soon()).status().code(),
            absl::StatusCode::kAborted);
  EXPECT_EQ(Read(*log, 3, g1).first_microbatch(), 36);
}

TEST(ScheduleLogGenerationTest, FixedModePadsWhenTheWorldDoesNotDivide) {
  auto log = MakeLog(P("microbatches: 1"));  // U = 6
  const GenerationContext g1{1, 4, 0};
  const hsdp::v1::StepSchedule& s = Read(*log, 0, g1);
  EXPECT_EQ(s.microbatches_size(), 2);  // ceil(6 / 4)
  EXPECT_EQ(s.global_microbatches(), 6);
  // Ranks 0..2 carry samples 0..5; rank 3's slots are padding.
  EXPECT_EQ(GlobalMicrobatch(s, 2, 1), 5);
  EXPECT_EQ(GlobalMicrobatch(s, 3, 0), -1);
  EXPECT_EQ(GlobalMicrobatch(s, 3, 1), -1);
}

TEST(ScheduleLogGenerationTest, ShrinkModeKeepsEachRanksMicrobatches) {
  auto log = MakeLog(P("microbatches: 2 batch_mode: BATCH_MODE_SHRINK"));
  const GenerationContext g0{0, 6, 0};
  EXPECT_EQ(Read(*log, 0, g0).global_microbatches(), 12);
  log->RecordCommitted(0);
  const GenerationContext g1{1, 4, 1};
  const hsdp::v1::StepSchedule s1 = Read(*log, 1, g1);
  EXPECT_EQ(s1.microbatches_size(), 2);
  EXPECT_EQ(s1.global_microbatches(), 8);
  EXPECT_EQ(s1.first_microbatch(), 12);
  EXPECT_EQ(s1.batch_mode(), hsdp::v1::BATCH_MODE_SHRINK);
  EXPECT_EQ(Read(*log, 2, g1).first_microbatch(), 20);
}

// A reader already in the next generation starts it itself (the order of
// BeginGeneration and the first read does not matter), once.
TEST(ScheduleLogGenerationTest, FirstReaderOfANewGenerationBeginsIt) {
  auto log = MakeLog(P("microbatches: 2"));
  const GenerationContext g0{0, 6, 0};
  Read(*log, 3, g0);
  log->RecordCommitted(0);
  const GenerationContext g1{1, 4, 1};
  EXPECT_EQ(Read(*log, 1, g1).generation(), 1);
  EXPECT_TRUE(log->BeginGeneration(g1).ok());  // no-op now
  EXPECT_EQ(Read(*log, 1, g1).generation(), 1);
  EXPECT_EQ(log->sealed_step(), 1);
}

TEST(ScheduleLogGenerationTest, RestartRebuildsTheSameView) {
  const std::string dir = FreshDir("state");
  std::vector<std::string> before;
  {
    auto store = StateStore::Open(dir);
    ASSERT_TRUE(store.ok());
    auto log = MakeLog(P("microbatches: 2"), store->get());
    const GenerationContext g0{0, 6, 0};
    Read(*log, 3, g0);  // seals 0..3 in generation 0
    log->RecordCommitted(1);
    const GenerationContext g1{1, 4, 2};
    ASSERT_TRUE(log->BeginGeneration(g1).ok());
    Read(*log, 2, g1);  // steps 2 and 3 of generation 0 are superseded
    for (int64_t step = 0; step <= 2; ++step) {
      before.push_back((*log->GetSealed(step))->bytes);
    }
  }
  auto store = StateStore::Open(dir);
  ASSERT_TRUE(store.ok());
  auto log = MakeLog(P("microbatches: 2"), store->get(), /*units=*/false);
  ASSERT_TRUE(log->SetUnits(MakeUnits(2)).ok());
  EXPECT_EQ(log->generation(), 1);
  EXPECT_EQ(log->sealed_step(), 2);  // not generation 0's step 3
  for (int64_t step = 0; step <= 2; ++step) {
    EXPECT_EQ((*log->GetSealed(step))->bytes, before[step]) << step;
  }
  EXPECT_TRUE(log->GetSealed(3, 0).ok());
  // Sealing goes on in generation 1's world, from the right sample.
  const hsdp::v1::StepSchedule s3 = Read(*log, 3, GenerationContext{1, 4, 2});
  EXPECT_EQ(s3.generation(), 1);
  EXPECT_EQ(s3.microbatches_size(), 3);
  EXPECT_EQ(s3.first_microbatch(), 36);
}

// A checkpoint requested on a step that is then sealed again keeps it.
TEST(ScheduleLogGenerationTest, CheckpointRequestSurvivesResealing) {
  auto log = MakeLog(P("microbatches: 1"));
  const GenerationContext g0{0, 6, 0};
  Read(*log, 0, g0);
  absl::StatusOr<int64_t> requested = log->RequestCheckpoint();
  ASSERT_TRUE(requested.ok());
  EXPECT_EQ(*requested, 1);
  EXPECT_TRUE(Read(*log, 1, g0).checkpoint());
  log->RecordCommitted(0);
  const GenerationContext g1{1, 4, 1};
  EXPECT_TRUE(Read(*log, 1, g1).checkpoint());
  log->RecordCommitted(1);
  EXPECT_FALSE(Read(*log, 2, g1).checkpoint());
}

// With the job's links declared, a generation's steps are planned for the
// intra-host link until it is said to span hosts, then for the inter-host
// link; the next generation starts within hosts again, and a word about
// another generation changes nothing. (The budget is one where the two links
// make the memory-budget planner keep different blocks.)
TEST(ScheduleLogGenerationTest, ShardGroupsAcrossHostsPlanForTheInterHostLink) {
  constexpr int64_t kMiB = 1 << 20;
  const UnitList units = MakeUnits(
      1 * kMiB, {24 * kMiB, 8 * kMiB, 8 * kMiB, 8 * kMiB, 8 * kMiB, 8 * kMiB});
  LinkCosts links;
  links.intra_host = {/*bytes_per_second=*/50e9, /*latency_seconds=*/1e-3};
  links.inter_host = {/*bytes_per_second=*/125e6, /*latency_seconds=*/50e-6};
  // A budget where the planner's choice depends on the link.
  auto plan = [&](int64_t budget, bool across) {
    Planner planner(units, 2);
    planner.SetLinks(links);
    planner.SetShardGroupsCrossHosts(across);
    hsdp::v1::Policy p;
    p.set_memory_budget_bytes(budget);
    hsdp::v1::StepSchedule s = planner.Plan(p, {});
    std::vector<bool> kept;
    for (const auto& u : s.units()) kept.push_back(!u.reshard_after_forward());
    return kept;
  };
  int64_t budget = 0;
  for (int64_t b = 40 * kMiB; b < 200 * kMiB && budget == 0; b += kMiB / 4) {
    if (plan(b, false) != plan(b, true)) budget = b;
  }
  ASSERT_GT(budget, 0) << "no budget where the links disagree";
  hsdp::v1::Policy policy;
  policy.set_memory_budget_bytes(budget);
  ScheduleLog::Options options;
  options.world_size = 2;
  options.shard_size = 2;
  options.read_ahead = 8;
  options.links = links;
  auto log = ScheduleLog::Create(options, policy, nullptr);
  ASSERT_TRUE(log.ok()) << log.status();
  ASSERT_TRUE((*log)->SetUnits(units).ok());
  auto kept = [](const hsdp::v1::StepSchedule& s) {
    std::vector<bool> k;
    for (const auto& u : s.units()) k.push_back(!u.reshard_after_forward());
    return k;
  };
  const GenerationContext g0{0, 2, 0};
  EXPECT_EQ(kept(Read(**log, 0, g0)), plan(budget, false));
  (*log)->SetShardGroupsCrossHosts(7, 0);  // not this generation
  EXPECT_EQ(kept(Read(**log, 1, g0)), plan(budget, false));
  (*log)->SetShardGroupsCrossHosts(0, 0);
  EXPECT_EQ(kept(Read(**log, 2, g0)), plan(budget, true));
  const GenerationContext g1{1, 2, 3};
  ASSERT_TRUE((*log)->BeginGeneration(g1).ok());
  EXPECT_EQ(kept(Read(**log, 3, g1)), plan(budget, false));
  (*log)->SetShardGroupsCrossHosts(1, 0);
  EXPECT_EQ(kept(Read(**log, 4, g1)), plan(budget, true));
}

// Hierarchical reshard follows the generation's host groups: a policy that
// asks for it plans post_forward_group_size only from the step after the
// generation said its shard groups span hosts in runs of two, and a new
// generation starts without until it says so again.
TEST(ScheduleLogGenerationTest, ReshardWithinHostFollowsTheGenerationsHosts) {
  hsdp::v1::Policy policy;
  policy.set_reshard_after_forward_within_host(true);
  ScheduleLog::Options options;
  options.world_size = 4;
  options.shard_size = 4;
  options.read_ahead = 8;
  auto log = ScheduleLog::Create(options, policy, nullptr);
  ASSERT_TRUE(log.ok()) << log.status();
  ASSERT_TRUE((*log)->SetUnits(MakeUnits(100, {400, 400})).ok());
  const GenerationContext g0{0, 4, 0};
  EXPECT_EQ(Read(**log, 0, g0).post_forward_group_size(), 0);
  (*log)->SetShardGroupsCrossHosts(3, 2);  // not this generation
  EXPECT_EQ(Read(**log, 1, g0).post_forward_group_size(), 0);
  (*log)->SetShardGroupsCrossHosts(0, 2);
  EXPECT_EQ(Read(**log, 2, g0).post_forward_group_size(), 2);
  const GenerationContext g1{1, 4, 3};
  ASSERT_TRUE((*log)->BeginGeneration(g1).ok());
  EXPECT_EQ(Read(**log, 3, g1).post_forward_group_size(), 0);
  (*log)->SetShardGroupsCrossHosts(1, 2);
  EXPECT_EQ(Read(**log, 4, g1).post_forward_group_size(), 2);
}

}  // namespace
}  // namespace hsdp::coordinator
