// One shard unit (FSDP2's FSDPParamGroup) and the engine-wide state the units
// and autograd hooks share (EngineCore).
//
// A unit moves through kSharded → kGathering (all-gather issued) → kUnsharded
// and back to kSharded on reshard. Per unit there is one fused all-gather and
// one fused reduce-scatter of the gradients in reduce_dtype; in HSDP the
// reduced shard is then all-reduced across the replicate group. Replicated
// parameters (placement.h) take no part in either: they are copied (cast)
// into their unsharded tensors when the unit is gathered, and their
// gradients go out as one fused all-reduce over the shard group, then over
// the replicate group, issued right after the reduce-scatter.
//
// Two ways to move a unit's bytes, chosen per communicator:
//  - segments (CPU: Gloo TCP, shared memory): the all-gather sends each local
//    shard and receives every peer's piece straight into the unsharded
//    parameter storage (allocated when the gather is issued); the
//    reduce-scatter sends each gradient's rows straight from the gradient and,
//    without replicas, sums into this rank's own rows in place. No flat
//    staging buffer, no copy-in/copy-out.
//  - flat (NCCL, whose collectives take one contiguous buffer): copy-in to a
//    flat buffer of S chunks, the collective in place, copy-out (FSDP2's way).
// Both sum in rank order, so they give the same bits. Collectives are issued
// from the training thread (or the autograd thread while the training thread
// waits in backward) in program order, so every rank issues the same sequence.
//
// Thread-compatible: only ever driven by one thread at a time (see
// fully_shard.h).
#ifndef HSDP_WORKER_FSDP_UNIT_GROUP_H_
#define HSDP_WORKER_FSDP_UNIT_GROUP_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "worker/comm/communicator.h"
#include "worker/fsdp/fully_shard.h"
#include "worker/fsdp/sharded_param.h"
#include "worker/fsdp/trace_recorder.h"

namespace hsdp::fsdp {

class UnitGroup;

// Flat communication buffers kept for reuse. On CPU a fresh buffer per
// collective costs a page fault per 4 KiB — as much time as the collective
// itself — so units hand their buffers back here. At most `limit` idle bytes
// are kept (FullyShardRoot sets it to one largest unit's flat buffers); live
// (acquired) and idle bytes are both accounted. A request no idle buffer fits
// drops the idle ones first: they would otherwise stay alive next to the new
// buffer (e.g. root's small buffer next to a block's). Thread-compatible.
class FlatBufferPool {
 public:
  at::Tensor Acquire(int64_t numel, const at::TensorOptions& options);
  // Takes the buffer back (resetting `buffer`); it is kept for reuse only when
  // nothing else references its storage, else simply dropped.
  void Release(at::Tensor& buffer);
  void set_limit(int64_t bytes) { limit_ = bytes; }
  int64_t bytes() const { return live_ + idle_; }
  int64_t peak_bytes() const { return peak_; }
  void ResetPeak() { peak_ = bytes(); }

 private:
  std::vector<at::Tensor> idle_buffers_;  // oldest first
  int64_t live_ = 0;
  int64_t idle_ = 0;
  int64_t peak_ = 0;
  int64_t limit_ = 0;
};

// Engine-wide state. Public fields: this is the engine's internal blackboard,
// read and written by UnitGroup, the hooks and the helpers, all on the one
// thread driving the engine.
class EngineCore {
 public:
  EngineCore(std::shared_ptr<torch::nn::Module> root_module,
             MeshComms mesh_comms, EngineOptions engine_options);
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

  void AddUnshardedBytes(int64_t delta);
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
  // Engine::Rebind's reset: every unit's DiscardStep, then the engine-wide
  // per-step state (pending reductions, the end-of-backward callback flag,
  // recompute state, the forward measure, the sticky error). The communicators
  // must already be aborted (no collective touches the buffers any more).
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

  // Current microbatch (from Apply).
  bool requires_grad_sync = true;
  bool requires_all_reduce = true;
  bool is_last_backward = true;

  // The microbatch being trained (from Apply), for trace spans.
  int microbatch = 0;
  // Null unless the step is traced (Engine::SetTraceRecorder).
  TraceRecorder* trace = nullptr;

  bool callback_queued = false;
  // Per pass: the highest unit index entered, the count of unit forwards
  // ended (not counting recompute), whether CompleteForward ran.
  int max_entered = -1;
  int exits = 0;
  bool forward_completed = false;
  int recompute_depth = 0;
  std::vector<UnitGroup*> pending_reductions;
  std::map<int64_t, TensorFn> checkpoint_fns;
  int64_t next_checkpoint_id = 0;

