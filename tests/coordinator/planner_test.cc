#include "coordinator/planner.h"

#include <gtest/gtest.h>

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

TEST(PlannerTest, DefaultPolicy) {
  Planner planner(MakeUnits(3), 2);
  const StepSchedule s = planner.Plan(Policy(), {7, 2, 5, false});
  EXPECT_EQ(s.step(), 7);
  EXPECT_EQ(s.policy_version(), 2);
  EXPECT_EQ(s.generation(), 5);
  EXPECT_FALSE(s.checkpoint());
  ASSERT_EQ(s.microbatches_size(), 1);
  EXPECT_TRUE(s.microbatches(0).requires_grad_sync());
  EXPECT_TRUE(s.microbatches(0).requires_all_reduce());
  EXPECT_TRUE(s.microbatches(0).is_last_backward());
  ASSERT_EQ(s.units_size(), 4);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(s.units(i).unit_index(), i);
    EXPECT_TRUE(s.units(i).reshard_after_forward());
    EXPECT_TRUE(s.units(i).reshard_after_backward());
  }
  EXPECT_EQ(s.units(0).unit_name(), "root");
  EXPECT_EQ(s.units(3).unit_name(), "layers.2");
  EXPECT_EQ(Fwd(s, 0), (std::vector<int>{1}));
  EXPECT_EQ(Fwd(s, 2), (std::vector<int>{3}));
  EXPECT_EQ(Fwd(s, 3), (std::vector<int>{}));
  EXPECT_EQ(Bwd(s, 0), (std::vector<int>{}));
  EXPECT_EQ(Bwd(s, 1), (std::vector<int>{0}));
  EXPECT_EQ(Bwd(s, 3), (std::vector<int>{2}));
}

TEST(PlannerTest, PrefetchDepthsFollowUnitOrder) {
  Planner planner(MakeUnits(5), 1);
  StepSchedule s = planner.Plan(
      P("forward_prefetch_depth: 2 backward_prefetch_depth: 3"), {0, 1, 0});
  EXPECT_EQ(Fwd(s, 0), (std::vector<int>{1, 2}));
  EXPECT_EQ(Fwd(s, 4), (std::vector<int>{5}));
  EXPECT_EQ(Fwd(s, 5), (std::vector<int>{}));
  EXPECT_EQ(Bwd(s, 5), (std::vector<int>{4, 3, 2}));
  EXPECT_EQ(Bwd(s, 2), (std::vector<int>{1, 0}));
  s = planner.Plan(P("forward_prefetch_depth: 0 backward_prefetch_depth: 0"),
                   {0, 1, 0});
  for (int i = 0; i < s.units_size(); ++i) {
    EXPECT_TRUE(Fwd(s, i).empty());
    EXPECT_TRUE(Bwd(s, i).empty());
  }
  s = planner.Plan(P("forward_prefetch_depth: 16"), {0, 1, 0});
  EXPECT_EQ(Fwd(s, 0), (std::vector<int>{1, 2, 3, 4, 5}));
}

