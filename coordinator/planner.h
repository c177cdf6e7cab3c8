// The planner: Policy + unit list (+ the peaks workers report) -> the
// StepSchedule of one step. Torch-free and gRPC-free (library hsdp_planner):
// the coordinator seals its schedules, and the engine's tests and benchmarks
// run the same ones.
//
// Execution order, which every list below follows: forward enters the root
// (unit 0) first, then the blocks 1..n-1, and leaves the root last; backward
// starts with the root (its head), then the blocks n-1..1, and ends with the
// root (its embedding).
//
// Manual mode (memory_budget_bytes == 0) is exact and stateless:
// - reshard_after_forward / reshard_after_backward of a block: the policy
//   defaults, then every override whose glob matches the unit name, in order
//   (later ones win);
// - the root rule (FSDP2's): the root is never resharded after forward — its
//   post-forward is the end of forward and backward re-gathers it at once, one
//   wasted all-gather per microbatch — nor after backward, which ends with the
//   root just before the next microbatch's forward gathers it again (the last
//   microbatch reshards every unit anyway). Only an override whose unit_glob is
//   exactly "root" (no wildcard) sets either flag of the root; a wildcard such
//   as "*" never does;
// - forward_prefetch(i) = the next forward_prefetch_depth units after i in
//   forward order (never the root, which is entered first);
// - backward_prefetch(i) = the next backward_prefetch_depth units after i in
//   backward order that are resharded after forward: units kept unsharded
//   after forward (and the root) need no backward all-gather, so they take no
//   place in the list. backward_prefetch(root) starts with the last block.
// - microbatch k of m: requires_grad_sync = last || grad_sync is
//   EVERY_MICROBATCH; requires_all_reduce = requires_grad_sync && (last ||
//   all_reduce is EVERY_MICROBATCH); is_last_backward = last. The flags do not
//   depend on the mesh: with one replica the engine's all-reduce is a no-op.
// - checkpoint = (checkpoint_interval > 0 &&
//   (step + 1) % checkpoint_interval == 0) || a checkpoint was requested.
// - post_forward_group_size = the generation's host group size
//   (SetHostGroupSize) when reshard_after_forward_within_host and it is
//   above 1, else 0.
// - fusion_groups (comm_fusion_bucket_bytes > 0): consecutive units in index
//   order, first fit, whose gathered bytes (param_bytes - replicated_bytes)
//   add up to at most the bucket; a unit with none, or over the bucket
//   alone, ends a group and goes alone; groups of one are not written.
//
// Memory-budget mode (memory_budget_bytes > 0) plans like manual mode, except
// that it picks reshard_after_forward for every block no override pins
// explicitly: keeping a block unsharded saves its backward all-gather, so it
// keeps as many blocks as the predicted peak allows, smallest first (ties: the
// later block, which backward reaches first). The prediction is the memory
// model's (common/memory_model.h) with the activations and a correction
// learned from the workers' reports (see ObservePeakMemory); a plan that ran
// before is predicted by its own measured peak instead, since the model's error
// depends on the plan (e.g. it may call free what keeps a block longer). When
// even every
// block resharded is predicted over the budget the step runs that least-memory
// plan and says so (StepSchedule.over_memory_budget); SetPolicy refuses such a
// budget up front when the model is known (CheckMemoryBudget).
//
// Links (SetLinks, SetShardGroupsCrossHosts): when the job declares what an
// all-gather costs on the link its shard groups use (within a host, or across
// hosts when a shard group spans them), memory-budget mode instead keeps the
// set of blocks that saves the most predicted all-gather time within the
// budget: each kept block saves one backward all-gather per microbatch, worth
// the link's latency plus the bytes a rank receives over its bandwidth, and
// costs the peak its unsharded parameters add. On a latency-bound link that
// is still as many blocks as fit (smallest first); on a slow link, where the
// bytes dominate, it is the blocks that keep the most bytes off the link, so a
// large block can win over several small ones. The choice is a 0/1 knapsack
// (weights: what each block alone adds to the peak, in 1/kKnapsackSlots of the
// budget's headroom), checked against the full prediction and topped up
// smallest first with what still fits; since the peak is not additive, the
// plan without links is computed too, and the knapsack's plan is taken only
// when it saves more time.
#ifndef HSDP_COORDINATOR_PLANNER_H_
#define HSDP_COORDINATOR_PLANNER_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/memory_model.h"
#include "common/units.h"
#include "hsdp/v1/policy.pb.h"
#include "hsdp/v1/schedule.pb.h"

