// The engine-wide state the units and autograd hooks share (EngineCore,
// FSDP2's FSDPState and its contexts): the mesh and options, the units, the
// current microbatch's sync flags, where the current pass is (PassState), the
// engine's own bytes (MemoryAccount), the buffer pool and the sticky error.
//
// Thread-compatible: read and written by UnitGroup, the hooks and the helpers,
// all on the one thread driving the engine (see fully_shard.h).
#ifndef HSDP_WORKER_FSDP_ENGINE_CORE_H_
#define HSDP_WORKER_FSDP_ENGINE_CORE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "hsdp/communicator.h"
#include "hsdp/fully_shard.h"
#include "worker/fsdp/flat_buffer_pool.h"

namespace hsdp::fsdp {

class TraceRecorder;
class UnitGroup;

// Where the current forward/backward pass is. Reset by every Apply and at the
// end of every backward.
struct PassState {
  // The end-of-backward callback is queued: a backward is running.
  bool callback_queued = false;
  // The highest unit index entered in this forward.
  int max_entered = -1;
  // Unit forwards ended in this pass (recompute not counted).
  int exits = 0;
  // CompleteForward ran (the skipped units' collectives are issued).
  bool forward_completed = false;
};

// The engine's own transient bytes — unsharded parameters and gradients, comm
// buffers — now and at their peaks, and the activations a forward left.
struct MemoryAccount {
  // Adds `delta` to the unsharded parameter bytes alive; keeps the peak.
  void AddUnsharded(int64_t delta);

  int64_t unsharded_bytes_alive = 0;
  int64_t peak_unsharded_bytes = 0;
  int64_t peak_unsharded_grad_bytes = 0;
  // The simultaneous peak of params + grads + buffers, and its parts.
  int64_t peak_transient_bytes = 0;
  int64_t peak_transient_param_bytes = 0;
  int64_t peak_transient_grad_bytes = 0;
  int64_t peak_transient_comm_bytes = 0;
  // Unsharded gradients no longer on their parameters but still read by a
  // reduce-scatter in flight (segments path): counted with the grads.
  int64_t in_flight_grad_bytes = 0;
  // The meter and the engine's own bytes when the current forward began.
  std::optional<int64_t> forward_start_meter;
  int64_t forward_start_owned = 0;
  int64_t activation_bytes = 0;
};

class EngineCore {
 public:
  EngineCore(std::shared_ptr<torch::nn::Module> root_module,
             MeshComms mesh_comms, EngineOptions engine_options);
  ~EngineCore();
  EngineCore(const EngineCore&) = delete;
  EngineCore& operator=(const EngineCore&) = delete;

  int shard_rank() const { return mesh.shard->rank(); }
  int shard_size() const { return mesh.shard->size(); }
  int replicate_rank() const {
    return mesh.replicate ? mesh.replicate->rank() : 0;
  }
  int replicate_size() const {
    return mesh.replicate ? mesh.replicate->size() : 1;
  }
  int global_rank() const {
    return replicate_rank() * shard_size() + shard_rank();
  }
  c10::ScalarType param_dtype(c10::ScalarType master) const {
    return options.mixed_precision.param_dtype.value_or(master);
  }
  // The reduction the collectives run (GradientReduction): kAvg unless the
  // gradients are summed, with or without a divide factor.
  comm::ReduceOp collective_reduce_op() const {
    const GradientReduction& r = options.gradient_reduction;
    return r.divide_factor.has_value() ? comm::ReduceOp::kSum : r.op;
  }
  // What the reduced gradients are multiplied by before they accumulate
  // (1 / divide_factor); none without a divide factor.
  std::optional<double> reduced_grad_scale() const {
    const GradientReduction& r = options.gradient_reduction;
    if (!r.divide_factor.has_value()) return std::nullopt;
    return 1.0 / *r.divide_factor;
  }

  // Records the first error (sticky) and throws it as c10::Error: the only way
  // out of an autograd hook. Callers outside autograd convert it back with
  // status().
  [[noreturn]] void Fail(const absl::Status& error);
  // Throws the sticky error, if any.
  void CheckOk() const;