TEST(PlannerTest, OverridesApplyInOrder) {
  Planner planner(MakeUnits(12), 1);
  const StepSchedule s = planner.Plan(P(R"(
      reshard_after_backward: false
      overrides { unit_glob: "layers.*" reshard_after_forward: false }
      overrides { unit_glob: "layers.1?" reshard_after_forward: true }
      overrides { unit_glob: "root" reshard_after_backward: true })"),
                                      {0, 1, 0});
  EXPECT_TRUE(s.units(0).reshard_after_forward());    // root: default
  EXPECT_TRUE(s.units(0).reshard_after_backward());   // root override
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

// Root 400 bytes, three layers of 100, S = 2, prefetch depth 1 (see
// PredictPeakBytes): sharded state = 4 * (200 + 3 * 50) = 1400.
UnitList BudgetUnits() { return MakeUnits(400, {100, 100, 100}); }

TEST(PlannerTest, PredictPeakBytesModel) {
  const UnitList units = BudgetUnits();
  // Nothing kept: the worst window is root's backward: 400 (gradient) + 400 =
  // 800.
  EXPECT_EQ(
      Planner::PredictPeakBytes(units, 2, {false, false, false, false}, 1, 1),
      2200);
  // Everything kept: + 700 unsharded, window is only root's gradient (400).
  EXPECT_EQ(Planner::PredictPeakBytes(units, 2, {true, true, true, true}, 1, 1),
            2500);
  // layers.2 kept: + 100, window unchanged.
  EXPECT_EQ(
      Planner::PredictPeakBytes(units, 2, {false, false, false, true}, 1, 1),
      2300);
  // Deeper prefetch widens the window: forward from root is 400 + 100 + 100.
  EXPECT_EQ(
      Planner::PredictPeakBytes(units, 2, {false, false, false, false}, 2, 0),
      2200);
  EXPECT_EQ(
      Planner::PredictPeakBytes(units, 1, {false, false, false, false}, 1, 1),
      4 * 700 + 800);
}

std::vector<bool> Kept(const StepSchedule& s) {
  std::vector<bool> kept;
  for (const auto& u : s.units()) kept.push_back(!u.reshard_after_forward());
  return kept;
}

TEST(PlannerTest, MemoryBudgetKeepsWhatFits) {
  Planner planner(BudgetUnits(), 2);
  // Huge budget: every unit stays unsharded after forward (no backward
  // all-gathers).
  StepSchedule s = planner.Plan(P("memory_budget_bytes: 1000000"), {0, 1, 0});
  EXPECT_EQ(Kept(s), (std::vector<bool>{true, true, true, true}));
  // Below the all-resharded prediction: best effort, nothing kept.
  s = planner.Plan(P("memory_budget_bytes: 1"), {1, 1, 0});
  EXPECT_EQ(Kept(s), (std::vector<bool>{false, false, false, false}));
  // 2300: the smallest, latest unit (layers.2) fits; then layers.1/layers.0
  // would raise the prediction to 2400, but keeping root too shrinks root's
  // backward window: 2300.
  s = planner.Plan(P("memory_budget_bytes: 2300"), {2, 1, 0});
  EXPECT_EQ(Kept(s), (std::vector<bool>{true, false, false, true}));
  EXPECT_LE(planner.last_predicted_peak_bytes(), 2300);
  // Explicit overrides are not second-guessed.
  s = planner.Plan(P(R"(memory_budget_bytes: 1000000
                        overrides { unit_glob: "layers.1" reshard_after_forward: true })"),
                   {3, 1, 0});
  EXPECT_EQ(Kept(s), (std::vector<bool>{true, true, false, true}));
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
    if (kept > 0) {
      EXPECT_LE(planner.last_predicted_peak_bytes(), budget);
    }
  }
  EXPECT_EQ(previous, 7);
}

TEST(PlannerTest, CorrectsFromReportedPeaks) {
  Planner planner(BudgetUnits(), 2);
  const Policy p = P("memory_budget_bytes: 2300");
  StepSchedule s = planner.Plan(p, {0, 1, 0});
  EXPECT_EQ(Kept(s), (std::vector<bool>{true, false, false, true}));
  EXPECT_DOUBLE_EQ(planner.memory_correction(), 1.0);
  // Ranks measured twice the prediction (2300): the next step keeps nothing.
  planner.ObservePeakMemory(0, 3000);
  planner.ObservePeakMemory(0, 4600);
  EXPECT_DOUBLE_EQ(planner.memory_correction(), 2.0);
  s = planner.Plan(p, {1, 1, 0});
  EXPECT_EQ(Kept(s), (std::vector<bool>{false, false, false, false}));
  // Step 1 (predicted 2200) measured at 2200: back to the uncorrected choice.
  planner.ObservePeakMemory(1, 2200);
  EXPECT_DOUBLE_EQ(planner.memory_correction(), 1.0);
  // A late report for an older step does not override the newer one.
  planner.ObservePeakMemory(0, 9000);
  EXPECT_DOUBLE_EQ(planner.memory_correction(), 1.0);
  s = planner.Plan(p, {2, 1, 0});
  EXPECT_EQ(Kept(s), (std::vector<bool>{true, false, false, true}));
  // Absurd reports are clamped.
  planner.ObservePeakMemory(2, 1);
  EXPECT_DOUBLE_EQ(planner.memory_correction(), kMinMemoryCorrection);
}

TEST(PlannerTest, ManualModeIgnoresPeakReports) {
  Planner planner(BudgetUnits(), 2);
  planner.Plan(Policy(), {0, 1, 0});
  planner.ObservePeakMemory(0, 1 << 30);
  EXPECT_DOUBLE_EQ(planner.memory_correction(), 1.0);
}

}  // namespace
}  // namespace hsdp::coordinator
