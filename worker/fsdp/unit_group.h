// One shard unit (FSDP2's FSDPParamGroup): its parameters, its state
// machine through forward and backward, and its collectives' state.
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
// Two ways to move a unit's bytes, chosen per communicator (collectives.h):
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
// Comm fusion (StepSchedule.fusion_groups): a unit may have fusion peers, the
// units whose shard-group collectives go out together with its own. When a
// peer must be gathered, it issues one all-gather of every peer still sharded
// that the pass still needs (in forward: not entered yet; in backward: its
// backward not finished) and holds it; the others wait on it (kGathering with
// gather_issuer_). A syncing backward reduce-scatters the peers' gradients in
// one collective, issued by the last peer to finish its backward, whose
// pending reduction finishes them all. Only the shard group's collectives are
// fused: each unit's parts lie side by side in their own layouts, and each
// element is summed over the ranks in rank order whatever the packing, so
// every unit gets its own bits; the replicate group's all-reduces and the
// replicated parameters' all-reduces, whose ring order depends on the buffer,
// stay per unit. On the flat path with more than two shards (NCCL: a ring's
// summation order may depend on an element's offset) only the all-gathers
// fuse.
//
// Hierarchical reshard (StepSchedule.post_forward_group_size, with the host
// group of MeshComms): a unit resharded after forward first copies its host
// shard (collectives.h) out of the gathered parameters and keeps it; the
// next gather of the unit (its backward, a recompute) is an all-gather of
// the host shards over the host group, alone, never fused; any gather of the
// unit drops the copy, and so does a reshard. The gathered bytes are the
// same whichever group moved them.
//
// Thread-compatible: only ever driven by one thread at a time (see
// fully_shard.h).
#ifndef HSDP_WORKER_FSDP_UNIT_GROUP_H_
#define HSDP_WORKER_FSDP_UNIT_GROUP_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "hsdp/communicator.h"
#include "hsdp/fully_shard.h"
#include "worker/fsdp/collectives.h"
#include "worker/fsdp/engine_core.h"
#include "worker/fsdp/sharded_param.h"
#include "worker/fsdp/trace_recorder.h"

namespace hsdp::fsdp {

// What a unit's reductions of one step hold between microbatches.
struct StepReduction {
  // A reduction issued and not finished yet, and whether it all-reduces
  // across the replicate group.
  bool pending = false;
  bool all_reduce = false;
  // HSDP microbatches without the replicate all-reduce: their shard-reduced
  // sums (sharded and replicated parameters) until one with.
  at::Tensor held;
  at::Tensor replicated_held;
  // One shard, one replica: the gradients handed over without a collective.
  std::vector<at::Tensor> direct_grads;
  // The reduced flags of the step's reductions, summed (float32, one per
  // parameter): positive where some rank had a gradient. ResolveUnusedGrads
  // reads them once the step's last backward is over.
  at::Tensor grad_flags;
  at::Tensor replicated_flags;
};

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
  c10::ScalarType compute_dtype() const { return compute_dtype_; }
  c10::ScalarType reduce_dtype() const { return reduce_dtype_; }
  // Has parameters sharded over the shard group (what fusion moves).
  bool has_sharded_params() const { return !sharded_.empty(); }

  // Comm fusion: the units (this one included, in index order) whose
  // all-gathers, and whose reduce-scatters, go out with this unit's; empty
  // when it goes alone. Set between passes (Engine::Apply).
  void set_fusion_peers(std::vector<UnitGroup*> gather,
                        std::vector<UnitGroup*> reduce) {
    gather_peers_ = std::move(gather);
    reduce_peers_ = std::move(reduce);
  }

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
  UnitLayout Info() const;
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
  // fired, and when (PassState::exits) its last call's forward ended.
  int forward_calls = 0;
  int backward_calls = 0;
  int last_exit = -1;
  // SkipForward ran for it this pass (a later unit was entered first).
  bool skipped = false;

 private:
  enum class State { kSharded, kGathering, kUnsharded };

