#include "common/memory_model.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_format.h"
#include "common/mesh.h"

namespace hsdp {
namespace {

// A schedule's per-unit fields, with the engine's defaults for a schedule
// without units.
struct UnitFields {
  bool reshard_after_forward = true;
  bool reshard_after_backward = true;
  std::vector<int> forward_prefetch;
  std::vector<int> backward_prefetch;
};

std::vector<UnitFields> FieldsOf(const hsdp::v1::StepSchedule& schedule,
                                 int n) {
  std::vector<UnitFields> fields(static_cast<size_t>(n));
  for (int i = 0; i < n && i < schedule.units_size(); ++i) {
    const hsdp::v1::UnitSchedule& u = schedule.units(i);
    fields[i].reshard_after_forward = u.reshard_after_forward();
    fields[i].reshard_after_backward = u.reshard_after_backward();
    for (int j : u.forward_prefetch()) {
      if (j >= 0 && j < n) fields[i].forward_prefetch.push_back(j);
    }
    for (int j : u.backward_prefetch()) {
      if (j >= 0 && j < n) fields[i].backward_prefetch.push_back(j);
    }
  }
  return fields;
}

std::vector<hsdp::v1::MicrobatchSchedule> MicrobatchesOf(
    const hsdp::v1::StepSchedule& schedule) {
  std::vector<hsdp::v1::MicrobatchSchedule> out(schedule.microbatches().begin(),
                                                schedule.microbatches().end());
  if (out.empty()) {
    hsdp::v1::MicrobatchSchedule one;
    one.set_requires_grad_sync(true);
    one.set_requires_all_reduce(true);
    one.set_is_last_backward(true);
    out.push_back(one);
  }
  return out;
}

// The state of one rank while the model walks a step (see the header), with
// running sums so every sample is O(1).
class StepWalk {
 public:
  StepWalk(const std::vector<int64_t>& unit_bytes, MemoryBreakdown steady,
           const MemoryModel::Options& options)
      : bytes_(unit_bytes),
        steady_(steady),
        options_(options),
        unsharded_(unit_bytes.size(), false),
        grads_(unit_bytes.size(), false),
        largest_(unit_bytes.empty()
                     ? 0
                     : *std::max_element(unit_bytes.begin(), unit_bytes.end())),
        peak_(steady) {}

  void SetUnsharded(int unit, bool alive) {
    // With one shard a unit's parameters are its shards: nothing to gather.
    if (options_.shard_size == 1 || unsharded_[unit] == alive) return;
    unsharded_[unit] = alive;
    unsharded_sum_ += alive ? bytes_[unit] : -bytes_[unit];
  }
  bool unsharded(int unit) const {
    return options_.shard_size == 1 || unsharded_[unit];
  }
  void SetGrads(int unit, bool alive) {
    if (grads_[unit] == alive) return;
    grads_[unit] = alive;
    grads_sum_ += alive ? bytes_[unit] : -bytes_[unit];
  }
  void IssueReduction(int unit) {
    reducing_ = unit;
    // The flat path copies the gradients into its buffer and drops them; the
    // segments path sends them from where they are until the collective ends.
    if (options_.comm_path == CommPath::kFlat) SetGrads(unit, false);
  }
  void FinishReduction() {
    if (reducing_ < 0) return;
    SetGrads(reducing_, false);
    reducing_ = -1;
  }
  void AddActivations(int64_t bytes) { activations_ += bytes; }
  void ClearActivations() { activations_ = 0; }
  void ClearUnsharded() {
    for (int i = 0; i < static_cast<int>(bytes_.size()); ++i) {
      SetUnsharded(i, false);
    }
  }

  void Sample() {
    MemoryBreakdown now = steady_;
    now.unsharded_params = unsharded_sum_;
    now.unsharded_grads = grads_sum_;
    now.comm_buffers = CommBytes();
    now.activations = activations_;
    if (now.Total() > peak_.Total()) peak_ = now;
  }
  const MemoryBreakdown& peak() const { return peak_; }

 private:
  int64_t CommBytes() const {
    const int s = options_.shard_size;
    if (s == 1 && options_.replicate_size == 1) return 0;  // nothing to move
    if (options_.comm_path == CommPath::kFlat) {
      // One unit's buffer kept idle for reuse, or the one in use.
      return std::max(largest_, reducing_ >= 0 ? bytes_[reducing_] : 0);
    }
    if (reducing_ < 0) return 0;
    const int64_t unit = bytes_[reducing_];
    const int64_t chunk = ShardedBytes(unit, s);
    return chunk * (s - 1) + (options_.replicate_size > 1 ? chunk : 0);
  }

