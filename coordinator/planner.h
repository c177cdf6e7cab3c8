// The planner: Policy + unit list (+ reported peak memory) -> StepSchedule for
// one step.
//
// Manual mode (memory_budget_bytes == 0) is exact and stateless:
// - per unit reshard_after_forward/backward = the policy defaults, then every
//   override whose glob matches the unit name, in order (later ones win);
// - forward_prefetch(i) = [i+1, ..., i+d_fwd], clipped to the unit count;
// - backward_prefetch(i) = [i-1, ..., i-d_bwd], clipped at 0 (backward runs
//   the units in reverse, so these are the units that run next);
// - microbatch k of m: requires_grad_sync = last || grad_sync is
//   EVERY_MICROBATCH; requires_all_reduce = requires_grad_sync && (last ||
//   all_reduce is EVERY_MICROBATCH); is_last_backward = last. The flags do not
//   depend on the mesh: with one replica the engine's all-reduce is a no-op.
// - checkpoint = (checkpoint_interval > 0 &&
//   (step + 1) % checkpoint_interval == 0) || a checkpoint was requested.
//
// Memory-budget mode (memory_budget_bytes > 0) plans like manual mode, except
// that it picks reshard_after_forward for every unit no override pins
// explicitly; see PredictPeakBytes for the memory model and
// ChooseReshardAfterForward for the choice.
#ifndef HSDP_COORDINATOR_PLANNER_H_
#define HSDP_COORDINATOR_PLANNER_H_

#include <cstdint>
#include <map>
#include <vector>

#include "common/units.h"
#include "hsdp/v1/policy.pb.h"
#include "hsdp/v1/schedule.pb.h"

namespace hsdp::coordinator {

// Bytes per parameter byte that stay resident sharded: parameter, gradient and
// the two AdamW moments (all in the parameter dtype).
inline constexpr int kShardedStateCopies = 4;
// The correction factor from reported peaks is clamped to this range, so one
// absurd report cannot make the planner keep everything or nothing.
inline constexpr double kMinMemoryCorrection = 0.25;
inline constexpr double kMaxMemoryCorrection = 8.0;

// What, besides the policy, a step's schedule depends on.
struct PlanInput {
  int64_t step = 0;
  int64_t policy_version = 0;
  int64_t generation = 0;
  // RequestCheckpoint asked for a checkpoint after this step.
  bool checkpoint_requested = false;
  // Microbatches per rank when > 0 (the schedule log's batch-mode arithmetic
  // for the generation's world); 0: the policy's.
  int microbatches = 0;
};

// Thread-compatible: the schedule log calls it under its own lock.
class Planner {
 public:
  // `shard_size` is the mesh's S (ranks a unit's parameters are sharded
  // across).
  Planner(UnitList units, int shard_size);
  Planner(const Planner&) = delete;
  Planner& operator=(const Planner&) = delete;

  // The schedule for `input.step` under `policy` (validated by ValidatePolicy;
  // defaults are resolved here). In memory-budget mode also records the raw
  // prediction for the step so a later ObservePeakMemory(step, ...) can correct
  // the model.
  hsdp::v1::StepSchedule Plan(const hsdp::v1::Policy& policy,
                              const PlanInput& input);

  // Feeds back a rank's measured peak for a step planned here. The correction
  // factor becomes max-over-ranks(observed) / raw_prediction for the latest
  // reported step (clamped), and applies to steps planned from now on (sealed
  // steps never change). Reports for steps without a recorded prediction
  // (manual mode) are ignored.
  void ObservePeakMemory(int64_t step, int64_t peak_bytes);

  // observed / predicted ratio currently applied (1.0 until the first useful
  // report).
  double memory_correction() const { return correction_; }
  // Corrected predicted peak of the last step planned in memory-budget mode (0
  // if none).
  int64_t last_predicted_peak_bytes() const { return last_predicted_peak_; }

  // The raw memory model (bytes per rank), before correction, is the sum of
  // - sharded state: sum_i ceil(bytes_i / S) * kShardedStateCopies (params,
  //   grads, AdamW m and v);
  // - kept units: sum of bytes_i over units kept unsharded after forward (all
  //   live at once at the forward/backward boundary);
  // - the unsharded working window, max over units i of
  //   forward:  bytes of the units in [i, i + d_fwd] that are not kept;
  //   backward: bytes of the units in [i - d_bwd, i] that are not kept, plus
  //             bytes_i (the unit's unsharded gradient).
  // Activations are not modelled; the correction factor from reported peaks
  // absorbs them.
  static int64_t PredictPeakBytes(const UnitList& units, int shard_size,
                                  const std::vector<bool>& kept_unsharded,
                                  int forward_prefetch_depth,
                                  int backward_prefetch_depth);

  const UnitList& units() const { return units_; }

 private:
  // Memory-budget mode: returns reshard_after_forward per unit.
  std::vector<bool> ChooseReshardAfterForward(const hsdp::v1::Policy& resolved,
                                              int64_t step);

  const UnitList units_;
  const int shard_size_;
  double correction_ = 1.0;
  int64_t last_predicted_peak_ = 0;
  // Raw predictions by step (memory-budget mode only), pruned as reports come
  // in.
  std::map<int64_t, int64_t> raw_predictions_;
  // Max observed peak per step, for steps with a prediction.
  std::map<int64_t, int64_t> observed_peaks_;
};

}  // namespace hsdp::coordinator

#endif  // HSDP_COORDINATOR_PLANNER_H_