namespace hsdp::coordinator {

// The corrected (or measured) prediction stays within [raw /
// kMaxCorrectionRatio, raw * kMaxCorrectionRatio], so one absurd report cannot
// make the planner keep everything or nothing.
inline constexpr int64_t kMaxCorrectionRatio = 8;
// The correction is the largest of the last this many reported steps' (one
// step's report can run low, e.g. the first step, before the optimizer state
// exists).
inline constexpr int kCorrectionWindowSteps = 4;
// Planned schedules kept for their reports (reports arrive within the
// read-ahead window of sealing, far fewer steps than this).
inline constexpr size_t kMaxRememberedPlans = 256;
// Distinct plans whose measured peaks are remembered (the least recently
// measured goes first).
inline constexpr size_t kMaxMeasuredPlans = 64;

// The knapsack's resolution: the headroom under the budget in this many
// slots.
inline constexpr int kKnapsackSlots = 4096;

// What one all-gather costs on a kind of link, as the job declares it.
struct LinkCost {
  // 0: not declared.
  double bytes_per_second = 0;
  double latency_seconds = 0;
  bool declared() const { return bytes_per_second > 0; }
  // Latency plus `bytes` over the bandwidth.
  double Seconds(int64_t bytes) const;
};

// The two kinds of link a shard group's all-gathers may cross.
struct LinkCosts {
  LinkCost intra_host;
  LinkCost inter_host;
};

// The backward all-gathers per step that a schedule's blocks kept unsharded
// after forward save, per rank: how many, the bytes each rank does not
// receive, and their predicted time on the link they would cross (0 when
// undeclared): the shard group's, or under hierarchical reshard
// (post_forward_group_size > 1) the host group's, inside a host.
struct AllGatherSavings {
  int64_t count = 0;
  int64_t bytes = 0;
  double seconds = 0;
};

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

// Collectives the engine issues for one step run by a schedule, per rank (each
// unit gathers once per forward unless still unsharded from the previous
// microbatch, again in backward when resharded after forward; reduces when the
// microbatch syncs; all-reduces across replicas where asked). A fusion group
// gathers once where its members would each gather, and reduce-scatters once
// (the replicate all-reduces stay per unit). Assumes every parameter unit
// holds parameters sharded over the group in one dtype, no recompute, S > 1,
// and a backend that fuses reduce-scatters (the CPU transports; NCCL with at
// most two shards, worker/fsdp/unit_group.h).
struct CollectiveCounts {
  int64_t all_gathers = 0;
  int64_t reduce_scatters = 0;
  int64_t all_reduces = 0;
  // Hierarchical reshard (post_forward_group_size > 1): the backward
  // all-gathers over the host group, one per unit resharded after forward
  // (never fused), instead of its shard group's.
  int64_t host_all_gathers = 0;
};
CollectiveCounts CountCollectives(const hsdp::v1::StepSchedule& schedule,
                                  int replicate_size);

// Thread-compatible: the schedule log calls it under its own lock.
class Planner {
 public:
  // `memory` describes the mesh (and transport) for the memory model.
  Planner(UnitList units, MemoryModel::Options memory);
  // A plain FSDP mesh of `shard_size` ranks on a CPU transport.
  Planner(UnitList units, int shard_size);
  Planner(const Planner&) = delete;
  Planner& operator=(const Planner&) = delete;

  // The schedule for `input.step` under `policy` (validated by ValidatePolicy;
  // defaults are resolved here). Remembers it, so a later
  // ObservePeakMemory(step, ...) can compare the prediction with the
  // measurement.
  hsdp::v1::StepSchedule Plan(const hsdp::v1::Policy& policy,
                              const PlanInput& input);

  // OK unless `policy` has a memory budget below the least predicted peak of
  // this model (every block that no override pins resharded after forward):
  // then INVALID_ARGUMENT naming policy.memory_budget_bytes and both figures.
  absl::Status CheckMemoryBudget(const hsdp::v1::Policy& policy) const;

  // Feeds back a rank's measured peak and activation bytes for a planned step.
  // The step's correction is max-over-ranks(peak) minus the model's prediction
  // for that step's schedule with max-over-ranks(activations); the applied
  // correction is the largest over the last kCorrectionWindowSteps reported
  // steps, and the activation estimate is the latest step's. The step's plan
  // (its schedule without step, version and names) also remembers the largest
  // peak measured for it, which then predicts that plan. All apply to steps
  // planned from now on (sealed steps never change). Reports for steps not
  // planned here, older than the window, or with peak_bytes <= 0 are ignored.
  void ObservePeakMemory(int64_t step, int64_t peak_bytes,
                         int64_t activation_bytes);

