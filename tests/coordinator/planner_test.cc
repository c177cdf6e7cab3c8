#include "coordinator/planner.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/policy.h"
#include "tests/coordinator/core_test_util.h"

namespace hsdp::coordinator {
namespace {

using hsdp::v1::Policy;
using hsdp::v1::StepSchedule;
using testing::MakeUnits;
using testing::P;

std::vector<int> Fwd(const StepSchedule& s, int unit) {
  const auto& l = s.units(unit).forward_prefetch();
  return std::vector<int>(l.begin(), l.end());
}
std::vector<int> Bwd(const StepSchedule& s, int unit) {
  const auto& l = s.units(unit).backward_prefetch();
  return std::vector<int>(l.begin(), l.end());
}

std::vector<bool> Kept(const StepSchedule& s) {
  std::vector<bool> kept;
  for (const auto& u : s.units()) kept.push_back(!u.reshard_after_forward());
  return kept;
}

TEST(PlannerTest, DefaultPolicy) {
  Planner planner(MakeUnits(3), 2);
  const StepSchedule s = planner.Plan(Policy(), {7, 2, 5, false});
  EXPECT_EQ(s.step(), 7);
  EXPECT_EQ(s.policy_version(), 2);
  EXPECT_EQ(s.generation(), 5);
  EXPECT_FALSE(s.checkpoint());
  EXPECT_EQ(s.predicted_peak_bytes(), 0);  // manual mode
  EXPECT_FALSE(s.over_memory_budget());
  ASSERT_EQ(s.microbatches_size(), 1);
  EXPECT_TRUE(s.microbatches(0).requires_grad_sync());
  EXPECT_TRUE(s.microbatches(0).requires_all_reduce());
  EXPECT_TRUE(s.microbatches(0).is_last_backward());
  ASSERT_EQ(s.units_size(), 4);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(s.units(i).unit_index(), i);
  // The root rule: the root stays unsharded from its forward to its backward.
  EXPECT_FALSE(s.units(0).reshard_after_forward());
  EXPECT_FALSE(s.units(0).reshard_after_backward());
  for (int i = 1; i < 4; ++i) {
    EXPECT_TRUE(s.units(i).reshard_after_forward());
    EXPECT_TRUE(s.units(i).reshard_after_backward());
  }
  EXPECT_EQ(s.units(0).unit_name(), "root");
  EXPECT_EQ(s.units(3).unit_name(), "layers.2");
  // Forward order root, 1, 2, 3: each unit prefetches the next.
  EXPECT_EQ(Fwd(s, 0), (std::vector<int>{1}));
  EXPECT_EQ(Fwd(s, 2), (std::vector<int>{3}));
  EXPECT_EQ(Fwd(s, 3), (std::vector<int>{}));
  // Backward order root, 3, 2, 1: the root prefetches the last block, and
  // nobody prefetches the root (already unsharded).
  EXPECT_EQ(Bwd(s, 0), (std::vector<int>{3}));
  EXPECT_EQ(Bwd(s, 3), (std::vector<int>{2}));
  EXPECT_EQ(Bwd(s, 2), (std::vector<int>{1}));
  EXPECT_EQ(Bwd(s, 1), (std::vector<int>{}));
}

TEST(PlannerTest, PrefetchDepthsFollowExecutionOrder) {
  Planner planner(MakeUnits(5), 1);
  StepSchedule s = planner.Plan(
      P("forward_prefetch_depth: 2 backward_prefetch_depth: 3"), {0, 1, 0});
  EXPECT_EQ(Fwd(s, 0), (std::vector<int>{1, 2}));
  EXPECT_EQ(Fwd(s, 4), (std::vector<int>{5}));
  EXPECT_EQ(Fwd(s, 5), (std::vector<int>{}));
  EXPECT_EQ(Bwd(s, 0), (std::vector<int>{5, 4, 3}));
  EXPECT_EQ(Bwd(s, 5), (std::vector<int>{4, 3, 2}));
  EXPECT_EQ(Bwd(s, 2), (std::vector<int>{1}));
  EXPECT_EQ(Bwd(s, 1), (std::vector<int>{}));
  s = planner.Plan(P("forward_prefetch_depth: 0 backward_prefetch_depth: 0"),
                   {0, 1, 0});
  for (int i = 0; i < s.units_size(); ++i) {
    EXPECT_TRUE(Fwd(s, i).empty());
    EXPECT_TRUE(Bwd(s, i).empty());
  }
  s = planner.Plan(P("forward_prefetch_depth: 16 backward_prefetch_depth: 16"),
                   {0, 1, 0});
  EXPECT_EQ(Fwd(s, 0), (std::vector<int>{1, 2, 3, 4, 5}));
  EXPECT_EQ(Bwd(s, 0), (std::vector<int>{5, 4, 3, 2, 1}));
}

// A unit kept unsharded after forward needs no backward all-gather: the
// backward lists skip it and reach the next unit that does.
TEST(PlannerTest, BackwardPrefetchSkipsKeptUnits) {
  Planner planner(MakeUnits(5), 2);
  StepSchedule s = planner.Plan(P(R"(
      backward_prefetch_depth: 2
      overrides { unit_glob: "layers.3" reshard_after_forward: false }
      overrides { unit_glob: "layers.4" reshard_after_forward: false })"),
                                {0, 1, 0});
  EXPECT_EQ(Kept(s),
            (std::vector<bool>{true, false, false, false, true, true}));
  EXPECT_EQ(Bwd(s, 0), (std::vector<int>{3, 2}));  // skips 5 and 4
  EXPECT_EQ(Bwd(s, 5), (std::vector<int>{3, 2}));
  EXPECT_EQ(Bwd(s, 4), (std::vector<int>{3, 2}));
  EXPECT_EQ(Bwd(s, 3), (std::vector<int>{2, 1}));
  EXPECT_EQ(Bwd(s, 1), (std::vector<int>{}));
  // Forward lists are positional: every unit is sharded when a step starts.
  EXPECT_EQ(Fwd(s, 3), (std::vector<int>{4}));
  // Everything kept: no backward all-gather, so no backward prefetch at all.
  s = planner.Plan(P("reshard_after_forward: false"), {0, 1, 0});
  for (int i = 0; i < s.units_size(); ++i) EXPECT_TRUE(Bwd(s, i).empty()) << i;
}

TEST(PlannerTest, RootRuleOnlyAnExactRootOverrideReshardsTheRoot) {
  Planner planner(MakeUnits(2), 2);
  // The policy default and a wildcard do not reach the root.
  for (const char* text : {
           "reshard_after_forward: true reshard_after_backward: true",
           R"(overrides { unit_glob: "*" reshard_after_forward: true
                          reshard_after_backward: true })",
           R"(overrides { unit_glob: "roo?" reshard_after_forward: true })",
       }) {
    const StepSchedule s = planner.Plan(P(text), {0, 1, 0});
    EXPECT_FALSE(s.units(0).reshard_after_forward()) << text;
    EXPECT_FALSE(s.units(0).reshard_after_backward()) << text;
    EXPECT_TRUE(s.units(1).reshard_after_forward()) << text;
  }
  // An override naming "root" exactly pins it (later overrides win).
  StepSchedule s = planner.Plan(P(R"(
      overrides { unit_glob: "root" reshard_after_forward: false }
      overrides { unit_glob: "root" reshard_after_forward: true }
      overrides { unit_glob: "root" reshard_after_backward: true })"),
                                {0, 1, 0});
  EXPECT_TRUE(s.units(0).reshard_after_forward());
  EXPECT_TRUE(s.units(0).reshard_after_backward());
  // The root is first in backward order: still nobody prefetches it.
  for (int i = 0; i < s.units_size(); ++i) {
    for (int j : Bwd(s, i)) EXPECT_NE(j, 0);
    for (int j : Fwd(s, i)) EXPECT_NE(j, 0);
  }
}