  // The segments path applies (see the file comment).
  bool UseSegments() const;
  // Allocates the unsharded storage of `params` that is not allocated yet.
  void AllocUnsharded(const std::vector<ShardedParam*>& params);
  // Copies the replicated parameters into their unsharded tensors (where they
  // do not alias their shards).
  void FillReplicated();
  // Unshard's part for this unit alone, when kSharded: false when it has
  // nothing to gather now (unsharded at once, or left sharded for a backward
  // that does not read it); true when its sharded parameters must be
  // gathered (its replicated ones are filled).
  bool PrepareGather();
  // This pass still needs the unit (see the file comment): a fusion peer
  // joins a gather only then.
  bool NeededLaterThisPass() const;
  // Hierarchical reshard (see the file comment): whether PostForward keeps
  // a host shard, keeping it (and freeing the rest), dropping it, and the
  // all-gather of the host shards over the host group.
  bool KeepsHostShard() const;
  void ReshardToHost();
  void DropHostShard();
  void IssueHostAllGather();
  // Issues one all-gather of `members`' sharded parameters (this unit among
  // them) and holds it.
  void IssueAllGather(std::vector<UnitGroup*> members);
  // On the issuer: waits the all-gather and unshards every unit it gathers.
  void CompleteAllGather();
  // Issues the reduction of `members` (this unit among them): one
  // reduce-scatter of their sharded parameters, then each one's replicated
  // all-reduce; this unit's pending reduction finishes them all.
  void IssueReduction(const std::vector<UnitGroup*>& members);
  void IssueReduceScatter(const std::vector<UnitGroup*>& members);
  void IssueReplicatedAllReduce();
  // FinishReduction's parts, per member: its part of the reduce-scatter
  // (and the replicate all-reduce), its replicated parameters' all-reduces.
  void FinishReduceScatter();
  void FinishReplicatedAllReduce();
  // HSDP: a microbatch without the replicate all-reduce adds `reduced` into
  // `held`; one with all-reduces `reduced` (with `held` added first, and
  // dropped) across the replicate group. Returns false when it held.
  bool ReduceAcrossReplicas(const at::Tensor& reduced, at::Tensor& held);
  // The segments path's reduce-scatter no longer reads the gradients.
  void ReleaseSentGradients();
  // Drops this unit's part of a reduce-scatter, then (as its issuer) the
  // collective's own buffers.
  void ReleaseReductionPart();
  void ReleaseReductionBuffers();
  // Adds one reduction's reduced flags to `sum`.
  static void AddReducedFlags(at::Tensor& sum, const at::Tensor& flags);
  // ResolveUnusedGrads for `params` with their summed flags (reset after).
  static void ResolveUnusedGrads(const std::vector<ShardedParam*>& params,
                                 at::Tensor& sum);
  // Waits `work` (a collective of this unit issued at `issued_ns`), adds its
  // time to `seconds` and, when tracing, records the wait on the compute
  // track and the collective on `track`. Fails the engine on an error.
  void WaitWork(std::unique_ptr<comm::Work>& work, double* seconds,
                const char* what, int64_t issued_ns, SpanTrack track);
  // Fails the engine with `s` unless it is OK.
  void Check(const absl::Status& s) const;
  // Records a span of this unit, when tracing.
  void Trace(const char* name, SpanTrack track, int64_t begin_ns,
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
  // Every parameter aliases its shard: nothing to gather or free.
  bool aliases_shard_ = false;

  // The collectives this unit issued and what they cover (itself, and its
  // fusion peers with it), and, while kGathering, the unit whose all-gather
  // fills it (possibly itself).
  AllGatherState all_gather_;
  std::vector<UnitGroup*> gathered_with_;
  UnitGroup* gather_issuer_ = nullptr;
  // The all-gather in flight is of the host shards, over the host group.
  bool host_gather_ = false;
  // Hierarchical reshard: this rank's host shard, kept from the unit's
  // forward to its next gather (undefined otherwise).
  at::Tensor host_shard_;
  ReduceScatterState reduce_scatter_;
  std::vector<UnitGroup*> reduced_with_;
  // This unit's part of a reduce-scatter (its own or a peer's).
  ReduceScatterPart reduce_part_;
  ReplicatedAllReduceState replicated_all_reduce_;
  StepReduction step_;
  std::vector<UnitGroup*> gather_peers_;
  std::vector<UnitGroup*> reduce_peers_;

  UnitStats stats_;
  // Trace times (wall clock ns; only read when tracing).
  int64_t forward_begin_ns_ = 0;
  int64_t backward_begin_ns_ = 0;
};

}  // namespace hsdp::fsdp

#endif  // HSDP_WORKER_FSDP_UNIT_GROUP_H_
