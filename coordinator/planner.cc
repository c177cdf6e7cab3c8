#include "coordinator/planner.h"

#include <algorithm>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/policy.h"

namespace hsdp::coordinator {
namespace {

using hsdp::v1::Policy;
using hsdp::v1::StepSchedule;

constexpr char kRootUnit[] = "root";
constexpr double kMiB = 1024.0 * 1024.0;

// The root's flags that overrides naming it exactly ("root", no wildcard) set;
// later overrides win.
struct RootPins {
  std::optional<bool> after_forward;
  std::optional<bool> after_backward;
};

RootPins ExplicitRootPins(const Policy& policy) {
  RootPins pins;
  for (const hsdp::v1::UnitOverride& o : policy.overrides()) {
    if (o.unit_glob() != kRootUnit) continue;
    if (o.has_reshard_after_forward())
      pins.after_forward = o.reshard_after_forward();
    if (o.has_reshard_after_backward())
      pins.after_backward = o.reshard_after_backward();
  }
  return pins;
}

// Fills forward_prefetch / backward_prefetch of every unit from the reshard
// flags already in `schedule` (see the header for the rules).
void FillPrefetchLists(int forward_depth, int backward_depth,
                       StepSchedule* schedule) {
  const int n = schedule->units_size();
  for (int i = 0; i < n; ++i) {
    hsdp::v1::UnitSchedule* unit = schedule->mutable_units(i);
    unit->clear_forward_prefetch();
    unit->clear_backward_prefetch();
    for (int j = i + 1; j < n && j <= i + forward_depth; ++j) {
      unit->add_forward_prefetch(j);
    }
  }
  // Backward order: the root, then the blocks n-1 .. 1.
  auto at = [n](int position) { return position == 0 ? 0 : n - position; };
  for (int p = 0; p < n; ++p) {
    hsdp::v1::UnitSchedule* unit = schedule->mutable_units(at(p));
    for (int q = p + 1;
         q < n && unit->backward_prefetch_size() < backward_depth; ++q) {
      const int j = at(q);
      if (schedule->units(j).reshard_after_forward()) {
        unit->add_backward_prefetch(j);
      }
    }
  }
}

// Comm fusion: groups of consecutive units (index order, which is forward
// order) whose gathered bytes add up to at most `bucket`. A unit with nothing
// to gather, or over the bucket alone, ends the group and goes alone; groups
// of one unit are not written.
void FillFusionGroups(const UnitList& units, int64_t bucket,
                      StepSchedule* schedule) {
  schedule->clear_fusion_groups();
  if (bucket <= 0) return;
  std::vector<int> group;
  int64_t group_bytes = 0;
  auto close = [&] {
    if (group.size() > 1) {
      hsdp::v1::FusionGroup* g = schedule->add_fusion_groups();
      g->mutable_units()->Add(group.begin(), group.end());
    }
    group.clear();
    group_bytes = 0;
  };
  for (int i = 0; i < static_cast<int>(units.size()); ++i) {
    const int64_t gathered = GatheredBytes(units[i]);
    if (gathered <= 0 || gathered > bucket) {
      close();
      continue;
    }
    if (group_bytes + gathered > bucket) close();
    group.push_back(i);
    group_bytes += gathered;
  }
  close();
}

}  // namespace

double LinkCost::Seconds(int64_t bytes) const {
  if (!declared()) return 0;
  return latency_seconds + static_cast<double>(bytes) / bytes_per_second;
}

CollectiveCounts CountCollectives(const StepSchedule& schedule,
                                  int replicate_size) {
  CollectiveCounts counts;
  const int n = schedule.units_size();
  const int m = std::max(1, schedule.microbatches_size());
  const bool host_group = schedule.post_forward_group_size() > 1;
  // The units whose collectives go out together: a fusion group, or one unit.
  std::vector<std::vector<int>> sets;
  std::vector<bool> fused(static_cast<size_t>(n), false);
  for (const hsdp::v1::FusionGroup& g : schedule.fusion_groups()) {
    sets.emplace_back(g.units().begin(), g.units().end());
    for (int i : g.units()) fused[i] = true;
  }
  for (int i = 0; i < n; ++i) {
    if (!fused[i]) sets.push_back({i});
  }
  for (int k = 0; k < m; ++k) {
    const bool sync = schedule.microbatches_size() == 0 ||
                      schedule.microbatches(k).requires_grad_sync();
    const bool all_reduce = schedule.microbatches_size() == 0 ||
                            schedule.microbatches(k).requires_all_reduce();
    for (const std::vector<int>& set : sets) {
      // Forward: every unit is sharded when a step starts; later microbatches
      // find it sharded only if the previous backward resharded it. The
      // first member a forward needs to gather gathers every member still
      // sharded; backward likewise for those resharded after forward, unless
      // they kept a host shard: those gather it alone over the host group.
      bool forward_gather = false, backward_gather = false;
      for (int i : set) {
        const hsdp::v1::UnitSchedule& u = schedule.units(i);
        forward_gather = forward_gather || k == 0 || u.reshard_after_backward();
        if (u.reshard_after_forward() && host_group) {
          ++counts.host_all_gathers;
        } else {
          backward_gather = backward_gather || u.reshard_after_forward();
        }
        if (sync && all_reduce && replicate_size > 1) ++counts.all_reduces;
      }
      counts.all_gathers +=
          (forward_gather ? 1 : 0) + (backward_gather ? 1 : 0);
      if (sync) ++counts.reduce_scatters;
    }
  }
  return counts;
}

Planner::Planner(UnitList units, MemoryModel::Options memory)
    : units_(std::move(units)), model_(units_, memory) {}

Planner::Planner(UnitList units, int shard_size)
    : Planner(std::move(units), [shard_size] {
        MemoryModel::Options options;
        options.shard_size = shard_size;
        return options;
      }()) {}

MemoryBreakdown Planner::PredictPeak(const StepSchedule& schedule) const {
  return model_.PredictPeak(schedule, activation_bytes_);
}

int64_t Planner::Corrected(int64_t raw) const {
  return std::clamp(raw + correction_, raw / kMaxCorrectionRatio,
                    raw * kMaxCorrectionRatio);
}

std::string Planner::PlanKey(const StepSchedule& schedule) {
  StepSchedule shape = schedule;
  shape.clear_step();
  shape.clear_policy_version();
  shape.clear_generation();
  shape.clear_checkpoint();
  shape.clear_predicted_peak_bytes();
  shape.clear_over_memory_budget();
  for (auto& unit : *shape.mutable_units()) unit.clear_unit_name();
  return shape.SerializeAsString();
}

int64_t Planner::PredictedPeakBytes(const StepSchedule& schedule) const {
  const int64_t raw = PredictPeak(schedule).Total();
  auto known = measured_plans_.find(PlanKey(schedule));
  if (known == measured_plans_.end()) return Corrected(raw);
  // Clamped like the correction: one absurd report must not rule a plan out.
  return std::clamp(known->second.peak_bytes, raw / kMaxCorrectionRatio,
                    raw * kMaxCorrectionRatio);
}

StepSchedule Planner::PlanManual(const Policy& resolved,
                                 const PlanInput& input) const {
  const int n = static_cast<int>(units_.size());
  StepSchedule schedule;
  schedule.set_step(input.step);
  schedule.set_policy_version(input.policy_version);
  schedule.set_generation(input.generation);
  if (resolved.reshard_after_forward_within_host() && host_group_size_ > 1) {
    schedule.set_post_forward_group_size(host_group_size_);
  }

  const int m =
      input.microbatches > 0 ? input.microbatches : resolved.microbatches();
  const bool sync_every =
      resolved.grad_sync() == hsdp::v1::GRAD_SYNC_MODE_EVERY_MICROBATCH;
  const bool all_reduce_every =
      resolved.all_reduce() == hsdp::v1::ALL_REDUCE_MODE_EVERY_MICROBATCH;
  for (int k = 0; k < m; ++k) {
    const bool last = k == m - 1;
    auto* mb = schedule.add_microbatches();
    mb->set_requires_grad_sync(last || sync_every);
    mb->set_requires_all_reduce(mb->requires_grad_sync() &&
                                (last || all_reduce_every));
    mb->set_is_last_backward(last);
  }

  const bool budget_mode = resolved.memory_budget_bytes() > 0;
  const RootPins root = ExplicitRootPins(resolved);
  for (int i = 0; i < n; ++i) {
    auto* unit = schedule.add_units();
    unit->set_unit_index(i);
    unit->set_unit_name(units_[i].name());
    if (i == 0) {
      unit->set_reshard_after_forward(root.after_forward.value_or(false));
      unit->set_reshard_after_backward(root.after_backward.value_or(false));
      continue;
    }
    const UnitReshard r = ResolveUnitReshard(resolved, units_[i].name());
    // Memory-budget mode starts from the least-memory plan.
    unit->set_reshard_after_forward(
        budget_mode && !r.forward_pinned ? true : r.after_forward);
    unit->set_reshard_after_backward(r.after_backward);
  }
  FillPrefetchLists(resolved.forward_prefetch_depth(),
                    resolved.backward_prefetch_depth(), &schedule);
  FillFusionGroups(units_, resolved.comm_fusion_bucket_bytes(), &schedule);

  const int interval = resolved.checkpoint_interval();
  schedule.set_checkpoint(input.checkpoint_requested ||
                          (interval > 0 && (input.step + 1) % interval == 0));
  return schedule;
}

void Planner::ChooseKeptUnits(const Policy& resolved, StepSchedule* schedule) {
  const int n = static_cast<int>(units_.size());
  std::vector<int> candidates;
  for (int i = 1; i < n; ++i) {
    if (!ResolveUnitReshard(resolved, units_[i].name()).forward_pinned) {
      candidates.push_back(i);
    }
  }
  // Every kept block saves exactly one all-gather (its backward re-gather), so
  // keeping as many as fit minimises all-gathers: take the smallest first.
  // Ties go to later blocks, which backward needs first.
  std::stable_sort(candidates.begin(), candidates.end(), [&](int a, int b) {
    const int64_t ba = units_[a].param_bytes(), bb = units_[b].param_bytes();
    return ba != bb ? ba < bb : a > b;
  });
  const int64_t budget = resolved.memory_budget_bytes();
  const int fwd = resolved.forward_prefetch_depth();
  const int bwd = resolved.backward_prefetch_depth();
  int64_t predicted = PredictedPeakBytes(*schedule);
  const bool over = predicted > budget;
  if (!over && BackwardLink(*schedule).declared()) {
    // Both ways, and the one that saves more time on the link (on a tie the
    // plan without links: the knapsack's weights, each block alone, are an
    // approximation of a peak that is not additive).
    StepSchedule by_time = *schedule;
    const int64_t by_time_peak = ChooseKeptUnitsByTime(
        candidates, budget, fwd, bwd, predicted, &by_time);
    predicted =
        KeepSmallestFirst(candidates, budget, fwd, bwd, predicted, schedule);
    if (by_time_peak <= budget &&
        Savings(by_time).seconds > Savings(*schedule).seconds) {
      *schedule = std::move(by_time);
      predicted = by_time_peak;
    }
  } else if (!over) {
    predicted =
        KeepSmallestFirst(candidates, budget, fwd, bwd, predicted, schedule);
  }
  FillPrefetchLists(fwd, bwd, schedule);
  schedule->set_predicted_peak_bytes(predicted);
  schedule->set_over_memory_budget(over);
  last_predicted_peak_ = predicted;
}

int64_t Planner::KeepSmallestFirst(const std::vector<int>& candidates,
                                   int64_t budget, int forward_depth,
                                   int backward_depth, int64_t predicted,
                                   StepSchedule* schedule) const {
  for (int i : candidates) {
    if (!schedule->units(i).reshard_after_forward()) continue;
    schedule->mutable_units(i)->set_reshard_after_forward(false);
    FillPrefetchLists(forward_depth, backward_depth, schedule);
    const int64_t with = PredictedPeakBytes(*schedule);
    if (with <= budget) {
      predicted = with;
    } else {
      schedule->mutable_units(i)->set_reshard_after_forward(true);
    }
  }
  FillPrefetchLists(forward_depth, backward_depth, schedule);
  return predicted;
}

int64_t Planner::GatheredBytes(int unit) const {
  const int64_t s = std::max(1, model_.options().shard_size);
  return units_[unit].param_bytes() * (s - 1) / s;
}

const LinkCost& Planner::BackwardLink(const StepSchedule& schedule) const {
  return schedule.post_forward_group_size() > 1 ? links_.intra_host : link();
}

int64_t Planner::BackwardGatheredBytes(const StepSchedule& schedule,
                                       int unit) const {
  const int64_t k = schedule.post_forward_group_size();
  if (k <= 1) return GatheredBytes(unit);
  return units_[unit].param_bytes() * (k - 1) / k;
}

AllGatherSavings Planner::Savings(const StepSchedule& schedule) const {
  AllGatherSavings savings;
  const int64_t m = std::max(1, schedule.microbatches_size());
  const LinkCost& backward = BackwardLink(schedule);
  // The root is kept by the root rule, not by a choice: blocks only.
  for (int i = 1; i < schedule.units_size() && i < num_units(); ++i) {
    if (schedule.units(i).reshard_after_forward()) continue;
    const int64_t bytes = BackwardGatheredBytes(schedule, i);
    savings.count += m;
    savings.bytes += m * bytes;
    savings.seconds += static_cast<double>(m) * backward.Seconds(bytes);
  }
  return savings;
}

int64_t Planner::ChooseKeptUnitsByTime(const std::vector<int>& candidates,
                                       int64_t budget, int forward_depth,
                                       int backward_depth, int64_t predicted,
                                       StepSchedule* schedule) const {
  const int64_t headroom = std::max<int64_t>(0, budget - predicted);
  if (candidates.empty()) return predicted;
  // Weight: what keeping the block alone adds to the model's peak; value:
  // the time of the backward all-gather it saves.
  const int64_t base = PredictPeak(*schedule).Total();
  // Blocks that add nothing to the peak take no slot.
  const int64_t slot =
      std::max<int64_t>(1, (headroom + kKnapsackSlots - 1) / kKnapsackSlots);
  const size_t n = candidates.size();
  std::vector<int> slots(n);
  std::vector<int64_t> weight(n);
  std::vector<double> value(n);
  for (size_t k = 0; k < n; ++k) {
    const int i = candidates[k];
    schedule->mutable_units(i)->set_reshard_after_forward(false);
    FillPrefetchLists(forward_depth, backward_depth, schedule);
    weight[k] = std::max<int64_t>(0, PredictPeak(*schedule).Total() - base);
    schedule->mutable_units(i)->set_reshard_after_forward(true);
    slots[k] = static_cast<int>(
        std::min<int64_t>(kKnapsackSlots + 1, (weight[k] + slot - 1) / slot));
    value[k] =
        BackwardLink(*schedule).Seconds(BackwardGatheredBytes(*schedule, i));
  }
  // 0/1 knapsack over the slots; ties keep the earlier (smaller) blocks.
  std::vector<double> best(kKnapsackSlots + 1, 0.0);
  std::vector<std::vector<bool>> take(n, std::vector<bool>(kKnapsackSlots + 1));
  for (size_t k = 0; k < n; ++k) {
    for (int c = kKnapsackSlots; c >= slots[k]; --c) {
      const double with = best[c - slots[k]] + value[k];
      if (with > best[c]) {
        best[c] = with;
        take[k][c] = true;
      }
    }
  }
  std::vector<size_t> chosen;
  for (size_t k = n, c = kKnapsackSlots; k-- > 0;) {
    if (take[k][c]) {
      chosen.push_back(k);
      c -= static_cast<size_t>(slots[k]);
    }
  }
  for (size_t k : chosen) {
    schedule->mutable_units(candidates[k])->set_reshard_after_forward(false);
  }
  FillPrefetchLists(forward_depth, backward_depth, schedule);
  int64_t with = PredictedPeakBytes(*schedule);
  // The weights were each block alone: should the whole set predict over
  // the budget, give up the blocks worth least per byte until it fits.
  while (with > budget && !chosen.empty()) {
    auto worst =
        std::min_element(chosen.begin(), chosen.end(), [&](size_t a, size_t b) {
          return value[a] *
                     static_cast<double>(std::max<int64_t>(1, weight[b])) <
                 value[b] *
                     static_cast<double>(std::max<int64_t>(1, weight[a]));
        });
    schedule->mutable_units(candidates[*worst])
        ->set_reshard_after_forward(true);
    chosen.erase(worst);
    FillPrefetchLists(forward_depth, backward_depth, schedule);
    with = PredictedPeakBytes(*schedule);
  }
  if (with > budget) return with;
  // Whatever the slots' rounding left: smallest first, as without links.
  return KeepSmallestFirst(candidates, budget, forward_depth, backward_depth,
                           with, schedule);
}

StepSchedule Planner::Plan(const Policy& policy, const PlanInput& input) {
  const Policy resolved = ResolvePolicyDefaults(policy);
  StepSchedule schedule = PlanManual(resolved, input);
  if (resolved.memory_budget_bytes() > 0) {
    ChooseKeptUnits(resolved, &schedule);
  }
  // Kept for the reports of this step; sealed steps are planned once. Bounded,
  // for workers that never report a peak.
  plans_[input.step] = schedule;
  while (plans_.size() > kMaxRememberedPlans) plans_.erase(plans_.begin());
  return schedule;
}

absl::Status Planner::CheckMemoryBudget(const Policy& policy) const {
  if (policy.memory_budget_bytes() <= 0) return absl::OkStatus();
  const Policy resolved = ResolvePolicyDefaults(policy);
  const StepSchedule least = PlanManual(resolved, PlanInput());
  const MemoryBreakdown raw = PredictPeak(least);
  const int64_t predicted = PredictedPeakBytes(least);
  if (resolved.memory_budget_bytes() >= predicted) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrFormat(
      "policy.memory_budget_bytes: %d bytes (%.2f MiB) is below the least "
      "peak this model reaches on this mesh: %d bytes (%.2f MiB) predicted "
      "with every unit resharded after forward (%s; measured correction "
      "%+.2f MiB); raise the budget or leave memory-budget mode",
      resolved.memory_budget_bytes(), resolved.memory_budget_bytes() / kMiB,
      predicted, predicted / kMiB, raw.ToString(), correction_ / kMiB));
}