TEST(PlannerTest, OverridesApplyInOrder) {
  Planner planner(MakeUnits(12), 1);
  const StepSchedule s = planner.Plan(P(R"(
      reshard_after_backward: false
      overrides { unit_glob: "layers.*" reshard_after_forward: false }
      overrides { unit_glob: "layers.1?" reshard_after_forward: true }
      overrides { unit_glob: "root" reshard_after_backward: true })"),
                                      {0, 1, 0});
  EXPECT_FALSE(s.units(0).reshard_after_forward());   // root rule
  EXPECT_TRUE(s.units(0).reshard_after_backward());   // exact root override
  EXPECT_FALSE(s.units(1).reshard_after_forward());   // layers.0
  EXPECT_FALSE(s.units(1).reshard_after_backward());  // policy default false
  EXPECT_FALSE(s.units(10).reshard_after_forward());  // layers.9
  EXPECT_TRUE(
      s.units(11).reshard_after_forward());  // layers.10: later override wins
  EXPECT_TRUE(s.units(12).reshard_after_forward());  // layers.11
}

struct MicrobatchCase {
  const char* policy;
  std::vector<bool> sync, all_reduce;
};

TEST(PlannerTest, MicrobatchFlags) {
  Planner planner(MakeUnits(1), 1);
  const MicrobatchCase cases[] = {
      {"microbatches: 3", {false, false, true}, {false, false, true}},
      {"microbatches: 3 grad_sync: GRAD_SYNC_MODE_EVERY_MICROBATCH",
       {true, true, true},
       {false, false, true}},
      {"microbatches: 3 grad_sync: GRAD_SYNC_MODE_EVERY_MICROBATCH "
       "all_reduce: ALL_REDUCE_MODE_EVERY_MICROBATCH",
       {true, true, true},
       {true, true, true}},
      // All-reduce happens only on microbatches that reduce-scatter.
      {"microbatches: 3 all_reduce: ALL_REDUCE_MODE_EVERY_MICROBATCH",
       {false, false, true},
       {false, false, true}},
      {"microbatches: 0", {true}, {true}},
  };
  for (const MicrobatchCase& c : cases) {
    const StepSchedule s = planner.Plan(P(c.policy), {0, 1, 0});
    ASSERT_EQ(s.microbatches_size(), static_cast<int>(c.sync.size()))
        << c.policy;
    for (int k = 0; k < s.microbatches_size(); ++k) {
      EXPECT_EQ(s.microbatches(k).requires_grad_sync(), c.sync[k])
          << c.policy << " " << k;
      EXPECT_EQ(s.microbatches(k).requires_all_reduce(), c.all_reduce[k])
          << c.policy << " " << k;
      EXPECT_EQ(s.microbatches(k).is_last_backward(),
                k == s.microbatches_size() - 1);
    }
  }
}