  FlatBufferPool buffers;
  absl::Status status;
  int64_t unsharded_bytes_alive = 0;
  int64_t peak_unsharded_bytes = 0;
  int64_t peak_unsharded_grad_bytes = 0;
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

 private:
  // Unsharded params, unsharded grads (in flight too) and comm buffers now.
  int64_t OwnedTransientBytes() const;
};

// The engine's internal state, for the engine's own helpers (state dicts,
// recompute, benchmarks); not part of the public API.
EngineCore& CoreOf(Engine& engine);
const EngineCore& CoreOf(const Engine& engine);

class UnitGroup {
 public:
  UnitGroup(EngineCore* core, int index, std::string name,
            std::vector<std::unique_ptr<ShardedParam>> params,
            bool reshard_after_forward, bool unshard_in_backward = true);
  UnitGroup(const UnitGroup&) = delete;
  UnitGroup& operator=(const UnitGroup&) = delete;

  EngineCore& core() const { return *core_; }
  int index() const { return index_; }
  const std::string& name() const { return name_; }
  void set_index(int index) { index_ = index; }
  // Every parameter, in registration order (Parameters() order).
  std::vector<ShardedParam*> params() const;
  bool is_unsharded() const { return state_ == State::kUnsharded; }
  bool is_gathering() const { return state_ == State::kGathering; }

  // Issues the all-gather when sharded (no-op otherwise).
  void Unshard();
  // Completes an issued all-gather (issuing it first if needed) and fills the
  // parameters.
  void WaitForUnshard();
  // Frees the unsharded storage (waiting for an in-flight all-gather first).
  void Reshard();

  void PreForward();
  void PostForward();
  // Pre- and post-forward with nothing run in between: a unit this rank does
  // not enter joins the collectives every other rank runs for it.
  void SkipForward();
  void PreBackward();
  // The post-backward hook: fires once per call of the unit; the last one
  // finishes the unit's backward.
  void PostBackward();
  // Reshards (as scheduled) and issues the unit's reduction.
  void FinishBackward();
  // Waits the issued reduce-scatter (and all-reduce) and accumulates into the
  // sharded grads.
  void FinishReduction();
  // After the step's last backward: a parameter no rank had a gradient for in
  // any of the step's reductions gets back an undefined sharded grad (as in
  // single-process training, so the optimizer skips it); every other one keeps
  // the reduced sum, zeros from the ranks without a gradient included.
  void ResolveUnusedGrads();

  // Drops the unit's part of an interrupted step without waiting or issuing
  // anything: the in-flight works (never waited), the flat buffers, the
  // unsharded storage and gradients, pending and partial reductions and the
  // sharded grads; the unit is kSharded with every pass flag cleared. Only
  // after the communicators were aborted (their buffers are free to go).
  void DiscardStep();

  // Bytes of the flat buffers one collective of this unit uses (pool limit).
  int64_t FlatBufferBytes() const;
  UnitInfo Info() const;
  UnitStats Stats() const;
  void ResetStats();

  // From the schedule (or defaults).
  bool reshard_after_forward;
  bool reshard_after_backward = true;
  std::vector<int> forward_prefetch;
  std::vector<int> backward_prefetch;

  // Per backward pass.
  bool forwarded = false;
  bool pre_backward_done = false;
  bool post_backward_done = false;
  // Per pass: calls of the unit (recompute not counted), post-backward hooks
  // fired, and when (EngineCore::exits) its last call's forward ended.
  int forward_calls = 0;
  int backward_calls = 0;
  int last_exit = -1;
  // SkipForward ran for it this pass (a later unit was entered first).
  bool skipped = false;

 private:
  enum class State { kSharded, kGathering, kUnsharded };

