#include "common/memory_model.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_format.h"
#include "hsdp/mesh.h"

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

// Comm fusion (worker/fsdp/unit_group.h): for each unit, the units whose
// all-gathers and whose reduce-scatters go out with its own (itself
// included; just itself when alone). Members with nothing to gather go alone;
// with one shard nothing fuses; the reduce-scatters fuse where the engine
// fuses them (the segments path, or at most two shards).
struct FusionSets {
  std::vector<std::vector<int>> gather;
  std::vector<std::vector<int>> reduce;
};

FusionSets FusionSetsOf(const hsdp::v1::StepSchedule& schedule,
                        const std::vector<int64_t>& unit_bytes,
                        const MemoryModel::Options& options) {
  const int n = static_cast<int>(unit_bytes.size());
  FusionSets sets;
  for (int i = 0; i < n; ++i) {
    sets.gather.push_back({i});
    sets.reduce.push_back({i});
  }
  if (options.shard_size == 1) return sets;
  const bool fused_reduce_scatter =
      options.comm_path == CommPath::kSegments || options.shard_size <= 2;
  for (const hsdp::v1::FusionGroup& g : schedule.fusion_groups()) {
    std::vector<int> members;
    for (int i : g.units()) {
      if (i >= 0 && i < n && unit_bytes[i] > 0) members.push_back(i);
    }
    if (members.size() < 2) continue;
    for (int i : members) {
      sets.gather[i] = members;
      if (fused_reduce_scatter) sets.reduce[i] = members;
    }
  }
  return sets;
}

// The state of one rank while the model walks a step (see the header), with
// running sums so every sample is O(1).
class StepWalk {
 public:
  StepWalk(const std::vector<int64_t>& unit_bytes, FusionSets fusion,
           MemoryBreakdown steady, const MemoryModel::Options& options,
           int host_group_size)
      : bytes_(unit_bytes),
        fusion_(std::move(fusion)),
        steady_(steady),
        options_(options),
        unsharded_(unit_bytes.size(), false),
        grads_(unit_bytes.size(), false),
        forwarded_(unit_bytes.size(), false),
        done_(unit_bytes.size(), false),
        host_shard_(unit_bytes.size(), false),
        host_group_size_(host_group_size > 1 &&
                                 options.shard_size % host_group_size == 0
                             ? host_group_size
                             : 0),
        peak_(steady) {
    for (size_t i = 0; i < bytes_.size(); ++i) {
      largest_ = std::max(largest_, SetBytes(fusion_.gather[i]));
      largest_ = std::max(largest_, SetBytes(fusion_.reduce[i]));
    }
  }