TEST(PlannerTest, CheckpointIntervalAndRequest) {
  Planner planner(MakeUnits(1), 1);
  const Policy every3 = P("checkpoint_interval: 3");
  std::vector<int64_t> checkpointed;
  for (int64_t step = 0; step < 10; ++step) {
    if (planner.Plan(every3, {step, 1, 0}).checkpoint())
      checkpointed.push_back(step);
  }
  EXPECT_EQ(checkpointed, (std::vector<int64_t>{2, 5, 8}));
  EXPECT_FALSE(planner.Plan(Policy(), {4, 1, 0, false}).checkpoint());
  EXPECT_TRUE(planner.Plan(Policy(), {4, 1, 0, true}).checkpoint());
}

TEST(PlannerTest, DeterministicBytes) {
  Planner a(MakeUnits(8), 2), b(MakeUnits(8), 2);
  const Policy p =
      P("forward_prefetch_depth: 2 microbatches: 4 memory_budget_bytes: 9000");
  EXPECT_EQ(a.Plan(p, {3, 4, 1}).SerializeAsString(),
            b.Plan(p, {3, 4, 1}).SerializeAsString());
}

TEST(PlannerTest, CountCollectivesFollowsTheFlags) {
  Planner planner(MakeUnits(3), 2);  // 4 units
  // Default: every unit gathers in forward, the three blocks again in
  // backward; one reduce-scatter each; one all-reduce each with replicas.
  CollectiveCounts c = CountCollectives(planner.Plan(Policy(), {}), 2);
  EXPECT_EQ(c.all_gathers, 4 + 3);
  EXPECT_EQ(c.reduce_scatters, 4);
  EXPECT_EQ(c.all_reduces, 4);
  EXPECT_EQ(CountCollectives(planner.Plan(Policy(), {}), 1).all_reduces, 0);
  // Kept after forward: no backward gathers.
  c = CountCollectives(planner.Plan(P("reshard_after_forward: false"), {}), 1);
  EXPECT_EQ(c.all_gathers, 4);
  // Two microbatches, syncing last only, blocks resharded after backward: the
  // second forward gathers the blocks again (the root stays unsharded).
  c = CountCollectives(planner.Plan(P("microbatches: 2"), {}), 2);
  EXPECT_EQ(c.all_gathers, (4 + 3) + (3 + 3));
  EXPECT_EQ(c.reduce_scatters, 4);
  EXPECT_EQ(c.all_reduces, 4);
  // Kept after backward too: the second microbatch gathers nothing in
  // forward.
  c = CountCollectives(
      planner.Plan(P("microbatches: 2 reshard_after_backward: false"), {}), 2);
  EXPECT_EQ(c.all_gathers, (4 + 3) + 3);
  // Syncing every microbatch, all-reducing on the last only.
  c = CountCollectives(
      planner.Plan(P("microbatches: 2 grad_sync: GRAD_SYNC_MODE_EVERY_"
                     "MICROBATCH"),
                   {}),
      2);
  EXPECT_EQ(c.reduce_scatters, 8);
  EXPECT_EQ(c.all_reduces, 4);
}