  // The unsharded gradient bytes of every unit, in-flight ones included.
  int64_t UnshardedGradBytes() const;
  // Samples UnshardedGradBytes() into the peak; returns them.
  int64_t SampleUnshardedGradBytes();
  // Samples unsharded params + unsharded grads + comm buffers alive now into
  // the simultaneous transient peak (see EngineStats::peak_transient_bytes).
  void SampleTransientBytes();
  // Waits every issued reduction and accumulates it into the sharded grads.
  void FinishPendingReductions();
  // Queues EndOfBackward on the running autograd graph task, once per backward.
  void QueueEndOfBackwardOnce();
  // Runs post-backward for units whose hook did not fire, waits for all
  // reductions, resets the per-backward flags.
  void EndOfBackward();
  // Before unit `index` is entered for the first time in this pass: runs the
  // forward collectives of the units skipped since the last one entered (see
  // "Every rank, the same collectives" in fully_shard.h); entering one of
  // those later fails that forward (UnitGroup::PreForward).
  void BeforeFirstEntry(int index);
  // The same for the units after the last one entered; once per pass (from
  // root's post-forward, the first pre-backward, or the next Apply).
  void CompleteForward();
  // Before a unit whose forward ended at `exit` runs its backward: every unit
  // whose forward ended later and whose backward has not begun is not reached
  // by this backward on this rank (autograd runs later-created nodes first);
  // it runs its backward collectives now, latest first, with no gradients.
  void FinishUnreachedAfter(int exit);
  void ResetPassFlags();
  // Comm fusion (unit_group.h): the schedule's fusion groups (unit indices,
  // checked by Apply), kept until they change. Gives each unit its peers: the
  // members of its group with parameters sharded over the shard group, in runs
  // of one compute and reduce dtype (a run of one goes alone); reduce-scatter
  // peers only where the reduce-scatter sums in rank order whatever the
  // packing (the segments path, or at most two shards). No peers with one
  // shard. Sets the buffer pool's idle limit to the largest unit's or group's
  // flat buffers. Between passes; a gather in flight keeps its members.
  void SetFusionGroups(const std::vector<std::vector<int>>& groups);
  // Engine::Rebind's reset: every unit's DiscardStep, then the engine-wide
  // per-step state (pending reductions, the pass, recompute state, the forward
  // measure, the sticky error). The communicators must already be aborted (no
  // collective touches the buffers any more).
  void DiscardStep();

  // Engine::Stats() and ResetStats(): the units' stats summed, the peaks, the
  // memory meter's readings (memory_meter.h) and the accounting in the memory
  // model's categories.
  EngineStats Stats() const;
  void ResetStats();
  // Around the root's forward (not inside recompute): the meter's growth minus
  // the engine's own is the microbatch's activations.
  void BeginForwardMeasure();
  void EndForwardMeasure();

  std::shared_ptr<torch::nn::Module> root;
  MeshComms mesh;
  // The shard group the shards were cut for (from Create): Rebind keeps it
  // and checks against these, not the old communicator, which it never uses.
  int layout_shard_rank = 0;
  int layout_shard_size = 1;
  EngineOptions options;
  std::vector<std::unique_ptr<UnitGroup>>
      units;  // index 0 = root once finalized
  bool finalized = false;

  // StepSchedule.post_forward_group_size of the step being run (from Apply,
  // checked against mesh.host): 0, or the host group's size.
  int post_forward_group_size = 0;
  // Current microbatch (from Apply).
  bool requires_grad_sync = true;
  bool requires_all_reduce = true;
  bool is_last_backward = true;
  // The microbatch being trained (from Apply), for trace spans.
  int microbatch = 0;
  // Null unless the step is traced (Engine::SetTraceRecorder).
  TraceRecorder* trace = nullptr;

  PassState pass;
  // Nesting of activation recompute running inside backward.
  int recompute_depth = 0;
  // The functions Recompute reruns in backward, by id.
  std::map<int64_t, TensorFn> recompute_fns;
  int64_t next_recompute_id = 0;
  std::vector<UnitGroup*> pending_reductions;

  // As given to the last SetFusionGroups.
  std::vector<std::vector<int>> fusion_groups;
  FlatBufferPool buffers;
  MemoryAccount memory;
  absl::Status status;

 private:
  // Unsharded params, unsharded grads (in flight too) and comm buffers now.
  int64_t OwnedTransientBytes() const;
};

// The engine's internal state, for the engine's own helpers (state dicts,
// recompute, benchmarks); not part of the public API.
EngineCore& CoreOf(Engine& engine);
const EngineCore& CoreOf(const Engine& engine);

}  // namespace hsdp::fsdp

#endif  // HSDP_WORKER_FSDP_ENGINE_CORE_H_
