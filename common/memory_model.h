// The memory model of one rank during one training step: the bytes it holds,
// by category, and the peak a StepSchedule leads to. One model for both sides:
// the planner predicts the peak of candidate schedules with it (memory-budget
// mode), and the worker's engine fills the same categories from what it
// actually holds (fsdp::EngineStats::peak_memory), so a prediction and an
// accounting can be compared term by term.
//
// What the model walks (the engine's order of events, worker/fsdp):
// - steady, all step long: parameter shards, optimizer state (a multiple of
//   the shards) and the sharded (reduced) gradients;
// - forward, unit by unit in forward order (root first): a unit is unsharded
//   when entered, together with its forward_prefetch; it is resharded after
//   its forward when reshard_after_forward (the root's post-forward is the end
//   of forward: it stays unsharded through the whole forward);
// - backward, in backward order (the root first, then the blocks in reverse):
//   a unit is unsharded again with its backward_prefetch, its unsharded
//   gradients appear; after its backward it reshards when
//   reshard_after_backward or on the last microbatch, and reduce-scatters its
//   gradients when the microbatch syncs (at most one reduction in flight; a
//   no-sync microbatch keeps every unit's unsharded gradients to the next);
//   the root's gradients (its head part is computed first) live until the end
//   of backward;
// - comm fusion (StepSchedule.fusion_groups): a unit gathered in forward is
//   gathered with the members of its group not entered yet, in backward with
//   those whose backward is not over; a syncing microbatch reduces a group
//   once its last member's backward is over, the members' unsharded
//   gradients alive until then (reduce-scatters fuse on the segments path,
//   or with at most two shards, as in the engine);
// - hierarchical reshard (StepSchedule.post_forward_group_size = k > 1): a
//   unit resharded after forward keeps S/k of its padded shards (counted
//   with the unsharded parameters) until it is gathered again, alone;
// - communication buffers: the segments path (CPU transports) receives
//   straight into the unsharded parameters and needs scratch for the peers'
//   contributions to one reduce-scatter ((S-1)/S of the unit or group, plus
//   the reduced chunks in HSDP); the flat path (NCCL) stages each collective
//   in a buffer of the unit's or group's size and keeps one largest buffer
//   for reuse;
// - activations: `activation_bytes` at the end of one microbatch's forward
//   (measured by the worker and reported; fsdp::EngineStats::activation_bytes)
//   split evenly over the units, built up in forward and released in backward.
// The peak is the largest total at any of these moments.
//
// Everything is in bytes per rank; unsharded bytes are in the parameters'
// storage dtype (mixed precision's smaller compute copies are not modelled).
// Stateless and thread-compatible.
#ifndef HSDP_COMMON_MEMORY_MODEL_H_
#define HSDP_COMMON_MEMORY_MODEL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "common/units.h"
#include "hsdp/memory_breakdown.h"
#include "hsdp/v1/schedule.pb.h"

namespace hsdp {

// AdamW keeps two moments (exp_avg, exp_avg_sq) per parameter element.
inline constexpr int kAdamWStateCopies = 2;

// The bytes of a unit the all-gathers move: its parameters less the
// replicated ones (held whole on every rank, never gathered).
int64_t GatheredBytes(const hsdp::v1::UnitInfo& unit);

// How a backend moves a unit's bytes (see worker/fsdp/unit_group.h).
enum class CommPath {
  // Gloo TCP and shared memory: pieces land in the tensors themselves.
  kSegments,
  // NCCL: one flat staging buffer per collective.
  kFlat,
};

class MemoryModel {
 public:
  struct Options {
    // The mesh: ranks a unit is sharded over, and replicas (HSDP).
    int shard_size = 1;
    int replicate_size = 1;
    int optimizer_state_copies = kAdamWStateCopies;
    CommPath comm_path = CommPath::kSegments;
  };

  // `units` as workers report them: index 0 is the root; param_bytes are the
  // unsharded bytes, replicated_bytes of them held whole on every rank.
  MemoryModel(const UnitList& units, Options options);

  // Shards, optimizer state and sharded gradients: held all step long.
  MemoryBreakdown Steady() const;

  // The breakdown at the predicted peak of a step run by `schedule` (whose
  // units must be this model's, in order; an empty unit list means the
  // engine's defaults: reshard after forward, no prefetch; no microbatches
  // means one synchronising microbatch), with `activation_bytes` of
  // activations per microbatch.
  MemoryBreakdown PredictPeak(const hsdp::v1::StepSchedule& schedule,
                              int64_t activation_bytes) const;

  int num_units() const { return static_cast<int>(unit_bytes_.size()); }
  const Options& options() const { return options_; }

 private:
  std::vector<int64_t> unit_bytes_;     // unsharded
  std::vector<int64_t> sharded_bytes_;  // per rank, padded
  Options options_;
};

}  // namespace hsdp

#endif  // HSDP_COMMON_MEMORY_MODEL_H_