std::vector<std::vector<int>> Groups(const StepSchedule& s) {
  std::vector<std::vector<int>> out;
  for (const hsdp::v1::FusionGroup& g : s.fusion_groups())
    out.emplace_back(g.units().begin(), g.units().end());
  return out;
}

using GroupList = std::vector<std::vector<int>>;

// Comm fusion: consecutive units, first fit under the bucket; a unit over it,
// or with nothing to gather (replicated parameters only), goes alone and ends
// the group; groups of one are not written.
TEST(PlannerTest, FusionGroupsFillTheBucketInForwardOrder) {
  Planner planner(MakeUnits(1000, {400, 400, 400, 400}), 2);
  EXPECT_TRUE(Groups(planner.Plan(Policy(), {})).empty());
  EXPECT_EQ(Groups(planner.Plan(P("comm_fusion_bucket_bytes: 1000"), {})),
            (GroupList{{1, 2}, {3, 4}}));
  EXPECT_EQ(Groups(planner.Plan(P("comm_fusion_bucket_bytes: 1400"), {})),
            (GroupList{{0, 1}, {2, 3, 4}}));
  EXPECT_EQ(Groups(planner.Plan(P("comm_fusion_bucket_bytes: 2600"), {})),
            (GroupList{{0, 1, 2, 3, 4}}));
  EXPECT_TRUE(
      Groups(planner.Plan(P("comm_fusion_bucket_bytes: 399"), {})).empty());
  UnitList units = MakeUnits(100, {50, 5000, 50, 50, 60, 70});
  units[5].set_replicated_bytes(60);  // nothing to gather
  Planner mixed(units, 2);
  EXPECT_EQ(Groups(mixed.Plan(P("comm_fusion_bucket_bytes: 200"), {})),
            (GroupList{{0, 1}, {3, 4}}));
  // The same plan on every call (the schedule every rank runs).
  const Policy p = P("comm_fusion_bucket_bytes: 1400 microbatches: 2");
  EXPECT_EQ(planner.Plan(p, {3, 1, 1}).SerializeAsString(),
            Planner(planner.units(), 2).Plan(p, {3, 1, 1}).SerializeAsString());
}

// A fusion group gathers once where its members would each gather, and
// reduce-scatters once; the all-reduces across replicas stay per unit.
TEST(PlannerTest, CountCollectivesCountsAFusionGroupOnce) {
  Planner planner(MakeUnits(1000, {400, 400, 400, 400}), 2);
  const Policy pairs = P("comm_fusion_bucket_bytes: 1000");
  // {1, 2}, {3, 4}, the root alone: forward 3, backward 2 (the root kept).
  CollectiveCounts c = CountCollectives(planner.Plan(pairs, {}), 2);
  EXPECT_EQ(c.all_gathers, 3 + 2);
  EXPECT_EQ(c.reduce_scatters, 3);
  EXPECT_EQ(c.all_reduces, 5);
  const CollectiveCounts alone =
      CountCollectives(planner.Plan(Policy(), {}), 2);
  EXPECT_EQ(alone.all_gathers, 5 + 4);
  EXPECT_EQ(alone.reduce_scatters, 5);
  // Two microbatches, blocks kept after backward: the second forward
  // gathers nothing, and a group with one member kept after forward still
  // gathers once in backward for the other.
  Policy kept = P(R"(comm_fusion_bucket_bytes: 1000 microbatches: 2
                     reshard_after_backward: false
                     overrides { unit_glob: "layers.0" reshard_after_forward: false })");
  c = CountCollectives(planner.Plan(kept, {}), 1);
  EXPECT_EQ(c.all_gathers, (3 + 2) + 2);
  EXPECT_EQ(c.reduce_scatters, 3);
}

