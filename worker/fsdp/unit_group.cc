#include "worker/fsdp/unit_group.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "worker/fsdp/collectives.h"

namespace hsdp::fsdp {

UnitGroup::UnitGroup(EngineCore* core, int index, std::string name,
                     std::vector<std::unique_ptr<ShardedParam>> params,
                     bool reshard_after_forward, bool unshard_in_backward)
    : reshard_after_forward(reshard_after_forward),
      core_(core),
      index_(index),
      name_(std::move(name)),
      unshard_in_backward_(unshard_in_backward),
      params_(std::move(params)) {
  const c10::ScalarType master =
      params_.empty() ? c10::kFloat : params_.front()->sharded().scalar_type();
  compute_dtype_ = core_->param_dtype(master);
  reduce_dtype_ =
      core_->options.mixed_precision.reduce_dtype.value_or(compute_dtype_);
  grad_accumulation_dtype_ =
      core_->options.mixed_precision.grad_accumulation_dtype.value_or(
          compute_dtype_);
  aliases_shard_ = !params_.empty();
  for (const auto& p : params_) {
    stats_.sharded_bytes += p->sharded_bytes();
    aliases_shard_ = aliases_shard_ && p->aliases_shard();
    (p->replicated() ? replicated_ : sharded_).push_back(p.get());
  }
}

std::vector<ShardedParam*> UnitGroup::params() const {
  std::vector<ShardedParam*> out;
  out.reserve(params_.size());
  for (const auto& p : params_) out.push_back(p.get());
  return out;
}

void UnitGroup::Check(const absl::Status& s) const {
  if (!s.ok()) core_->Fail(s);
}

void UnitGroup::WaitWork(std::unique_ptr<comm::Work>& work, double* seconds,
                         const char* what, int64_t issued_ns,
                         TraceTrack track) {
  TraceRecorder* const trace = core_->trace;
  const int64_t wait_begin = trace ? TraceRecorder::NowNanos() : 0;
  // Done before the wait: it ended no later than now.
  const bool done_before = trace && work->IsCompleted();
  absl::Status s = work->Wait();
  if (!s.ok()) {
    core_->Fail(absl::Status(
        s.code(), absl::StrCat(what, " of unit ", name_, ": ", s.message())));
  }
  *seconds += work->ElapsedSeconds();
  if (trace != nullptr) {
    const int64_t wait_end = TraceRecorder::NowNanos();
    Trace(absl::StrCat("wait ", what).c_str(), TraceTrack::kCompute, wait_begin,
          wait_end);
    // In flight from when it started (after the collectives queued before
    // it on the same communicator) to completion.
    const std::optional<absl::Time> completed = work->CompletedAt();
    const int64_t end = completed     ? absl::ToUnixNanos(*completed)
                        : done_before ? wait_begin
                                      : wait_end;
    const int64_t ran = static_cast<int64_t>(work->ElapsedSeconds() * 1e9);
    Trace(what, track, std::max(issued_ns, end - ran), end);
  }
  work.reset();
}

void UnitGroup::Trace(const char* name, TraceTrack track, int64_t begin_ns,
                      int64_t end_ns) const {
  if (core_->trace == nullptr) return;
  core_->trace->Add(TraceSpan{name, name_, track, core_->microbatch, begin_ns,
                              std::max(begin_ns, end_ns)});
}

void UnitGroup::Unshard() {
  if (state_ != State::kSharded) return;
  // Backward (not a recompute inside it) does not need this unit's values.
  if (!unshard_in_backward_ && core_->pass.callback_queued &&
      core_->recompute_depth == 0)
    return;
  if (params_.empty() || aliases_shard_) {  // nothing to gather
    state_ = State::kUnsharded;
    return;
  }
  core_->CheckOk();
  FillReplicated();
  if (sharded_.empty()) {  // replicated parameters only: nothing to gather
    state_ = State::kUnsharded;
    return;
  }
  IssueAllGather();
}

bool UnitGroup::UseSegments() const {
  return core_->shard_size() > 1 && core_->mesh.shard->SupportsSegments();
}

void UnitGroup::AllocUnsharded(const std::vector<ShardedParam*>& params) {
  for (ShardedParam* p : params) {
    if (p->unsharded_allocated()) continue;
    p->AllocUnsharded();
    stats_.unsharded_bytes_alive += p->unsharded_bytes();
    core_->memory.AddUnsharded(p->unsharded_bytes());
  }
  stats_.peak_unsharded_bytes =
      std::max(stats_.peak_unsharded_bytes, stats_.unsharded_bytes_alive);
}

void UnitGroup::FillReplicated() {
  at::NoGradGuard no_grad;
  AllocUnsharded(replicated_);
  for (ShardedParam* p : replicated_) {
    // The whole parameter, cast to the compute dtype on the compute device.
    if (!p->aliases_shard()) p->unsharded_padded().copy_(p->sharded_padded());
  }
}

void UnitGroup::IssueAllGather() {
  if (core_->trace != nullptr)
    all_gather_.issued_ns = TraceRecorder::NowNanos();
  const at::TensorOptions options =
      at::TensorOptions().dtype(compute_dtype_).device(core_->options.device);
  ++stats_.all_gathers;
  if (UseSegments()) {
    // The peers' pieces are received straight into the unsharded storage.
    AllocUnsharded(sharded_);
    Check(StartAllGatherSegments(sharded_, *core_->mesh.shard, core_->buffers,
                                 options, all_gather_));
    core_->SampleTransientBytes();
  } else {
    Check(StartAllGatherFlat(sharded_, *core_->mesh.shard, core_->buffers,
                             options, all_gather_));
  }
  state_ = State::kGathering;
}

void UnitGroup::WaitForUnshard() {
  if (state_ == State::kSharded) Unshard();
  if (state_ != State::kGathering) return;
  if (all_gather_.work) {
    WaitWork(all_gather_.work, &stats_.all_gather_seconds, "all-gather",
             all_gather_.issued_ns, TraceTrack::kShardComm);
  }
  AllocUnsharded(sharded_);
  if (all_gather_.output.defined()) {  // flat path
    AllGatherCopyOut(all_gather_.output, sharded_);
    core_->SampleTransientBytes();
    core_->buffers.Release(all_gather_.output);
  }
  core_->buffers.Release(all_gather_.input);
  state_ = State::kUnsharded;
}

void UnitGroup::Reshard() {
  if (state_ == State::kGathering) WaitForUnshard();
  if (state_ != State::kUnsharded) return;
  for (ShardedParam* p : params()) {
    if (p->unsharded_allocated()) {
      p->FreeUnsharded();
      stats_.unsharded_bytes_alive -= p->unsharded_bytes();
      core_->memory.AddUnsharded(-p->unsharded_bytes());
    }
  }
  state_ = State::kSharded;
}

void UnitGroup::PreForward() {
  core_->CheckOk();
  if (core_->recompute_depth == 0) {
    // A unit skipped when a later one was entered, entered now: the forward
    // runs units out of their declared order. A usage error, not a collective
    // one: thrown without the sticky status (fully_shard.h, "Errors").
    TORCH_CHECK(!skipped, kUsageErrorPrefix, "unit ", name_,
                " was entered after unit ",
                core_->units[std::max(core_->pass.max_entered, 0)]->name(),
                ": a forward enters units in the order they were declared "
                "(FullyShard order; a unit may be skipped, or entered again "
                "after it ran)");
    if (!forwarded) core_->BeforeFirstEntry(index_);
  }
  if (core_->trace != nullptr) forward_begin_ns_ = TraceRecorder::NowNanos();
  if (index_ == 0 && core_->recompute_depth == 0) core_->BeginForwardMeasure();
  Unshard();
  // No forward prefetch while recomputing inside backward: the next units'
  // gathers would be wasted (backward runs in the other direction).
  if (core_->recompute_depth == 0) {
    for (int j : forward_prefetch) core_->units[j]->Unshard();
  }
  WaitForUnshard();
  forwarded = true;
  if (core_->recompute_depth == 0) ++forward_calls;
}

void UnitGroup::PostForward() {
  if (core_->recompute_depth == 0) {
    if (index_ == 0) {
      core_->CompleteForward();
      core_->EndForwardMeasure();
    }
    last_exit = core_->pass.exits++;
  }
  if (reshard_after_forward && core_->recompute_depth == 0) Reshard();
  if (core_->trace != nullptr) {
    Trace(core_->recompute_depth > 0 ? "recompute" : "forward",
          TraceTrack::kCompute, forward_begin_ns_, TraceRecorder::NowNanos());
  }
}

void UnitGroup::SkipForward() {
  PreForward();
  PostForward();
  skipped = true;
}

void UnitGroup::PreBackward() {
  core_->QueueEndOfBackwardOnce();
  core_->CompleteForward();
  // A unit entered several times: the later calls' outputs find it unsharded
  // (nothing reshards it before its last post-backward).
  if (pre_backward_done) return;
  pre_backward_done = true;
  core_->FinishUnreachedAfter(last_exit);
  if (core_->trace != nullptr) backward_begin_ns_ = TraceRecorder::NowNanos();
  // An all-gather issued now queues behind the previous unit's reduce-scatter
  // on the same communicator anyway: finish that first, so its flat buffers
  // are reused instead of both sets being alive (a prefetched unit keeps the
  // overlap).
  if (state_ == State::kSharded) core_->FinishPendingReductions();
  Unshard();
  for (int j : backward_prefetch) core_->units[j]->Unshard();
  WaitForUnshard();
}

void UnitGroup::PostBackward() {
  if (post_backward_done) return;
  // One hook per call: the gradients of all calls accumulate in the unsharded
  // parameters and are reduced once, after the last.
  if (++backward_calls < forward_calls) return;
  FinishBackward();
}

void UnitGroup::FinishBackward() {
  if (post_backward_done) return;
  post_backward_done = true;
  if (core_->trace != nullptr) {
    // From this unit's pre-backward to its gradients being ready.
    Trace("backward", TraceTrack::kCompute,
          pre_backward_done ? backward_begin_ns_ : TraceRecorder::NowNanos(),
          TraceRecorder::NowNanos());
  }
  // At most one reduction in flight: bounds the flat gradient buffers alive at
  // once.
  core_->FinishPendingReductions();
  core_->SampleUnshardedGradBytes();
  // Reshard first: backward through the unit is over, so its unsharded
  // parameters are not alive next to the gradients and the flat reduction
  // buffer.
  if (reshard_after_backward || core_->is_last_backward) Reshard();
  if (grad_accumulation_dtype_ != compute_dtype_) {
    // This backward's gradients join the step's main gradients, which the
    // reduction (now or at a later microbatch) reads.
    for (ShardedParam* p : params())
      p->FoldIntoMainGrad(grad_accumulation_dtype_);
  }
  if (core_->requires_grad_sync && !params_.empty()) IssueReduction();
}

void UnitGroup::IssueReduction() {
  core_->CheckOk();
  if (core_->shard_size() == 1 && core_->replicate_size() == 1) {
    // Nothing to reduce with: the gradients themselves, in reduce_dtype, are
    // the reduced shards (no flat buffer, no copy when the dtypes agree).
    ++stats_.reduce_scatters;
    step_.direct_grads.assign(params_.size(), at::Tensor());
    for (size_t i = 0; i < params_.size(); ++i) {
      const at::Tensor g = params_[i]->unsharded_grad();
      if (!g.defined()) continue;
      step_.direct_grads[i] = g.to(reduce_dtype_);
      if (const std::optional<double> scale = core_->reduced_grad_scale())
        step_.direct_grads[i] = step_.direct_grads[i].mul(*scale);
      params_[i]->ClearUnshardedGrad();
    }
  } else {
    if (!sharded_.empty()) IssueReduceScatter();
    if (!replicated_.empty()) IssueReplicatedAllReduce();
  }
  step_.all_reduce = core_->requires_all_reduce;
  step_.pending = true;
  core_->pending_reductions.push_back(this);
}

void UnitGroup::IssueReduceScatter() {
  ++stats_.reduce_scatters;
  if (core_->trace != nullptr)
    reduce_scatter_.issued_ns = TraceRecorder::NowNanos();
  const at::TensorOptions options =
      at::TensorOptions().dtype(reduce_dtype_).device(core_->options.device);
  if (UseSegments()) {
    Check(PrepareReduceScatterSegments(
        sharded_, *core_->mesh.shard, core_->buffers, options,
        /*in_place=*/core_->replicate_size() == 1, reduce_scatter_));
    for (ShardedParam* p : sharded_) p->ClearUnshardedGrad();
    core_->memory.in_flight_grad_bytes += reduce_scatter_.grad_bytes;
    core_->SampleTransientBytes();
  } else {
    Check(PrepareReduceScatterFlat(sharded_, core_->shard_size(),
                                   core_->buffers, options, reduce_scatter_));
    core_->SampleTransientBytes();
    for (ShardedParam* p : sharded_) p->ClearUnshardedGrad();
  }
  Check(StartReduceScatter(*core_->mesh.shard, core_->collective_reduce_op(),
                           reduce_scatter_));
}

void UnitGroup::IssueReplicatedAllReduce() {
  const at::TensorOptions options =
      at::TensorOptions().dtype(reduce_dtype_).device(core_->options.device);
  Check(PrepareReplicatedAllReduce(replicated_, core_->buffers, options,
                                   replicated_all_reduce_));
  core_->SampleTransientBytes();
  for (ShardedParam* p : replicated_) p->ClearUnshardedGrad();
  if (core_->shard_size() == 1) return;
  absl::StatusOr<comm::Buffer> buffer = ToBuffer(replicated_all_reduce_.buffer);
  Check(buffer.status());
  ++stats_.all_reduces;
  if (core_->trace != nullptr)
    replicated_all_reduce_.issued_ns = TraceRecorder::NowNanos();
  replicated_all_reduce_.work =
      core_->mesh.shard->AllReduce(*buffer, core_->collective_reduce_op());
}

void UnitGroup::FinishReduction() {
  if (!step_.pending) return;
  step_.pending = false;
  if (!step_.direct_grads.empty()) {
    for (size_t i = 0; i < params_.size(); ++i) {
      at::Tensor& g = step_.direct_grads[i];
      if (g.defined()) {
        params_[i]->AccumulateShardedGrad(params_[i]->ToFrame(std::move(g)),
                                          /*may_steal=*/true);
      }
    }
    step_.direct_grads.clear();
    return;
  }
  if (!sharded_.empty()) FinishReduceScatter();
  if (!replicated_.empty()) FinishReplicatedAllReduce();
}

void UnitGroup::FinishReduceScatter() {
  ReduceScatterState& rs = reduce_scatter_;
  if (rs.work) {
    WaitWork(rs.work, &stats_.reduce_scatter_seconds, "reduce-scatter",
             rs.issued_ns, TraceTrack::kShardComm);
  }
  if (!rs.in_place) ReleaseSentGradients();
  if (rs.in_place) {
    // Each gradient's own rows now hold this rank's reduced shard, zeros that
    // stood in for a missing gradient included: another rank may have had one.
    const std::optional<double> scale = core_->reduced_grad_scale();
    for (size_t i = 0; i < sharded_.size(); ++i) {
      ShardedParam* p = sharded_[i];
      if (!p->sharded().requires_grad()) continue;
      at::Tensor rows = rs.grads[i].narrow(0, p->row_offset(), p->valid_rows());
      if (scale.has_value()) rows.mul_(*scale);
      p->AccumulateShardedGrad(rows);
    }
    AddReducedFlags(step_.grad_flags, rs.flags[core_->shard_rank()]);
    ReleaseReductionBuffers();
    return;
  }
  // With one shard the input is already the (trivially) reduced chunk.
  const at::Tensor reduced = rs.output.defined() ? rs.output : rs.input;
  at::NoGradGuard no_grad;
  if (core_->replicate_size() > 1 &&
      !ReduceAcrossReplicas(reduced, step_.held)) {
    ReleaseReductionBuffers();
    return;
  }
  if (const std::optional<double> scale = core_->reduced_grad_scale())
    reduced.mul_(*scale);  // the flags stay positive where they were
  {
    const std::vector<at::Tensor> pieces = SplitReducedChunk(reduced, sharded_);
    for (size_t i = 0; i < sharded_.size(); ++i) {
      if (sharded_[i]->sharded().requires_grad())
        sharded_[i]->AccumulateShardedGrad(pieces[i]);
    }
    AddReducedFlags(step_.grad_flags,
                    reduced.narrow(0, FlatChunkNumel(sharded_),
                                   static_cast<int64_t>(sharded_.size())));
  }  // the pieces (views of `reduced`) go before the buffers return
  ReleaseReductionBuffers();
}

bool UnitGroup::ReduceAcrossReplicas(const at::Tensor& reduced,
                                     at::Tensor& held) {
  at::NoGradGuard no_grad;
  if (!step_.all_reduce) {
    // HSDP without all-reduce this microbatch: hold the shard-reduced sums
    // until one with.
    if (held.defined()) {
      held.add_(reduced);
    } else {
      held = reduced.clone();
    }
    return false;
  }
  if (held.defined()) {
    reduced.add_(held);
    held.reset();
  }
  absl::StatusOr<comm::Buffer> buffer = ToBuffer(reduced);
  Check(buffer.status());
  ++stats_.all_reduces;
  const int64_t issued = core_->trace ? TraceRecorder::NowNanos() : 0;
  std::unique_ptr<comm::Work> work =
      core_->mesh.replicate->AllReduce(*buffer, core_->collective_reduce_op());
  WaitWork(work, &stats_.all_reduce_seconds, "all-reduce", issued,
           TraceTrack::kReplicateComm);
  return true;
}

void UnitGroup::FinishReplicatedAllReduce() {
  ReplicatedAllReduceState& ar = replicated_all_reduce_;
  if (ar.work) {
    WaitWork(ar.work, &stats_.all_reduce_seconds, "all-reduce", ar.issued_ns,
             TraceTrack::kShardComm);
  }
  at::NoGradGuard no_grad;
  if (core_->replicate_size() > 1 &&
      !ReduceAcrossReplicas(ar.buffer, step_.replicated_held)) {
    core_->buffers.Release(ar.buffer);
    return;
  }
  if (const std::optional<double> scale = core_->reduced_grad_scale())
    ar.buffer.mul_(*scale);
  int64_t offset = 0;
  for (ShardedParam* p : replicated_) {
    if (p->sharded().requires_grad()) {
      p->AccumulateShardedGrad(
          ar.buffer.narrow(0, offset, p->numel()).view(p->frame_shape()));
    }
    offset += p->numel();
  }
  AddReducedFlags(
      step_.replicated_flags,
      ar.buffer.narrow(0, offset, static_cast<int64_t>(replicated_.size())));
  core_->buffers.Release(ar.buffer);
}

void UnitGroup::ReleaseSentGradients() {
  ReduceScatterState& rs = reduce_scatter_;
  rs.grads.clear();
  core_->memory.in_flight_grad_bytes -= rs.grad_bytes;
  rs.grad_bytes = 0;
}

void UnitGroup::ReleaseReductionBuffers() {
  ReduceScatterState& rs = reduce_scatter_;
  ReleaseSentGradients();
  rs.in_place = false;
  rs.segments = false;
  if (rs.input.defined()) {
    rs.output.reset();  // a view of the input: drop it before the pool checks
    core_->buffers.Release(rs.input);
  } else {  // segments path: pool buffers of their own (if any)
    core_->buffers.Release(rs.output);
  }
  core_->buffers.Release(rs.scratch);
  rs.flags.reset();
}

void UnitGroup::AddReducedFlags(at::Tensor& sum, const at::Tensor& flags) {
  at::NoGradGuard no_grad;
  if (sum.defined()) {
    sum.add_(flags);
  } else {
    sum = flags.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
  }
}

void UnitGroup::ResolveUnusedGrads() {
  ResolveUnusedGrads(sharded_, step_.grad_flags);
  ResolveUnusedGrads(replicated_, step_.replicated_flags);
}

void UnitGroup::ResolveUnusedGrads(const std::vector<ShardedParam*>& params,
                                   at::Tensor& sum) {
  if (!sum.defined()) return;
  // One read per unit and step, after every reduction of the step finished.
  const at::Tensor flags = sum.to(c10::kCPU).contiguous();
  sum.reset();
  const float* any = flags.data_ptr<float>();
  for (size_t i = 0; i < params.size(); ++i) {
    if (any[i] > 0) continue;
    at::Tensor& grad = params[i]->sharded().mutable_grad();
    if (grad.defined()) grad.reset();
  }
}

void UnitGroup::DiscardStep() {
  // Never waited: the communicator was aborted (Abort returned OK), so no
  // collective reads or writes the buffers freed below any more.
  all_gather_.work.reset();
  core_->buffers.Release(all_gather_.output);
  core_->buffers.Release(all_gather_.input);
  reduce_scatter_.work.reset();
  ReleaseReductionBuffers();
  reduce_scatter_.input.reset();
  reduce_scatter_.output.reset();
  replicated_all_reduce_.work.reset();
  core_->buffers.Release(replicated_all_reduce_.buffer);
  step_ = StepReduction();
  for (ShardedParam* p : params()) {
    p->ClearUnshardedGrad();
    if (p->unsharded_allocated() && !p->aliases_shard()) {
      p->FreeUnsharded();
      stats_.unsharded_bytes_alive -= p->unsharded_bytes();
      core_->memory.AddUnsharded(-p->unsharded_bytes());
    }
    // The failed step's partial gradient must not reach the next step.
    if (p->sharded().grad().defined()) p->sharded().mutable_grad().reset();
  }
  state_ = State::kSharded;
  forwarded = false;
  pre_backward_done = false;
  post_backward_done = false;
  forward_calls = 0;
  backward_calls = 0;
  last_exit = -1;
  skipped = false;
}

int64_t UnitGroup::FlatBufferBytes() const {
  const int64_t chunk = ReductionChunkNumel(sharded_);
  const int64_t elem = static_cast<int64_t>(std::max(
      c10::elementSize(compute_dtype_), c10::elementSize(reduce_dtype_)));
  int64_t replicated = 0;
  for (const ShardedParam* p : replicated_) replicated += p->numel() + 1;
  // One gathered / to-be-reduced buffer of S chunks (collectives in place),
  // and the replicated parameters' gradients with their flags.
  return (core_->shard_size() * chunk + replicated) * elem;
}

UnitInfo UnitGroup::Info() const {
  std::vector<std::pair<std::string, at::Tensor>> params;
  for (const auto& p : params_) {
    // A meta tensor of the parameter's global shape and master dtype: what
    // DescribeUnit sees before sharding.
    params.emplace_back(
        p->fqn(),
        at::empty(p->global_shape(), at::TensorOptions()
                                         .dtype(p->sharded().scalar_type())
                                         .device(c10::kMeta)));
  }
  std::map<std::string, ParamPlacement> placements;
  for (const auto& p : params_) placements[p->fqn()] = p->spec().placement;
  return DescribeUnit(
      name_, params, core_->options, core_->shard_size(),
      [&placements](const std::string& fqn, const at::Tensor&) {
        return std::optional<ParamPlacement>(placements.at(fqn));
      });
}

UnitStats UnitGroup::Stats() const {
  UnitStats s = stats_;
  s.grad_bytes = 0;
  for (const auto& p : params_) s.grad_bytes += p->grad_bytes();
  return s;
}

void UnitGroup::ResetStats() {
  const UnitStats old = stats_;
  stats_ = UnitStats();
  stats_.sharded_bytes = old.sharded_bytes;
  stats_.unsharded_bytes_alive = old.unsharded_bytes_alive;
  stats_.peak_unsharded_bytes = old.unsharded_bytes_alive;
}

}  // namespace hsdp::fsdp