  // The segments path applies (see the file comment).
  bool UseSegments() const;
  void IssueAllGatherSegments();
  // Copies the replicated parameters into their unsharded tensors (where they
  // do not alias their shards).
  void FillReplicated();
  void IssueReduction();
  void IssueReduceScatterFlat();
  void IssueReduceScatterSegments();
  void IssueReplicatedAllReduce();
  // FinishReduction's parts: the sharded parameters' reduce-scatter (and
  // replicate all-reduce), the replicated parameters' all-reduces.
  void FinishReduceScatter();
  void FinishReplicatedAllReduce();
  // HSDP, a microbatch without the replicate all-reduce: adds `reduced` into
  // `partial` until one with.
  static void HoldPartial(const at::Tensor& reduced, at::Tensor& partial);
  // The replicate group's all-reduce of `reduced` (with `partial` added
  // first, and dropped), waited.
  void AllReduceReplicas(const at::Tensor& reduced, at::Tensor& partial);
  void ReleaseReductionBuffers();
  // Elements of one rank's chunk of a reduction: the sharded gradients' flat
  // chunk, then one flag per sharded parameter.
  int64_t ReductionChunkNumel() const;
  // Writes this rank's flags for `params` into `flags` (one element each).
  static void FillGradFlags(const std::vector<ShardedParam*>& params,
                            const at::Tensor& flags);
  // Adds one reduction's reduced flags to `sum`.
  static void AddReducedFlags(at::Tensor& sum, const at::Tensor& flags);
  // ResolveUnusedGrads for `params` with their summed flags (reset after).
  static void ResolveUnusedGrads(const std::vector<ShardedParam*>& params,
                                 at::Tensor& sum);
  // Waits `work` (a collective of this unit issued at `issued_ns`), adds its
  // time to `seconds` and, when tracing, records the wait on the compute
  // track and the collective on `track`.
  absl::Status WaitWork(std::unique_ptr<comm::Work>& work, double* seconds,
                        const char* what, int64_t issued_ns, TraceTrack track);
  // Records a span of this unit, when tracing.
  void Trace(const char* name, TraceTrack track, int64_t begin_ns,
             int64_t end_ns) const;

  EngineCore* core_;
  int index_;
  std::string name_;
  // UnitOptions::unshard_in_backward.
  bool unshard_in_backward_;
  std::vector<std::unique_ptr<ShardedParam>> params_;
  // params_ split by placement: sharded over the shard group, or replicated.
  std::vector<ShardedParam*> sharded_;
  std::vector<ShardedParam*> replicated_;
  State state_ = State::kSharded;
  c10::ScalarType compute_dtype_;
  c10::ScalarType reduce_dtype_;
  // The dtype unsharded gradients accumulate in across microbatches; not
  // compute_dtype_: each backward folds them into main gradients.
  c10::ScalarType grad_accumulation_dtype_;

  // Flat buffers from core_->buffers, S chunks each. Collectives run in place:
  // rs_output_ is this rank's chunk of rs_input_ (undefined with one shard,
  // when the input is the result).
  at::Tensor ag_output_;
  // Segments path: the shards cast to the compute dtype, when they differ.
  at::Tensor ag_input_;
  std::unique_ptr<comm::Work> ag_work_;
  at::Tensor rs_input_;
  at::Tensor rs_output_;
  // Segments path: the peers' contributions (S-1 chunks), and the gradients
  // being sent (kept alive until the reduce-scatter completes).
  at::Tensor rs_scratch_;
  std::vector<at::Tensor> rs_grads_;
  // The sum lands in each gradient's own rows (no replicas to all-reduce with).
  bool rs_in_place_ = false;
  int64_t rs_grad_bytes_ = 0;
  std::unique_ptr<comm::Work> rs_work_;
  bool rs_all_reduce_ = false;
  bool reduction_pending_ = false;
  // Shard-reduced grads of earlier microbatches that still owe the replicate
  // all-reduce.
  at::Tensor partial_reduce_;
  // Which ranks had a gradient for each parameter travels with the gradients:
  // every reduced chunk ends in one flag per parameter (1 where this rank's
  // gradient was defined, 0 where zeros stood in), reduced like the gradients.
  // Segments path: the flags sent, one copy per destination rank.
  at::Tensor rs_flags_;
  // The reduced flags of this step's reductions, summed (float32, one per
  // parameter): positive where some rank had a gradient. ResolveUnusedGrads
  // reads them once the step's last backward is over.
  at::Tensor grad_flags_;
  // Replicated parameters' reduction: their gradients and flags in one flat
  // buffer (from the pool), its shard-group all-reduce, the sum held over
  // microbatches without the replicate all-reduce, and the summed flags.
  at::Tensor rp_buffer_;
  std::unique_ptr<comm::Work> rp_work_;
  at::Tensor rp_partial_;
  at::Tensor replicated_flags_;
  // One shard, one replica: the gradients handed over without a collective.
  std::vector<at::Tensor> direct_grads_;
  // Every parameter aliases its shard: nothing to gather or free.
  bool aliases_shard_ = false;

  UnitStats stats_;

  // Trace times (wall clock ns; only read when tracing).
  int64_t forward_begin_ns_ = 0;
  int64_t backward_begin_ns_ = 0;
  int64_t ag_issued_ns_ = 0;
  int64_t rs_issued_ns_ = 0;
  int64_t rp_issued_ns_ = 0;
};

}  // namespace hsdp::fsdp

#endif  // HSDP_WORKER_FSDP_UNIT_GROUP_H_