void Planner::ObservePeakMemory(int64_t step, int64_t peak_bytes,
                                int64_t activation_bytes) {
  auto plan = plans_.find(step);
  if (plan == plans_.end() || peak_bytes <= 0) return;
  if (observed_.size() >= kCorrectionWindowSteps &&
      step < observed_.begin()->first) {
    return;  // older than the window
  }
  Observation& o = observed_[step];
  if (peak_bytes <= o.peak_bytes && activation_bytes <= o.activation_bytes) {
    return;  // another rank's report that changes nothing
  }
  o.peak_bytes = std::max(o.peak_bytes, peak_bytes);
  o.activation_bytes = std::max(o.activation_bytes, activation_bytes);
  // The plan's own measurement, the most trusted prediction of it.
  MeasuredPlan& measured = measured_plans_[PlanKey(plan->second)];
  measured.peak_bytes = std::max(measured.peak_bytes, o.peak_bytes);
  measured.last_step = std::max(measured.last_step, step);
  while (measured_plans_.size() > kMaxMeasuredPlans) {
    auto oldest =
        std::min_element(measured_plans_.begin(), measured_plans_.end(),
                         [](const auto& a, const auto& b) {
                           return a.second.last_step < b.second.last_step;
                         });
    measured_plans_.erase(oldest);
  }
  o.correction = o.peak_bytes -
                 model_.PredictPeak(plan->second, o.activation_bytes).Total();
  while (observed_.size() > kCorrectionWindowSteps) {
    observed_.erase(observed_.begin());
  }
  correction_ = observed_.begin()->second.correction;
  for (const auto& [s, obs] : observed_) {
    correction_ = std::max(correction_, obs.correction);
  }
  // The latest step's activations (reports without any keep the estimate).
  for (auto it = observed_.rbegin(); it != observed_.rend(); ++it) {
    if (it->second.activation_bytes > 0) {
      activation_bytes_ = it->second.activation_bytes;
      break;
    }
  }
  // Plans older than the window can no longer be reported usefully.
  plans_.erase(plans_.begin(), plans_.lower_bound(observed_.begin()->first));
}

}  // namespace hsdp::coordinator
