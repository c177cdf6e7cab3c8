// End-to-end memory budget: a real coordinator and two hsdp-worker processes
// (1x2), whose reported peaks are measured (the counting allocator,
// worker/fsdp/memory_meter.h) and fed back to the planner.
//
// One job runs through four policies set with hsdpctl: every block resharded
// after forward (the least peak), none resharded (the most), a memory budget
// halfway between, then a budget lowered below the peak that budget settled
// at. After kSettleSteps past each budget's effective step every reported peak
// is under that budget, and the budgeted steps keep blocks unsharded after
// forward, so they all-gather less than the least-memory plan. A budget below
// the least peak is refused by `hsdpctl policy set` with an error naming
// policy.memory_budget_bytes, and the running policy stays.
#include <algorithm>
#include <chrono>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/e2e/cluster.h"

namespace hsdp::e2e {
namespace {

constexpr int kBudgetWorkers = 2;
constexpr char kBudgetMesh[] = "1x2";
// Six blocks of 128 wide over 16 tokens: the blocks' parameters, which the
// planner decides to keep or reshard, weigh about as much as the activations,
// so the least and most peaks are megabytes apart.
constexpr char kBudgetDims[] = "128,6,2,16";
// Steps after a policy's effective step before its budget must hold: the
// read-ahead window (4 sealed steps) plus reports of the first budgeted steps.
constexpr int64_t kSettleSteps = 8;
// Steps over which it must hold.
constexpr int64_t kHoldSteps = 6;

// Rank r's latest record of each step.
std::map<int64_t, StepRecord> ByStep(const Cluster& c, int r) {
  std::map<int64_t, StepRecord> out;
  for (const StepRecord& s : ReadReport(c.report(r))) out[s.step] = s;
  return out;
}

// Blocks until every rank reported `step` (false when the time runs out).
bool WaitForAll(const Cluster& c, int64_t step) {
  for (int r = 0; r < kBudgetWorkers; ++r) {
    const auto deadline = Clock::now() + kRunTimeout;
    while (ByStep(c, r).count(step) == 0) {
      if (Clock::now() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  return true;
}

// `hsdpctl policy set ARGS`; the step the change applies from, or -1 with the
// output in *out.
int64_t SetPolicy(Cluster& c, const std::vector<std::string>& args,
                  std::string* out) {
  std::vector<std::string> argv = {"policy", "set"};
  argv.insert(argv.end(), args.begin(), args.end());
  if (c.Ctl(argv, out) != 0) return -1;
  const std::string needle = "applies from step ";
  const size_t at = out->find(needle);
  if (at == std::string::npos) return -1;
  size_t end = at + needle.size();
  while (end < out->size() && absl::ascii_isdigit((*out)[end])) ++end;
  int64_t step = -1;
  if (!absl::SimpleAtoi(
          out->substr(at + needle.size(), end - at - needle.size()), &step)) {
    return -1;
  }
  return step;
}

// The largest peak any rank reported over steps [first, last].
int64_t MaxPeak(const Cluster& c, int64_t first, int64_t last) {
  int64_t peak = 0;
  for (int r = 0; r < kBudgetWorkers; ++r) {
    const std::map<int64_t, StepRecord> steps = ByStep(c, r);
    for (int64_t s = first; s <= last; ++s) {
      auto it = steps.find(s);
      EXPECT_NE(it, steps.end()) << "rank " << r << " step " << s;
      if (it != steps.end()) peak = std::max(peak, it->second.peak);
    }
  }
  return peak;
}

// All-gathers of one single-microbatch step: every unit in forward, those
// resharded after forward again in backward.
int64_t AllGathers(const StepRecord& s) {
  return static_cast<int64_t>(s.reshard_after_forward.size()) +
         std::count(s.reshard_after_forward.begin(),
                    s.reshard_after_forward.end(), '1');
}

// Waits until the budget applied from `effective` has settled, then checks
// every rank's peaks over the hold window against `budget`; returns the
// largest and the most all-gathers of a step in the window.
std::pair<int64_t, int64_t> ExpectBudgetHolds(const Cluster& c,
                                              int64_t effective,
                                              int64_t budget) {
  const int64_t first = effective + kSettleSteps;
  const int64_t last = first + kHoldSteps - 1;
  EXPECT_TRUE(WaitForAll(c, last));
  int64_t peak = 0, gathers = 0;
  for (int r = 0; r < kBudgetWorkers; ++r) {
    const std::map<int64_t, StepRecord> steps = ByStep(c, r);
    for (int64_t s = first; s <= last; ++s) {
      const StepRecord& rec = steps.at(s);
      EXPECT_LE(rec.peak, budget) << "rank " << r << " step " << s;
      peak = std::max(peak, rec.peak);
      gathers = std::max(gathers, AllGathers(rec));
    }
  }
  return {peak, gathers};
}

TEST(BudgetE2eTest, MemoryBudgetHoldsFollowsChangesAndRefusesTheImpossible) {
  Cluster c("budget");
  c.StartCoordinator(kBudgetWorkers, kBudgetMesh);
  c.StartWorkers(kBudgetWorkers, {"--dims", kBudgetDims}, /*steps=*/100000);
  std::string out;

  // The least peak: the default policy. Step 0 has no optimizer state yet.
  ASSERT_TRUE(WaitForAll(c, 3));
  const int64_t keep_from =
      SetPolicy(c, {"--reshard-after-forward=false"}, &out);
  ASSERT_GT(keep_from, 2) << out;
  ASSERT_TRUE(WaitForAll(c, keep_from + 2));
  const int64_t least = MaxPeak(c, 1, keep_from - 1);
  const int64_t most = MaxPeak(c, keep_from, keep_from + 2);
  const StepRecord least_step = ByStep(c, 0).at(1);
  SCOPED_TRACE(absl::StrCat("least peak ", least, ", most ", most));
  // The two plans differ by more than a block's unsharded parameters.
  ASSERT_GT(most - least, 128 * 128 * 4 * 4);

  // A budget halfway: met, with blocks kept (fewer all-gathers).
  const int64_t budget = (least + most) / 2;
  const int64_t budget_from =
      SetPolicy(c, {"--memory-budget", std::to_string(budget)}, &out);
  ASSERT_GT(budget_from, keep_from) << out;
  const auto [settled, gathers] = ExpectBudgetHolds(c, budget_from, budget);
  EXPECT_LT(gathers, AllGathers(least_step));

  // Lowered below the peak it settled at: the plan must change, and does.
  const int64_t lower = (least + settled) / 2;
  ASSERT_LT(lower, settled);
  const int64_t lower_from =
      SetPolicy(c, {"--memory-budget", std::to_string(lower)}, &out);
  ASSERT_GT(lower_from, budget_from) << out;
  ExpectBudgetHolds(c, lower_from, lower);

  // Below the least peak: refused, naming the field; the job keeps the lowered
  // budget.
  std::vector<std::string> below = {"policy", "set", "--memory-budget",
                                    std::to_string(least / 2)};
  EXPECT_NE(c.Ctl(below, &out), 0) << out;
  EXPECT_NE(out.find("policy.memory_budget_bytes"), std::string::npos) << out;
  EXPECT_NE(out.find("below the least peak"), std::string::npos) << out;
  ASSERT_EQ(c.Ctl({"policy", "get"}, &out), 0) << out;
  EXPECT_NE(out.find(std::to_string(lower)), std::string::npos) << out;

  ASSERT_EQ(c.Ctl({"drain"}, &out), 0) << out;
  c.WaitWorkers();
}

}  // namespace
}  // namespace hsdp::e2e