// Hierarchical reshard: planned only where the generation has host groups
// and the policy asks; each block resharded after forward then gathers over
// its host group in backward, alone, instead of over the shard group.
TEST(PlannerTest, ReshardWithinHostNeedsHostGroupsAndMovesBackwardGathers) {
  Planner planner(MakeUnits(1000, {400, 400, 400, 400}), 4);
  const Policy within = P("reshard_after_forward_within_host: true");
  EXPECT_EQ(planner.Plan(within, {}).post_forward_group_size(), 0);
  planner.SetHostGroupSize(2);
  EXPECT_EQ(planner.Plan(Policy(), {}).post_forward_group_size(), 0);
  const StepSchedule s = planner.Plan(within, {});
  EXPECT_EQ(s.post_forward_group_size(), 2);
  CollectiveCounts c = CountCollectives(s, 1);
  EXPECT_EQ(c.all_gathers, 5);  // forward only
  EXPECT_EQ(c.host_all_gathers, 4);
  // With every unit in one fusion group and one block kept after forward:
  // one forward gather, three host gathers, none over the shard group.
  c = CountCollectives(planner.Plan(P(R"(reshard_after_forward_within_host: true
                        comm_fusion_bucket_bytes: 1000000
                        overrides { unit_glob: "layers.1" reshard_after_forward: false })"),
                                    {}),
                       1);
  EXPECT_EQ(c.all_gathers, 1);
  EXPECT_EQ(c.host_all_gathers, 3);
  // The host shards cost memory: between the resharded and the kept plans.
  const int64_t resharded =
      planner.PredictPeak(planner.Plan(Policy(), {})).Total();
  const int64_t kept =
      planner.PredictPeak(planner.Plan(P("reshard_after_forward: false"), {}))
          .Total();
  const int64_t host = planner.PredictPeak(s).Total();
  EXPECT_GT(host, resharded);
  EXPECT_LT(host, kept);
}

// Under hierarchical reshard a kept block saves a backward gather inside the
// host: the memory-budget planner prices it on the intra-host link, for the
// host group's bytes ((k - 1) / k of the block, not (S - 1) / S).
TEST(PlannerTest, KeptBlocksUnderHierarchicalReshardSaveGathersInsideTheHost) {
  Planner planner(MakeUnits(1000, {400, 400, 400, 400}), 4);
  LinkCosts links;
  links.intra_host = {/*bytes_per_second=*/1e9, /*latency_seconds=*/1e-6};
  links.inter_host = {/*bytes_per_second=*/1e6, /*latency_seconds=*/1e-3};
  planner.SetLinks(links);
  planner.SetShardGroupsCrossHosts(true);
  planner.SetHostGroupSize(2);
  // A budget every plan fits: all four blocks kept in both.
  const StepSchedule across =
      planner.Plan(P("memory_budget_bytes: 100000000"), {});
  const StepSchedule within = planner.Plan(P(R"(memory_budget_bytes: 100000000
                        reshard_after_forward_within_host: true)"),
                                           {});
  ASSERT_EQ(within.post_forward_group_size(), 2);
  const AllGatherSavings a = planner.Savings(across);
  const AllGatherSavings w = planner.Savings(within);
  EXPECT_EQ(a.count, 4);
  EXPECT_EQ(w.count, 4);
  EXPECT_EQ(a.bytes, 4 * 300);  // 400 * 3/4 over the shard group of 4
  EXPECT_EQ(w.bytes, 4 * 200);  // 400 * 1/2 over the host group of 2
  EXPECT_DOUBLE_EQ(a.seconds, 4 * links.inter_host.Seconds(300));
  EXPECT_DOUBLE_EQ(w.seconds, 4 * links.intra_host.Seconds(200));
  // Without an intra-host figure the time-based choice has nothing to weigh:
  // the plan is the smallest-first one, and saves no predicted time.
  Planner undeclared(MakeUnits(1000, {400, 400, 400, 400}), 4);
  LinkCosts inter_only;
  inter_only.inter_host = links.inter_host;
  undeclared.SetLinks(inter_only);
  undeclared.SetShardGroupsCrossHosts(true);
  undeclared.SetHostGroupSize(2);
  const StepSchedule plain = undeclared.Plan(P(R"(memory_budget_bytes: 100000000
           reshard_after_forward_within_host: true)"),
                                             {});
  EXPECT_EQ(Kept(plain), Kept(within));
  EXPECT_EQ(undeclared.Savings(plain).seconds, 0);
}