  const std::vector<int64_t>& bytes_;
  const MemoryBreakdown steady_;
  const MemoryModel::Options options_;
  std::vector<bool> unsharded_;
  std::vector<bool> grads_;
  const int64_t largest_;
  int64_t unsharded_sum_ = 0;
  int64_t grads_sum_ = 0;
  int64_t activations_ = 0;
  int reducing_ = -1;
  MemoryBreakdown peak_;
};

}  // namespace

MemoryModel::MemoryModel(const UnitList& units, Options options)
    : options_(options) {
  options_.shard_size = std::max(1, options_.shard_size);
  options_.replicate_size = std::max(1, options_.replicate_size);
  for (const hsdp::v1::UnitInfo& u : units) {
    // Replicated parameters are held whole and never gathered: steady bytes,
    // not transient ones.
    const int64_t replicated =
        std::clamp<int64_t>(u.replicated_bytes(), 0, u.param_bytes());
    const int64_t gathered = u.param_bytes() - replicated;
    unit_bytes_.push_back(gathered);
    sharded_bytes_.push_back(ShardedBytes(gathered, options_.shard_size) +
                             replicated);
  }
}

MemoryBreakdown MemoryModel::Steady() const {
  MemoryBreakdown b;
  for (int64_t s : sharded_bytes_) b.shards += s;
  b.optimizer_state = b.shards * options_.optimizer_state_copies;
  b.sharded_grads = b.shards;
  return b;
}

MemoryBreakdown MemoryModel::PredictPeak(const hsdp::v1::StepSchedule& schedule,
                                         int64_t activation_bytes) const {
  const int n = num_units();
  if (n == 0) return Steady();
  const std::vector<UnitFields> units = FieldsOf(schedule, n);
  // Activations split evenly over the units; the root's share (embedding,
  // head, loss) is completed at the end of forward.
  std::vector<int64_t> activations(static_cast<size_t>(n),
                                   activation_bytes / n);
  activations[0] = activation_bytes - activation_bytes / n * (n - 1);

  StepWalk walk(unit_bytes_, Steady(), options_);
  const std::vector<hsdp::v1::MicrobatchSchedule> microbatches =
      MicrobatchesOf(schedule);
  for (size_t k = 0; k < microbatches.size(); ++k) {
    const hsdp::v1::MicrobatchSchedule& mb = microbatches[k];
    // A step starts with every unit sharded (the optimizer changed the
    // shards); later microbatches start with what the previous one kept.
    if (k == 0) walk.ClearUnsharded();
    // Forward: the root is entered first and left last.
    for (int i = 0; i < n; ++i) {
      walk.SetUnsharded(i, true);
      for (int j : units[i].forward_prefetch) walk.SetUnsharded(j, true);
      walk.Sample();
      if (i == 0) continue;
      walk.AddActivations(activations[i]);
      if (units[i].reshard_after_forward) walk.SetUnsharded(i, false);
    }
    walk.AddActivations(activations[0]);
    walk.Sample();
    if (units[0].reshard_after_forward) walk.SetUnsharded(0, false);
    // Backward: the root's pre-backward first, then the blocks in reverse.
    for (int pos = 0; pos < n; ++pos) {
      const int i = pos == 0 ? 0 : n - pos;
      // A unit that must be gathered now waits for the reduction in flight
      // first (the engine's PreBackward).
      if (!walk.unsharded(i)) walk.FinishReduction();
      walk.SetUnsharded(i, true);
      for (int j : units[i].backward_prefetch) walk.SetUnsharded(j, true);
      walk.SetGrads(i, true);
      walk.Sample();
      if (i == 0) continue;  // the root's post-backward ends the backward
      walk.FinishReduction();
      walk.AddActivations(-activations[i]);
      if (units[i].reshard_after_backward || mb.is_last_backward()) {
        walk.SetUnsharded(i, false);
      }
      if (mb.requires_grad_sync()) {
        walk.IssueReduction(i);
        walk.Sample();
      }
    }
    walk.FinishReduction();
    walk.ClearActivations();
    if (units[0].reshard_after_backward || mb.is_last_backward()) {
      walk.SetUnsharded(0, false);
    }
    if (mb.requires_grad_sync()) {
      walk.IssueReduction(0);
      walk.Sample();
      walk.FinishReduction();
    }
  }
  return walk.peak();
}

}  // namespace hsdp