  // The links shard-group all-gathers cross, and whether the generation's
  // shard groups span hosts (then the inter-host link is the one in use).
  // Apply to steps planned from now on.
  void SetLinks(const LinkCosts& links) { links_ = links; }
  void SetShardGroupsCrossHosts(bool cross) { cross_hosts_ = cross; }
  // The generation's hsdp.v1.Generation.host_group_size (0: none). With it
  // above 1, a policy with reshard_after_forward_within_host plans
  // post_forward_group_size = it.
  void SetHostGroupSize(int size) { host_group_size_ = size; }
  // The link a shard group's all-gather crosses now.
  const LinkCost& link() const {
    return cross_hosts_ ? links_.inter_host : links_.intra_host;
  }
  // What `schedule`'s kept blocks save, each on the link its backward gather
  // would cross.
  AllGatherSavings Savings(const hsdp::v1::StepSchedule& schedule) const;

  // Bytes added to the model's predictions (0 until the first report).
  int64_t memory_correction_bytes() const { return correction_; }
  // Activations per microbatch the model assumes (0 until reported).
  int64_t activation_bytes() const { return activation_bytes_; }
  // Corrected predicted peak of the last step planned in memory-budget mode
  // (0 if none).
  int64_t last_predicted_peak_bytes() const { return last_predicted_peak_; }

  // The model's raw prediction for `schedule` (no correction).
  MemoryBreakdown PredictPeak(const hsdp::v1::StepSchedule& schedule) const;
  // What memory-budget mode goes by: the plan's measured peak when it ran
  // before, else the corrected model prediction.
  int64_t PredictedPeakBytes(const hsdp::v1::StepSchedule& schedule) const;

  const UnitList& units() const { return units_; }
  const MemoryModel& memory_model() const { return model_; }

 private:
  // The schedule of a resolved policy with reshard flags and prefetch lists
  // (memory-budget mode: every unpinned block resharded).
  hsdp::v1::StepSchedule PlanManual(const hsdp::v1::Policy& resolved,
                                    const PlanInput& input) const;
  // Memory-budget mode: keeps what fits in `schedule` and records the
  // prediction.
  void ChooseKeptUnits(const hsdp::v1::Policy& resolved,
                       hsdp::v1::StepSchedule* schedule);
  // The links' way of it (see the file comment): returns the predicted peak
  // of the plan it leaves in `schedule`, starting from `predicted` (every
  // candidate resharded, under the budget).
  int64_t ChooseKeptUnitsByTime(const std::vector<int>& candidates,
                                int64_t budget, int forward_depth,
                                int backward_depth, int64_t predicted,
                                hsdp::v1::StepSchedule* schedule) const;
  // Keeps each of `candidates` still resharded, in order, whose keeping the
  // budget allows (without links, the whole choice); returns the predicted
  // peak, starting from `predicted`.
  int64_t KeepSmallestFirst(const std::vector<int>& candidates, int64_t budget,
                            int forward_depth, int backward_depth,
                            int64_t predicted,
                            hsdp::v1::StepSchedule* schedule) const;
  // Bytes a rank receives in unit `unit`'s all-gather over the shard group.
  int64_t GatheredBytes(int unit) const;
  // The link a resharded block's backward all-gather crosses under
  // `schedule`: the host group's (intra-host) under hierarchical reshard,
  // else link().
  const LinkCost& BackwardLink(const hsdp::v1::StepSchedule& schedule) const;
  // Bytes a rank receives in unit `unit`'s backward all-gather under
  // `schedule` (over the host group of k: (k - 1) / k of the unit).
  int64_t BackwardGatheredBytes(const hsdp::v1::StepSchedule& schedule,
                                int unit) const;
  int num_units() const { return static_cast<int>(units_.size()); }
  int64_t Corrected(int64_t raw) const;
  // What distinguishes one plan from another for memory.
  static std::string PlanKey(const hsdp::v1::StepSchedule& schedule);

  const UnitList units_;
  const MemoryModel model_;
  LinkCosts links_;
  bool cross_hosts_ = false;
  int host_group_size_ = 0;
  int64_t correction_ = 0;
  int64_t activation_bytes_ = 0;
  int64_t last_predicted_peak_ = 0;
  // Planned schedules by step, until their reports are in (pruned).
  std::map<int64_t, hsdp::v1::StepSchedule> plans_;
  struct Observation {
    int64_t peak_bytes = 0;
    int64_t activation_bytes = 0;
    int64_t correction = 0;
  };
  // The last kCorrectionWindowSteps reported steps.
  std::map<int64_t, Observation> observed_;
  struct MeasuredPlan {
    int64_t peak_bytes = 0;
    int64_t last_step = 0;
  };
  std::map<std::string, MeasuredPlan> measured_plans_;
};

}  // namespace hsdp::coordinator

#endif  // HSDP_COORDINATOR_PLANNER_H_