// Root 400 bytes, six layers of 100, S = 2.
UnitList BudgetUnits() {
  return MakeUnits(400, {100, 100, 100, 100, 100, 100});
}

int64_t PeakOf(const Planner& planner, const Policy& policy) {
  Planner scratch(planner.units(), planner.memory_model().options());
  return scratch.PredictPeak(scratch.Plan(policy, {})).Total();
}

TEST(PlannerTest, MemoryBudgetKeepsWhatFits) {
  Planner planner(BudgetUnits(), 2);
  const int64_t least = PeakOf(planner, P("reshard_after_forward: true"));
  const int64_t most = PeakOf(planner, P("reshard_after_forward: false"));
  ASSERT_LT(least, most);
  // Huge budget: every block stays unsharded after forward (no backward
  // all-gathers).
  StepSchedule s = planner.Plan(P("memory_budget_bytes: 1000000"), {0, 1, 0});
  EXPECT_EQ(Kept(s), std::vector<bool>(7, true));
  EXPECT_EQ(s.predicted_peak_bytes(), most);
  EXPECT_FALSE(s.over_memory_budget());
  // Exactly the least peak: not over, and only what costs nothing at the peak
  // is kept (the last blocks: backward reaches them before the peak, which is
  // mid-backward, where a reduce-scatter overlaps the next unit's gradients).
  Policy p;
  p.set_memory_budget_bytes(least);
  s = planner.Plan(p, {1, 1, 0});
  EXPECT_FALSE(s.over_memory_budget());
  EXPECT_EQ(s.predicted_peak_bytes(), least);
  EXPECT_EQ(Kept(s),
            (std::vector<bool>{true, false, false, false, false, true, true}));
  // In between: some kept, the latest blocks first (equal sizes), within the
  // budget.
  p.set_memory_budget_bytes((least + most) / 2);
  s = planner.Plan(p, {2, 1, 0});
  const std::vector<bool> kept = Kept(s);
  const int n_kept =
      static_cast<int>(std::count(kept.begin(), kept.end(), true));
  EXPECT_GT(n_kept, 1);
  EXPECT_LT(n_kept, 7);
  EXPECT_TRUE(kept.back());
  EXPECT_LE(s.predicted_peak_bytes(), p.memory_budget_bytes());
  EXPECT_EQ(s.predicted_peak_bytes(), planner.last_predicted_peak_bytes());
  // The backward lists follow the choice: no kept block is prefetched.
  for (int i = 0; i < s.units_size(); ++i) {
    for (int j : Bwd(s, i)) EXPECT_TRUE(s.units(j).reshard_after_forward());
  }
  // Explicit overrides are not second-guessed.
  s = planner.Plan(P(R"(memory_budget_bytes: 1000000
                        overrides { unit_glob: "layers.1" reshard_after_forward: true })"),
                   {3, 1, 0});
  EXPECT_EQ(Kept(s),
            (std::vector<bool>{true, true, false, true, true, true, true}));
}