  void SetUnsharded(int unit, bool alive) {
    // With one shard a unit's parameters are its shards: nothing to gather.
    if (options_.shard_size == 1 || unsharded_[unit] == alive) return;
    unsharded_[unit] = alive;
    unsharded_sum_ += alive ? bytes_[unit] : -bytes_[unit];
  }
  bool unsharded(int unit) const {
    return options_.shard_size == 1 || unsharded_[unit];
  }
  // Hierarchical reshard: a unit resharded after forward keeps its host
  // shard (its padded shard times shard_size / host_group_size) until it is
  // gathered again.
  void ReshardAfterForward(int unit) {
    SetUnsharded(unit, false);
    if (host_group_size_ > 0 && bytes_[unit] > 0) SetHostShard(unit, true);
  }
  void SetHostShard(int unit, bool alive) {
    if (host_shard_[unit] == alive) return;
    host_shard_[unit] = alive;
    const int64_t bytes = ShardedBytes(bytes_[unit], options_.shard_size) *
                          (options_.shard_size / host_group_size_);
    unsharded_sum_ += alive ? bytes : -bytes;
  }
  // The engine's Unshard: a sharded unit is gathered with the members of its
  // fusion group the pass still needs (in forward: not entered yet; in
  // backward: its backward not finished); one that kept a host shard is
  // gathered alone, over its host group.
  void Gather(int unit, bool backward) {
    if (unsharded(unit)) return;
    if (host_shard_[unit]) {
      SetHostShard(unit, false);
      SetUnsharded(unit, true);
      return;
    }
    for (int m : fusion_.gather[unit]) {
      if (m == unit ||
          (backward ? forwarded_[m] && !done_[m] : !forwarded_[m])) {
        SetHostShard(m, false);
        SetUnsharded(m, true);
      }
    }
  }
  void MarkForwarded(int unit) { forwarded_[unit] = true; }
  // A new microbatch: no unit forwarded or done yet.
  void StartPass() {
    std::fill(forwarded_.begin(), forwarded_.end(), false);
    std::fill(done_.begin(), done_.end(), false);
  }
  void SetGrads(int unit, bool alive) {
    if (grads_[unit] == alive) return;
    grads_[unit] = alive;
    grads_sum_ += alive ? bytes_[unit] : -bytes_[unit];
  }
  // The unit's backward is over; in a syncing microbatch its reduction goes
  // out with its fusion group's, once the group's last member is done.
  // Returns whether a reduction was issued.
  bool FinishBackward(int unit, bool sync) {
    done_[unit] = true;
    if (!sync) return false;
    const std::vector<int>& members = fusion_.reduce[unit];
    for (int m : members) {
      if (forwarded_[m] && !done_[m]) return false;
    }
    reducing_ = members;
    // The flat path copies the gradients into its buffer and drops them; the
    // segments path sends them from where they are until the collective ends.
    if (options_.comm_path == CommPath::kFlat) {
      for (int m : members) SetGrads(m, false);
    }
    return true;
  }
  void FinishReduction() {
    for (int m : reducing_) SetGrads(m, false);
    reducing_.clear();
  }
  void AddActivations(int64_t bytes) { activations_ += bytes; }
  void ClearActivations() { activations_ = 0; }
  void ClearUnsharded() {
    for (int i = 0; i < static_cast<int>(bytes_.size()); ++i) {
      SetUnsharded(i, false);
      SetHostShard(i, false);
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
  int64_t SetBytes(const std::vector<int>& units) const {
    int64_t sum = 0;
    for (int m : units) sum += bytes_[m];
    return sum;
  }

  int64_t CommBytes() const {
    const int s = options_.shard_size;
    if (s == 1 && options_.replicate_size == 1) return 0;  // nothing to move
    if (options_.comm_path == CommPath::kFlat) {
      // One unit's or group's buffer kept idle for reuse, or the one in use.
      return std::max(largest_, SetBytes(reducing_));
    }
    int64_t bytes = 0;
    for (int m : reducing_) {
      const int64_t chunk = ShardedBytes(bytes_[m], s);
      bytes += chunk * (s - 1) + (options_.replicate_size > 1 ? chunk : 0);
    }
    return bytes;
  }

  const std::vector<int64_t>& bytes_;
  const FusionSets fusion_;
  const MemoryBreakdown steady_;
  const MemoryModel::Options options_;
  std::vector<bool> unsharded_;
  std::vector<bool> grads_;
  std::vector<bool> forwarded_;
  std::vector<bool> done_;
  std::vector<bool> host_shard_;
  const int host_group_size_;
  int64_t largest_ = 0;
  int64_t unsharded_sum_ = 0;
  int64_t grads_sum_ = 0;
  int64_t activations_ = 0;
  std::vector<int> reducing_;
  MemoryBreakdown peak_;
};

}  // namespace

int64_t GatheredBytes(const hsdp::v1::UnitInfo& unit) {
  return unit.param_bytes() -
         std::clamp<int64_t>(unit.replicated_bytes(), 0, unit.param_bytes());
}

MemoryModel::MemoryModel(const UnitList& units, Options options)
    : options_(options) {
  options_.shard_size = std::max(1, options_.shard_size);
  options_.replicate_size = std::max(1, options_.replicate_size);
  for (const hsdp::v1::UnitInfo& u : units) {
    // Replicated parameters are held whole and never gathered: steady bytes,
    // not transient ones.
    const int64_t gathered = GatheredBytes(u);
    unit_bytes_.push_back(gathered);
    sharded_bytes_.push_back(ShardedBytes(gathered, options_.shard_size) +
                             u.param_bytes() - gathered);
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

  StepWalk walk(unit_bytes_, FusionSetsOf(schedule, unit_bytes_, options_),
                Steady(), options_, schedule.post_forward_group_size());
  const std::vector<hsdp::v1::MicrobatchSchedule> microbatches =
      MicrobatchesOf(schedule);
  for (size_t k = 0; k < microbatches.size(); ++k) {
    const hsdp::v1::MicrobatchSchedule& mb = microbatches[k];
    // A step starts with every unit sharded (the optimizer changed the
    // shards); later microbatches start with what the previous one kept.
    if (k == 0) walk.ClearUnsharded();
    walk.StartPass();
    // Forward: the root is entered first and left last.
    for (int i = 0; i < n; ++i) {
      walk.Gather(i, /*backward=*/false);
      for (int j : units[i].forward_prefetch) walk.Gather(j, false);
      walk.MarkForwarded(i);
      walk.Sample();
      if (i == 0) continue;
      walk.AddActivations(activations[i]);
      if (units[i].reshard_after_forward) walk.ReshardAfterForward(i);
    }
    walk.AddActivations(activations[0]);
    walk.Sample();
    if (units[0].reshard_after_forward) walk.ReshardAfterForward(0);
    // Backward: the root's pre-backward first, then the blocks in reverse.
    for (int pos = 0; pos < n; ++pos) {
      const int i = pos == 0 ? 0 : n - pos;
      // A unit that must be gathered now waits for the reduction in flight
      // first (the engine's PreBackward).
      if (!walk.unsharded(i)) walk.FinishReduction();
      walk.Gather(i, /*backward=*/true);
      for (int j : units[i].backward_prefetch) walk.Gather(j, true);
      walk.SetGrads(i, true);
      walk.Sample();
      if (i == 0) continue;  // the root's post-backward ends the backward
      walk.FinishReduction();
      walk.AddActivations(-activations[i]);
      if (units[i].reshard_after_backward || mb.is_last_backward()) {
        walk.SetUnsharded(i, false);
      }
      if (walk.FinishBackward(i, mb.requires_grad_sync())) walk.Sample();
    }
    walk.FinishReduction();
    walk.ClearActivations();
    if (units[0].reshard_after_backward || mb.is_last_backward()) {
      walk.SetUnsharded(0, false);
    }
    if (walk.FinishBackward(0, mb.requires_grad_sync())) {
      walk.Sample();
      walk.FinishReduction();
    }
  }
  return walk.peak();
}

}  // namespace hsdp
