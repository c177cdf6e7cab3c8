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
                         const char* what, int64_t issued_ns, SpanTrack track) {
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
    Trace(absl::StrCat("wait ", what).c_str(), SpanTrack::kCompute, wait_begin,
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

void UnitGroup::Trace(const char* name, SpanTrack track, int64_t begin_ns,
                      int64_t end_ns) const {
  if (core_->trace == nullptr) return;
  core_->trace->Add(RecordedSpan{name, name_, track, core_->microbatch,
                                 begin_ns, std::max(begin_ns, end_ns)});
}

void UnitGroup::Unshard() {
  if (state_ != State::kSharded || !PrepareGather()) return;
  if (host_shard_.defined()) {
    // Kept after forward (hierarchical reshard): gathered inside the host,
    // alone.
    IssueHostAllGather();
    return;
  }
  // Comm fusion: the peers this pass still needs go in the same all-gather
  // (the same decision on every rank: program order and the schedule only).
  std::vector<UnitGroup*> members;
  for (UnitGroup* peer : gather_peers_) {
    if (peer == this || (peer->state_ == State::kSharded &&
                         peer->NeededLaterThisPass() && peer->PrepareGather()))
      members.push_back(peer);
  }
  if (members.empty()) members.push_back(this);  // alone
  IssueAllGather(std::move(members));
}

bool UnitGroup::PrepareGather() {
  // Backward (not a recompute inside it) does not need this unit's values.
  if (!unshard_in_backward_ && core_->pass.callback_queued &&
      core_->recompute_depth == 0)
    return false;
  if (params_.empty() || aliases_shard_) {  // nothing to gather
    state_ = State::kUnsharded;
    return false;
  }
  core_->CheckOk();
  FillReplicated();
  if (sharded_.empty()) {  // replicated parameters only: nothing to gather
    state_ = State::kUnsharded;
    return false;
  }
  return true;
}

bool UnitGroup::NeededLaterThisPass() const {
  if (core_->pass.callback_queued) return forwarded && !post_backward_done;
  return !forwarded;
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

void UnitGroup::IssueAllGather(std::vector<UnitGroup*> members) {
  if (core_->trace != nullptr)
    all_gather_.issued_ns = TraceRecorder::NowNanos();
  const at::TensorOptions options =
      at::TensorOptions().dtype(compute_dtype_).device(core_->options.device);
  std::vector<ShardedParam*> params;
  for (UnitGroup* m : members) {
    params.insert(params.end(), m->sharded_.begin(), m->sharded_.end());
    m->state_ = State::kGathering;
    m->gather_issuer_ = this;
    if (m != this) ++m->stats_.fused_all_gathers;
  }
  gathered_with_ = std::move(members);
  ++stats_.all_gathers;
  if (UseSegments()) {
    // The peers' pieces are received straight into the unsharded storage.
    for (UnitGroup* m : gathered_with_) m->AllocUnsharded(m->sharded_);
    Check(StartAllGatherSegments(params, *core_->mesh.shard, core_->buffers,
                                 options, all_gather_));
    core_->SampleTransientBytes();
  } else {
    Check(StartAllGatherFlat(params, *core_->mesh.shard, core_->buffers,
                             options, all_gather_));
  }
}

void UnitGroup::IssueHostAllGather() {
  if (core_->trace != nullptr)
    all_gather_.issued_ns = TraceRecorder::NowNanos();
  state_ = State::kGathering;
  gather_issuer_ = this;
  gathered_with_ = {this};
  host_gather_ = true;
  ++stats_.host_all_gathers;
  AllocUnsharded(sharded_);
  Check(StartHostAllGather(sharded_, host_shard_, *core_->mesh.host,
                           core_->buffers, all_gather_));
  core_->SampleTransientBytes();
}

bool UnitGroup::KeepsHostShard() const {
  return core_->post_forward_group_size > 1 && core_->mesh.host != nullptr &&
         state_ == State::kUnsharded && !sharded_.empty() && !aliases_shard_ &&
         unshard_in_backward_;
}

void UnitGroup::ReshardToHost() {
  comm::Communicator& host = *core_->mesh.host;
  at::Tensor kept = at::empty(
      {HostShardNumel(sharded_, host.size())},
      at::TensorOptions().dtype(compute_dtype_).device(core_->options.device));
  CopyHostShard(sharded_, host.rank(), host.size(), kept);
  Reshard();
  host_shard_ = std::move(kept);
  const int64_t bytes = static_cast<int64_t>(host_shard_.nbytes());
  stats_.unsharded_bytes_alive += bytes;
  core_->memory.AddUnsharded(bytes);
  stats_.peak_unsharded_bytes =
      std::max(stats_.peak_unsharded_bytes, stats_.unsharded_bytes_alive);
}

void UnitGroup::DropHostShard() {
  if (!host_shard_.defined()) return;
  const int64_t bytes = static_cast<int64_t>(host_shard_.nbytes());
  stats_.unsharded_bytes_alive -= bytes;
  core_->memory.AddUnsharded(-bytes);
  host_shard_.reset();
}

void UnitGroup::WaitForUnshard() {
  if (state_ == State::kSharded) Unshard();
  if (state_ != State::kGathering) return;
  gather_issuer_->CompleteAllGather();
}

void UnitGroup::CompleteAllGather() {
  if (all_gather_.work) {
    WaitWork(all_gather_.work, &stats_.all_gather_seconds, "all-gather",
             all_gather_.issued_ns, SpanTrack::kShardComm);
  }
  std::vector<ShardedParam*> params;
  for (UnitGroup* m : gathered_with_) {
    m->AllocUnsharded(m->sharded_);
    params.insert(params.end(), m->sharded_.begin(), m->sharded_.end());
  }
  if (all_gather_.output.defined()) {  // flat path
    AllGatherCopyOut(
        all_gather_.output, params,
        host_gather_ ? core_->shard_size() / core_->mesh.host->size() : 1);
    core_->SampleTransientBytes();
    core_->buffers.Release(all_gather_.output);
  }
  core_->buffers.Release(all_gather_.input);
  for (UnitGroup* m : gathered_with_) {
    m->state_ = State::kUnsharded;
    m->gather_issuer_ = nullptr;
    // Gathered (over the host group or the shard group): the copy kept
    // after forward has served.
    m->DropHostShard();
  }
  gathered_with_.clear();
  host_gather_ = false;
}

void UnitGroup::Reshard() {
  if (state_ == State::kGathering) WaitForUnshard();
  DropHostShard();
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
  if (reshard_after_forward && core_->recompute_depth == 0) {
    if (KeepsHostShard()) {
      ReshardToHost();
    } else {
      Reshard();
    }
  }
  if (core_->trace != nullptr) {
    Trace(core_->recompute_depth > 0 ? "recompute" : "forward",
          SpanTrack::kCompute, forward_begin_ns_, TraceRecorder::NowNanos());
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
    Trace("backward", SpanTrack::kCompute,
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
  if (!core_->requires_grad_sync || params_.empty()) return;
  // Comm fusion: the peers' reduction goes out once the last of them this
  // pass runs finished its backward.
  std::vector<UnitGroup*> members;
  for (UnitGroup* peer : reduce_peers_) {
    if (!peer->forwarded) continue;
    if (!peer->post_backward_done) return;
    members.push_back(peer);
  }
  if (members.empty()) members.push_back(this);  // alone
  IssueReduction(members);
}

void UnitGroup::DiscardStep() {
  // Never waited: the communicator was aborted (Abort returned OK), so no
  // collective reads or writes the buffers freed below any more.
  all_gather_.work.reset();
  core_->buffers.Release(all_gather_.output);
  core_->buffers.Release(all_gather_.input);
  gathered_with_.clear();
  gather_issuer_ = nullptr;
  host_gather_ = false;
  DropHostShard();
  reduce_scatter_.work.reset();
  ReleaseReductionPart();
  ReleaseReductionBuffers();
  reduced_with_.clear();
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

UnitLayout UnitGroup::Info() const {
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