// A large first block, then small ones, on 8 ranks. For every budget that
// some set of kept blocks predicts exactly: the plan on a declared link stays
// within the budget and saves at least the all-gather time the plan without
// links saves, and at most what the best set within the budget saves (every
// set is tried). On a slow link across hosts, where a kept block saves its
// bytes' time, it saves more than the most-blocks plan for some budgets, and
// then as much as the best set.
TEST(PlannerTest, DeclaredLinksWeighWhatAKeptBlockSaves) {
  constexpr int64_t kMiB = 1 << 20;
  const UnitList units = MakeUnits(
      1 * kMiB, {24 * kMiB, 8 * kMiB, 8 * kMiB, 8 * kMiB, 8 * kMiB, 8 * kMiB});
  constexpr int kBlocks = 6;
  Planner planner(units, 8);
  LinkCosts links;
  links.intra_host = {/*bytes_per_second=*/50e9, /*latency_seconds=*/1e-3};
  links.inter_host = {/*bytes_per_second=*/125e6, /*latency_seconds=*/50e-6};
  // Every set of kept blocks (bit b: block b + 1), its peak and what it
  // saves on each link.
  struct Set {
    int mask = 0;
    int64_t peak = 0;
    AllGatherSavings inside, across;
  };
  std::vector<Set> sets;
  for (int mask = 0; mask < (1 << kBlocks); ++mask) {
    Policy p = P("reshard_after_forward: true");
    for (int b = 0; b < kBlocks; ++b) {
      hsdp::v1::UnitOverride* o = p.add_overrides();
      o->set_unit_glob("layers." + std::to_string(b));
      o->set_reshard_after_forward((mask & (1 << b)) == 0);
    }
    Planner scratch(units, 8);
    scratch.SetLinks(links);
    const StepSchedule s = scratch.Plan(p, {});
    Set set{mask, scratch.PredictPeak(s).Total(), {}, {}};
    set.inside = scratch.Savings(s);
    scratch.SetShardGroupsCrossHosts(true);
    set.across = scratch.Savings(s);
    sets.push_back(set);
  }
  // Budgets where the plan across hosts saves more than the most blocks.
  int better = 0;
  for (const Set& at : sets) {
    const int64_t budget = at.peak;
    double best_inside = 0, best_across = 0;
    for (const Set& s : sets) {
      if (s.peak > budget) continue;
      best_inside = std::max(best_inside, s.inside.seconds);
      best_across = std::max(best_across, s.across.seconds);
    }
    Policy p;
    p.set_memory_budget_bytes(budget);
    Planner plain(units, 8);
    const StepSchedule most = plain.Plan(p, {});
    Planner linked(units, 8);
    linked.SetLinks(links);
    const StepSchedule inside = linked.Plan(p, {});
    linked.SetShardGroupsCrossHosts(true);
    const StepSchedule across = linked.Plan(p, {1, 1, 0});
    SCOPED_TRACE(absl::StrCat("budget: the peak of set ", at.mask));
    EXPECT_LE(across.predicted_peak_bytes(), budget);
    EXPECT_LE(inside.predicted_peak_bytes(), budget);
    // Never less than the plan without links saves, at most the best set.
    const double across_saved = linked.Savings(across).seconds;
    const double most_saved = linked.Savings(most).seconds;
    EXPECT_GE(across_saved, most_saved);
    EXPECT_LE(across_saved, best_across + 1e-12);
    if (across_saved > most_saved) {
      ++better;
      EXPECT_NEAR(across_saved, best_across, 1e-12);
    }
    linked.SetShardGroupsCrossHosts(false);
    EXPECT_GE(linked.Savings(inside).seconds, linked.Savings(most).seconds);
    EXPECT_LE(linked.Savings(inside).seconds, best_inside + 1e-12);
    EXPECT_GE(linked.Savings(inside).count, plain.Savings(most).count);
    // The backward lists follow the choice.
    for (int i = 0; i < across.units_size(); ++i) {
      for (int j : Bwd(across, i)) {
        EXPECT_TRUE(across.units(j).reshard_after_forward());
      }
    }
  }
  EXPECT_GT(better, 0);
}

TEST(PlannerTest, MemoryBudgetBelowTheLeastPeakRunsTheLeastPlanAndSaysSo) {
  Planner planner(BudgetUnits(), 2);
  const int64_t least = PeakOf(planner, Policy());
  Policy p;
  p.set_memory_budget_bytes(least - 1);
  const StepSchedule s = planner.Plan(p, {0, 1, 0});
  EXPECT_TRUE(s.over_memory_budget());
  EXPECT_EQ(s.predicted_peak_bytes(), least);
  EXPECT_EQ(Kept(s), (std::vector<bool>{true, false, false, false, false, false,
                                        false}));
  // SetPolicy's check refuses it, naming the field and both figures.
  const absl::Status refused = planner.CheckMemoryBudget(p);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("policy.memory_budget_bytes"),
            std::string::npos)
      << refused;
  EXPECT_NE(refused.message().find(std::to_string(least)), std::string::npos)
      << refused;
  p.set_memory_budget_bytes(least);
  EXPECT_TRUE(planner.CheckMemoryBudget(p).ok());
  EXPECT_TRUE(planner.CheckMemoryBudget(Policy()).ok());  // manual mode
}

