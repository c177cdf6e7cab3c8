#include "coordinator/planner.h"

#include <algorithm>
#include <numeric>

#include "common/mesh.h"
#include "common/policy.h"

namespace hsdp::coordinator {
namespace {

using hsdp::v1::Policy;
using hsdp::v1::StepSchedule;

}  // namespace

Planner::Planner(UnitList units, int shard_size)
    : units_(std::move(units)), shard_size_(std::max(1, shard_size)) {}

int64_t Planner::PredictPeakBytes(const UnitList& units, int shard_size,
                                  const std::vector<bool>& kept_unsharded,
                                  int forward_prefetch_depth,
                                  int backward_prefetch_depth) {
  const int n = static_cast<int>(units.size());
  auto bytes = [&](int i) { return units[i].param_bytes(); };
  auto kept = [&](int i) {
    return i < static_cast<int>(kept_unsharded.size()) && kept_unsharded[i];
  };
  int64_t total = 0;
  for (int i = 0; i < n; ++i) {
    total += ShardedBytes(bytes(i), shard_size) * kShardedStateCopies;
    if (kept(i)) total += bytes(i);
  }
  int64_t window = 0;
  for (int i = 0; i < n; ++i) {
    int64_t forward = 0;
    for (int j = i; j < n && j <= i + forward_prefetch_depth; ++j) {
      if (!kept(j)) forward += bytes(j);
    }
    int64_t backward = bytes(i);  // the unit's unsharded gradient
    for (int j = i; j >= 0 && j >= i - backward_prefetch_depth; --j) {
      if (!kept(j)) backward += bytes(j);
    }
    window = std::max({window, forward, backward});
  }
  return total + window;
}

std::vector<bool> Planner::ChooseReshardAfterForward(const Policy& resolved,
                                                     int64_t step) {
  const int n = static_cast<int>(units_.size());
  std::vector<bool> reshard(n, true);
  std::vector<bool> kept(n, false);
  std::vector<int> candidates;
  for (int i = 0; i < n; ++i) {
    const UnitReshard r = ResolveUnitReshard(resolved, units_[i].name());
    if (r.forward_pinned) {
      // An explicit override wins over the automatic choice.
      reshard[i] = r.after_forward;
      kept[i] = !r.after_forward;
    } else {
      candidates.push_back(i);
    }
  }
  // Every kept unit saves exactly one all-gather (the backward re-gather), so
  // keeping as many units as fit minimises all-gathers: take the smallest
  // first. Ties go to later units, which backward needs first.
  std::stable_sort(candidates.begin(), candidates.end(), [&](int a, int b) {
    const int64_t ba = units_[a].param_bytes(), bb = units_[b].param_bytes();
    return ba != bb ? ba < bb : a > b;
  });
  const int64_t budget = resolved.memory_budget_bytes();
  auto predict = [&]() {
    const int64_t raw = PredictPeakBytes(units_, shard_size_, kept,
                                         resolved.forward_prefetch_depth(),
                                         resolved.backward_prefetch_depth());
    return raw;
  };
  int64_t raw = predict();
  for (int i : candidates) {
    kept[i] = true;
    const int64_t with = predict();
    if (static_cast<double>(with) * correction_ <=
        static_cast<double>(budget)) {
      reshard[i] = false;
      raw = with;
    } else {
      kept[i] = false;
    }
  }
  raw_predictions_[step] = raw;
  last_predicted_peak_ =
      static_cast<int64_t>(static_cast<double>(raw) * correction_);
  return reshard;
}

StepSchedule Planner::Plan(const Policy& policy, const PlanInput& input) {
  const Policy resolved = ResolvePolicyDefaults(policy);
  const int n = static_cast<int>(units_.size());
  StepSchedule schedule;
  schedule.set_step(input.step);
  schedule.set_policy_version(input.policy_version);
  schedule.set_generation(input.generation);

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

  std::vector<bool> auto_reshard;
  if (resolved.memory_budget_bytes() > 0) {
    auto_reshard = ChooseReshardAfterForward(resolved, input.step);
  }
  const int fwd = resolved.forward_prefetch_depth();
  const int bwd = resolved.backward_prefetch_depth();
  for (int i = 0; i < n; ++i) {
    const UnitReshard r = ResolveUnitReshard(resolved, units_[i].name());
    auto* unit = schedule.add_units();
    unit->set_unit_index(i);
    unit->set_unit_name(units_[i].name());
    unit->set_reshard_after_forward(auto_reshard.empty() ? r.after_forward
                                                         : auto_reshard[i]);
    unit->set_reshard_after_backward(r.after_backward);
    for (int j = i + 1; j < n && j <= i + fwd; ++j)
      unit->add_forward_prefetch(j);
    for (int j = i - 1; j >= 0 && j >= i - bwd; --j)
      unit->add_backward_prefetch(j);
  }

  const int interval = resolved.checkpoint_interval();
  schedule.set_checkpoint(input.checkpoint_requested ||
                          (interval > 0 && (input.step + 1) % interval == 0));
  return schedule;
}

void Planner::ObservePeakMemory(int64_t step, int64_t peak_bytes) {
  auto it = raw_predictions_.find(step);
  if (it == raw_predictions_.end() || it->second <= 0 || peak_bytes <= 0)
    return;
  int64_t& observed = observed_peaks_[step];
  observed = std::max(observed, peak_bytes);
  // The latest reported step defines the factor: reports for older steps only
  // count while no newer step has been reported.
  if (step < observed_peaks_.rbegin()->first) return;
  const double ratio =
      static_cast<double>(observed) / static_cast<double>(it->second);
  correction_ = std::clamp(ratio, kMinMemoryCorrection, kMaxMemoryCorrection);
  // Keep the maps small: nothing before this step matters any more.
  raw_predictions_.erase(raw_predictions_.begin(),
                         raw_predictions_.lower_bound(step));
  observed_peaks_.erase(observed_peaks_.begin(),
                        observed_peaks_.lower_bound(step));
}

}  // namespace hsdp::coordinator