TEST(PlannerTest, MemoryBudgetMonotoneInBudget) {
  Planner planner(MakeUnits(1000, {300, 100, 200, 100, 500, 50}), 2);
  int previous = -1;
  for (int64_t budget = 1000; budget <= 20000; budget += 250) {
    Policy p;
    p.set_memory_budget_bytes(budget);
    const StepSchedule s = planner.Plan(p, {0, 1, 0});
    int kept = 0;
    for (bool k : Kept(s)) kept += k;
    EXPECT_GE(kept, previous) << budget;
    previous = kept;
    if (!s.over_memory_budget()) {
      EXPECT_LE(planner.last_predicted_peak_bytes(), budget);
    }
  }
  EXPECT_EQ(previous, 7);
}

TEST(PlannerTest, CorrectsFromReportedPeaksAndActivations) {
  Planner planner(BudgetUnits(), 2);
  const int64_t least = PeakOf(planner, Policy());
  const int64_t most = PeakOf(planner, P("reshard_after_forward: false"));
  Policy p;
  p.set_memory_budget_bytes(most);
  StepSchedule s = planner.Plan(p, {0, 1, 0});
  EXPECT_EQ(Kept(s), std::vector<bool>(7, true));
  EXPECT_EQ(planner.memory_correction_bytes(), 0);
  // Ranks measured 300 bytes more than predicted: the next step keeps fewer.
  planner.ObservePeakMemory(0, most + 100, 0);
  planner.ObservePeakMemory(0, most + 300, 0);
  planner.ObservePeakMemory(0, most + 200, 0);  // not the max: changes nothing
  EXPECT_EQ(planner.memory_correction_bytes(), 300);
  s = planner.Plan(p, {1, 1, 0});
  EXPECT_LE(s.predicted_peak_bytes(), most);
  EXPECT_NE(Kept(s), std::vector<bool>(7, true));
  // Step 1 measured exactly as predicted raw, and reported activations: the
  // correction is the largest of the window (still 300 from step 0); the
  // activations enter the model.
  const int64_t raw1 = planner.PredictPeak(s).Total();
  planner.ObservePeakMemory(1, raw1 + 600, 600);
  EXPECT_EQ(planner.activation_bytes(), 600);
  const int64_t correction1 =
      raw1 + 600 - planner.memory_model().PredictPeak(s, 600).Total();
  EXPECT_LT(correction1, 600);  // the activations explain part of it
  EXPECT_EQ(planner.memory_correction_bytes(),
            std::max<int64_t>(300, correction1));
  // After the window moved past step 0 the correction is the newer steps'.
  for (int64_t step = 2; step <= 1 + kCorrectionWindowSteps; ++step) {
    s = planner.Plan(p, {step, 1, 0});
    planner.ObservePeakMemory(step, planner.PredictPeak(s).Total() + 50, 600);
  }
  EXPECT_EQ(planner.memory_correction_bytes(), 50);
  // A late report for a step older than the window changes nothing.
  planner.ObservePeakMemory(0, most * 4, 0);
  EXPECT_EQ(planner.memory_correction_bytes(), 50);
  // An absurd report is clamped: the corrected prediction stays within a
  // factor of the raw one, so the least plan still runs.
  s = planner.Plan(p, {10, 1, 0});
  planner.ObservePeakMemory(10, least * 1000, 600);
  s = planner.Plan(p, {11, 1, 0});
  EXPECT_TRUE(s.over_memory_budget());
  EXPECT_LE(s.predicted_peak_bytes(),
            planner.PredictPeak(s).Total() * kMaxCorrectionRatio);
}

TEST(PlannerTest, ManualModeLearnsTooSoABudgetSetLaterIsInformed) {
  Planner planner(BudgetUnits(), 2);
  const StepSchedule s = planner.Plan(Policy(), {0, 1, 0});
  planner.ObservePeakMemory(0, planner.PredictPeak(s).Total() + 1000, 0);
  EXPECT_EQ(planner.memory_correction_bytes(), 1000);
  // Manual schedules stay exactly what the policy says.
  EXPECT_EQ(planner.Plan(Policy(), {1, 1, 0}).predicted_peak_bytes(), 0);
  // A budget the uncorrected model would accept is refused with the
  // correction.
  Policy p;
  p.set_memory_budget_bytes(PeakOf(planner, Policy()) + 500);
  EXPECT_EQ(planner.CheckMemoryBudget(p).code(),
            absl::StatusCode::kInvalidArgument);
  // Reports for steps never planned are ignored.
  planner.ObservePeakMemory(99, 1 << 30, 0);
  EXPECT_EQ(planner.memory_correction_bytes(), 1000);
}

}  // namespace
}  // namespace hsdp::coordinator
