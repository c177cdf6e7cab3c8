#include "worker/fsdp/unit_group.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/memory_model.h"
#include "worker/fsdp/collectives.h"
#include "worker/fsdp/hooks.h"
#include "worker/fsdp/memory_meter.h"

namespace hsdp::fsdp {

at::Tensor FlatBufferPool::Acquire(int64_t numel,
                                   const at::TensorOptions& options) {
  at::Tensor buffer;
  for (auto it = idle_buffers_.begin(); it != idle_buffers_.end(); ++it) {
    if (it->numel() == numel && it->dtype() == options.dtype() &&
        it->device() == options.device()) {
      buffer = std::move(*it);
      idle_buffers_.erase(it);
      idle_ -= static_cast<int64_t>(buffer.nbytes());
      break;
    }
  }
  if (!buffer.defined()) {
    idle_buffers_.clear();
    idle_ = 0;
    buffer = at::empty({numel}, options);
  }
  live_ += static_cast<int64_t>(buffer.nbytes());
  peak_ = std::max(peak_, bytes());
  return buffer;
}

void FlatBufferPool::Release(at::Tensor& buffer) {
  if (!buffer.defined()) return;
  const int64_t nbytes = static_cast<int64_t>(buffer.nbytes());
  live_ -= nbytes;
  // Reuse is only safe when no view of the bytes survives elsewhere.
  const bool sole_owner =
      buffer.use_count() == 1 && buffer.storage().use_count() == 1;
  if (sole_owner && nbytes <= limit_) {
    while (idle_ + nbytes > limit_ && !idle_buffers_.empty()) {
      idle_ -= static_cast<int64_t>(idle_buffers_.front().nbytes());
      idle_buffers_.erase(idle_buffers_.begin());
    }
    idle_ += nbytes;
    idle_buffers_.push_back(std::move(buffer));
  }
  buffer.reset();
}

EngineCore::EngineCore(std::shared_ptr<torch::nn::Module> root_module,
                       MeshComms mesh_comms, EngineOptions engine_options)
    : root(std::move(root_module)),
      mesh(mesh_comms),
      layout_shard_rank(mesh_comms.shard->rank()),
      layout_shard_size(mesh_comms.shard->size()),
      options(engine_options) {}

void EngineCore::Fail(const absl::Status& error) {
  if (status.ok()) status = error;
  TORCH_CHECK(false, "hsdp engine: ", status.ToString());
  __builtin_unreachable();
}

void EngineCore::CheckOk() const {
  TORCH_CHECK(status.ok(), "hsdp engine: ", status.ToString());
}

void EngineCore::AddUnshardedBytes(int64_t delta) {
  unsharded_bytes_alive += delta;
  peak_unsharded_bytes = std::max(peak_unsharded_bytes, unsharded_bytes_alive);
}

int64_t EngineCore::UnshardedGradBytes() const {
  int64_t bytes = 0;
  for (const auto& unit : units) {
    if (unit == nullptr) continue;
    for (const ShardedParam* p : unit->params()) {
      bytes += p->unsharded_grad_bytes();
    }
  }
  return bytes + in_flight_grad_bytes;
}

int64_t EngineCore::SampleUnshardedGradBytes() {
  const int64_t bytes = UnshardedGradBytes();
  peak_unsharded_grad_bytes = std::max(peak_unsharded_grad_bytes, bytes);
  return bytes;
}

void EngineCore::SampleTransientBytes() {
  const int64_t grads = SampleUnshardedGradBytes();
  const int64_t total = unsharded_bytes_alive + grads + buffers.bytes();
  if (total <= peak_transient_bytes) return;
  peak_transient_bytes = total;
  peak_transient_param_bytes = unsharded_bytes_alive;
  peak_transient_grad_bytes = grads;
  peak_transient_comm_bytes = buffers.bytes();
}

int64_t EngineCore::OwnedTransientBytes() const {
  return unsharded_bytes_alive + UnshardedGradBytes() + buffers.bytes();
}

void EngineCore::BeginForwardMeasure() {
  forward_start_meter = MeterCurrentBytes(options.device);
  if (forward_start_meter) forward_start_owned = OwnedTransientBytes();
}

void EngineCore::EndForwardMeasure() {
  if (!forward_start_meter) return;
  const std::optional<int64_t> now = MeterCurrentBytes(options.device);
  if (!now) return;
  const int64_t grown = (*now - *forward_start_meter) -
                        (OwnedTransientBytes() - forward_start_owned);
  activation_bytes = std::max(activation_bytes, grown);
  forward_start_meter.reset();
}

EngineStats EngineCore::Stats() const {
  EngineStats s;
  int64_t sharded_grads = 0;
  for (const auto& unit : units) {
    if (unit == nullptr) continue;
    UnitStats u = unit->Stats();
    s.sharded_bytes += u.sharded_bytes;
    s.unsharded_bytes_alive += u.unsharded_bytes_alive;
    s.grad_bytes += u.grad_bytes;
    s.all_gather_seconds += u.all_gather_seconds;
    s.reduce_scatter_seconds += u.reduce_scatter_seconds;
    s.all_reduce_seconds += u.all_reduce_seconds;
    s.all_gathers += u.all_gathers;
    s.reduce_scatters += u.reduce_scatters;
    s.all_reduces += u.all_reduces;
    s.units.push_back(u);
    for (const ShardedParam* p : unit->params()) {
      const at::Tensor g = p->sharded().grad();
      if (g.defined()) sharded_grads += static_cast<int64_t>(g.nbytes());
    }
  }
  s.peak_unsharded_bytes = peak_unsharded_bytes;
  s.peak_unsharded_grad_bytes = peak_unsharded_grad_bytes;
  s.comm_buffer_bytes = buffers.bytes();
  s.peak_comm_buffer_bytes = buffers.peak_bytes();
  s.peak_transient_bytes = peak_transient_bytes;
  s.peak_transient_param_bytes = peak_transient_param_bytes;
  s.peak_transient_grad_bytes = peak_transient_grad_bytes;
  s.peak_transient_comm_bytes = peak_transient_comm_bytes;
  s.activation_bytes = activation_bytes;
  s.measured_peak_bytes = MeterPeakBytes(options.device).value_or(-1);
  MemoryBreakdown& m = s.peak_memory;
  m.shards = s.sharded_bytes;
  m.optimizer_state = s.sharded_bytes * kAdamWStateCopies;
  m.sharded_grads = sharded_grads;
  m.unsharded_params = peak_transient_param_bytes;
  m.unsharded_grads = peak_transient_grad_bytes;
  m.comm_buffers = peak_transient_comm_bytes;
  m.activations = activation_bytes;
  return s;
}

void EngineCore::ResetStats() {
  for (auto& unit : units) {
    if (unit != nullptr) unit->ResetStats();
  }
  peak_unsharded_bytes = unsharded_bytes_alive;
  peak_unsharded_grad_bytes = 0;
  buffers.ResetPeak();
  peak_transient_bytes = 0;
  activation_bytes = 0;
  ResetMeterPeak(options.device);
}

void EngineCore::FinishPendingReductions() {
  std::vector<UnitGroup*> pending;
  pending.swap(pending_reductions);
  for (UnitGroup* unit : pending) unit->FinishReduction();
}

void EngineCore::QueueEndOfBackwardOnce() {
  if (callback_queued) return;
  callback_queued = true;
  QueueEndOfBackwardCallback(this);
}

void EngineCore::EndOfBackward() {
  // Reverse forward order is the order the hooks would have fired in. A unit
  // this backward never reached on this rank runs its pre-backward too, as
  // on the ranks where it was reached.
  for (auto it = units.rbegin(); it != units.rend(); ++it) {
    UnitGroup& unit = **it;
    if (!unit.forwarded || unit.post_backward_done) continue;
    if (!unit.pre_backward_done && unit.backward_calls == 0) unit.PreBackward();
    unit.FinishBackward();
  }
  FinishPendingReductions();
  if (is_last_backward) {
    for (auto& unit : units) unit->ResolveUnusedGrads();
  }
  // A gather still in flight (prefetched for a unit backward never reached)
  // reads the shards the optimizer is about to update: complete it.
  for (auto& unit : units) {
    if (unit->is_gathering()) unit->WaitForUnshard();
  }
  ResetPassFlags();
}

void EngineCore::BeforeFirstEntry(int index) {
  while (max_entered + 1 < index) units[max_entered + 1]->SkipForward();
  max_entered = index;
}

void EngineCore::CompleteForward() {
  if (forward_completed || max_entered < 0) return;
  forward_completed = true;
  while (max_entered + 1 < static_cast<int>(units.size()))
    units[max_entered + 1]->SkipForward();
}

void EngineCore::FinishUnreachedAfter(int exit) {
  std::vector<UnitGroup*> unreached;
  for (auto& unit : units) {
    if (unit->forwarded && unit->last_exit > exit && !unit->pre_backward_done &&
        !unit->post_backward_done && unit->backward_calls == 0)
      unreached.push_back(unit.get());
  }
  std::sort(unreached.begin(), unreached.end(),
            [](const UnitGroup* a, const UnitGroup* b) {
              return a->last_exit > b->last_exit;
            });
  for (UnitGroup* unit : unreached) {
    unit->PreBackward();
    unit->FinishBackward();
  }
}

void EngineCore::ResetPassFlags() {
  callback_queued = false;
  max_entered = -1;
  exits = 0;
  forward_completed = false;
  for (auto& unit : units) {
    unit->forwarded = false;
    unit->pre_backward_done = false;
    unit->post_backward_done = false;
    unit->forward_calls = 0;
    unit->backward_calls = 0;
    unit->last_exit = -1;
    unit->skipped = false;
  }
}

void EngineCore::DiscardStep() {
  for (auto& unit : units) {
    if (unit != nullptr) unit->DiscardStep();
  }
  pending_reductions.clear();
  callback_queued = false;
  max_entered = -1;
  exits = 0;
  forward_completed = false;
  recompute_depth = 0;
  checkpoint_fns.clear();
  forward_start_meter.reset();
  in_flight_grad_bytes = 0;
  status = absl::OkStatus();
}

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

absl::Status UnitGroup::WaitWork(std::unique_ptr<comm::Work>& work,
                                 double* seconds, const char* what,
                                 int64_t issued_ns, TraceTrack track) {
  TraceRecorder* const trace = core_->trace;
  const int64_t wait_begin = trace ? TraceRecorder::NowNanos() : 0;
  // Done before the wait: it ended no later than now.
  const bool done_before = trace && work->IsCompleted();
  absl::Status s = work->Wait();
  if (!s.ok()) {
    return absl::Status(
        s.code(), absl::StrCat(what, " of unit ", name_, ": ", s.message()));
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
  return absl::OkStatus();
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
  if (!unshard_in_backward_ && core_->callback_queued &&
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
  if (core_->trace != nullptr) ag_issued_ns_ = TraceRecorder::NowNanos();
  if (UseSegments()) {
    IssueAllGatherSegments();
    return;
  }
  const at::TensorOptions options =
      at::TensorOptions().dtype(compute_dtype_).device(core_->options.device);
  // In place: this rank's chunk is copied into its slot of the gathered
  // buffer, so a unit needs one flat buffer, not two.
  const int64_t chunk = FlatChunkNumel(sharded_);
  ag_output_ = core_->buffers.Acquire(chunk * core_->shard_size(), options);
  const at::Tensor own =
      ag_output_.narrow(0, chunk * core_->shard_rank(), chunk);
  AllGatherCopyIn(sharded_, own);
  ++stats_.all_gathers;
  if (core_->shard_size() > 1) {
    absl::StatusOr<comm::Buffer> in = ToBuffer(own);
    absl::StatusOr<comm::Buffer> out = ToBuffer(ag_output_);
    if (!in.ok()) core_->Fail(in.status());
    if (!out.ok()) core_->Fail(out.status());
    ag_work_ = core_->mesh.shard->AllGather(*in, *out);
  }
  state_ = State::kGathering;
}

bool UnitGroup::UseSegments() const {
  return core_->shard_size() > 1 && core_->mesh.shard->SupportsSegments();
}

void UnitGroup::FillReplicated() {
  at::NoGradGuard no_grad;
  for (ShardedParam* p : replicated_) {
    if (p->aliases_shard()) continue;
    if (!p->unsharded_allocated()) {
      p->AllocUnsharded();
      stats_.unsharded_bytes_alive += p->unsharded_bytes();
      core_->AddUnshardedBytes(p->unsharded_bytes());
    }
    // The whole parameter, cast to the compute dtype on the compute device.
    p->unsharded_padded().copy_(p->sharded_padded());
  }
}

void UnitGroup::IssueAllGatherSegments() {
  const std::vector<ShardedParam*>& ps = sharded_;
  // The peers' pieces are received straight into the unsharded storage.
  for (ShardedParam* p : ps) {
    if (!p->unsharded_allocated()) {
      p->AllocUnsharded();
      stats_.unsharded_bytes_alive += p->unsharded_bytes();
      core_->AddUnshardedBytes(p->unsharded_bytes());
    }
  }
  bool cast = false;
  for (ShardedParam* p : ps) {
    cast = cast || p->sharded_padded().scalar_type() != compute_dtype_;
  }
  if (cast) {
    // Mixed precision: the shards go out in the compute dtype.
    ag_input_ = core_->buffers.Acquire(FlatChunkNumel(ps),
                                       at::TensorOptions()
                                           .dtype(compute_dtype_)
                                           .device(core_->options.device));
    AllGatherCopyIn(ps, ag_input_);
  }
  const int size = core_->shard_size();
  std::vector<comm::Buffer> inputs;
  std::vector<std::vector<comm::Buffer>> outputs(static_cast<size_t>(size));
  int64_t offset = 0;
  for (ShardedParam* p : ps) {
    const int64_t n = p->shard_numel();
    absl::StatusOr<comm::Buffer> in =
        ToBuffer(cast ? ag_input_.narrow(0, offset, n) : p->sharded_padded());
    absl::StatusOr<comm::Buffer> out = ToBuffer(p->unsharded_padded());
    if (!in.ok()) core_->Fail(in.status());
    if (!out.ok()) core_->Fail(out.status());
    inputs.push_back(*in);
    for (int r = 0; r < size; ++r) {
      comm::Buffer piece = *out;
      piece.data = static_cast<char*>(out->data) +
                   r * n * static_cast<int64_t>(comm::ElementSize(out->dtype));
      piece.count = n;
      outputs[r].push_back(piece);
    }
    offset += n;
  }
  ++stats_.all_gathers;
  stats_.peak_unsharded_bytes =
      std::max(stats_.peak_unsharded_bytes, stats_.unsharded_bytes_alive);
  core_->SampleTransientBytes();
  ag_work_ = core_->mesh.shard->AllGatherSegments(inputs, outputs);
  state_ = State::kGathering;
}

void UnitGroup::WaitForUnshard() {
  if (state_ == State::kSharded) Unshard();
  if (state_ != State::kGathering) return;
  if (ag_work_) {
    absl::Status s =
        WaitWork(ag_work_, &stats_.all_gather_seconds, "all-gather",
                 ag_issued_ns_, TraceTrack::kShardComm);
    if (!s.ok()) core_->Fail(s);
  }
  for (ShardedParam* p : params()) {
    if (!p->unsharded_allocated()) {
      p->AllocUnsharded();
      stats_.unsharded_bytes_alive += p->unsharded_bytes();
      core_->AddUnshardedBytes(p->unsharded_bytes());
    }
  }
  stats_.peak_unsharded_bytes =
      std::max(stats_.peak_unsharded_bytes, stats_.unsharded_bytes_alive);
  if (ag_output_.defined()) {  // flat path
    AllGatherCopyOut(ag_output_, sharded_);
    core_->SampleTransientBytes();
    core_->buffers.Release(ag_output_);
  }
  core_->buffers.Release(ag_input_);
  state_ = State::kUnsharded;
}

void UnitGroup::Reshard() {
  if (state_ == State::kGathering) WaitForUnshard();
  if (state_ != State::kUnsharded) return;
  for (ShardedParam* p : params()) {
    if (p->unsharded_allocated()) {
      p->FreeUnsharded();
      stats_.unsharded_bytes_alive -= p->unsharded_bytes();
      core_->AddUnshardedBytes(-p->unsharded_bytes());
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
                core_->units[std::max(core_->max_entered, 0)]->name(),
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
    last_exit = core_->exits++;
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
  if (!sharded_.empty()) ++stats_.reduce_scatters;
  if (core_->trace != nullptr) rs_issued_ns_ = TraceRecorder::NowNanos();
  if (core_->shard_size() == 1 && core_->replicate_size() == 1) {
    // Nothing to reduce with: the gradients themselves, in reduce_dtype, are
    // the reduced shards (no flat buffer, no copy when the dtypes agree).
    direct_grads_.assign(params_.size(), at::Tensor());
    for (size_t i = 0; i < params_.size(); ++i) {
      const at::Tensor g = params_[i]->unsharded_grad();
      if (!g.defined()) continue;
      direct_grads_[i] = g.to(reduce_dtype_);
      if (const std::optional<double> scale = core_->reduced_grad_scale())
        direct_grads_[i] = direct_grads_[i].mul(*scale);
      params_[i]->ClearUnshardedGrad();
    }
    reduction_pending_ = true;
    core_->pending_reductions.push_back(this);
    return;
  }
  if (!sharded_.empty()) {
    if (UseSegments()) {
      IssueReduceScatterSegments();
    } else {
      IssueReduceScatterFlat();
    }
  }
  if (!replicated_.empty()) IssueReplicatedAllReduce();
  rs_all_reduce_ = core_->requires_all_reduce;
  reduction_pending_ = true;
  core_->pending_reductions.push_back(this);
}

void UnitGroup::IssueReduceScatterFlat() {
  const at::TensorOptions options =
      at::TensorOptions().dtype(reduce_dtype_).device(core_->options.device);
  const int64_t chunk = ReductionChunkNumel();
  rs_input_ = core_->buffers.Acquire(chunk * core_->shard_size(), options);
  ReduceScatterCopyIn(sharded_, rs_input_);
  {
    // Every rank's chunk carries this rank's flags in its tail.
    at::NoGradGuard no_grad;
    const int64_t grads = FlatChunkNumel(sharded_);
    const at::Tensor flags = rs_input_.view({core_->shard_size(), chunk})
                                 .narrow(1, grads, chunk - grads);
    FillGradFlags(sharded_, flags[0]);
    for (int r = 1; r < core_->shard_size(); ++r) flags[r].copy_(flags[0]);
  }
  core_->SampleTransientBytes();
  for (ShardedParam* p : sharded_) p->ClearUnshardedGrad();
  if (core_->shard_size() > 1) {
    // In place: the reduced chunk lands in this rank's slot of the input.
    rs_output_ = rs_input_.narrow(0, chunk * core_->shard_rank(), chunk);
    absl::StatusOr<comm::Buffer> in = ToBuffer(rs_input_);
    absl::StatusOr<comm::Buffer> out = ToBuffer(rs_output_);
    if (!in.ok()) core_->Fail(in.status());
    if (!out.ok()) core_->Fail(out.status());
    rs_work_ = core_->mesh.shard->ReduceScatter(*in, *out,
                                                core_->collective_reduce_op());
  }
}

void UnitGroup::IssueReplicatedAllReduce() {
  // One flat buffer: every replicated gradient (zeros where this rank has
  // none), then one flag per parameter, all-reduced over the shard group
  // now and over the replicate group when the reduction finishes.
  at::NoGradGuard no_grad;
  int64_t numel = 0;
  for (const ShardedParam* p : replicated_) numel += p->numel();
  const int64_t num_flags = static_cast<int64_t>(replicated_.size());
  rp_buffer_ = core_->buffers.Acquire(
      numel + num_flags,
      at::TensorOptions().dtype(reduce_dtype_).device(core_->options.device));
  int64_t offset = 0;
  for (ShardedParam* p : replicated_) {
    at::Tensor dst = rp_buffer_.narrow(0, offset, p->numel());
    const at::Tensor g = p->unsharded_grad_rows();
    if (g.defined()) {
      dst.copy_(g.reshape({-1}));
    } else {
      dst.zero_();
    }
    offset += p->numel();
  }
  FillGradFlags(replicated_, rp_buffer_.narrow(0, numel, num_flags));
  core_->SampleTransientBytes();
  for (ShardedParam* p : replicated_) p->ClearUnshardedGrad();
  if (core_->shard_size() > 1) {
    absl::StatusOr<comm::Buffer> buffer = ToBuffer(rp_buffer_);
    if (!buffer.ok()) core_->Fail(buffer.status());
    ++stats_.all_reduces;
    rp_issued_ns_ = core_->trace ? TraceRecorder::NowNanos() : 0;
    rp_work_ =
        core_->mesh.shard->AllReduce(*buffer, core_->collective_reduce_op());
  }
}

void UnitGroup::IssueReduceScatterSegments() {
  const std::vector<ShardedParam*>& ps = sharded_;
  const int size = core_->shard_size();
  const int rank = core_->shard_rank();
  const at::TensorOptions options =
      at::TensorOptions().dtype(reduce_dtype_).device(core_->options.device);
  const int64_t chunk = ReductionChunkNumel();
  const int64_t num_flags = static_cast<int64_t>(ps.size());
  // Without replicas the sum lands in place, in this rank's own rows of each
  // gradient (no output buffer). HSDP all-reduces one flat chunk, so there the
  // sum goes to a chunk in the flat path's padded layout. Either way, room for
  // the peers' contributions if the backend receives them before summing.
  rs_in_place_ = core_->replicate_size() == 1;
  if (!rs_in_place_) rs_output_ = core_->buffers.Acquire(chunk, options);
  // The flags go to every rank as one more segment (a copy per rank, since
  // this rank's copy also receives the sum in place).
  rs_flags_ = at::empty({size, num_flags}, options);
  FillGradFlags(ps, rs_flags_[0]);
  for (int r = 1; r < size; ++r) rs_flags_[r].copy_(rs_flags_[0]);
  const int64_t scratch_count =
      core_->mesh.shard->ReduceScatterScratchCount(chunk);
  if (scratch_count > 0) {
    rs_scratch_ = core_->buffers.Acquire(scratch_count, options);
  }
  rs_grads_.clear();
  std::vector<std::vector<comm::Buffer>> inputs(static_cast<size_t>(size));
  std::vector<comm::Buffer> outputs;
  at::NoGradGuard no_grad;
  int64_t offset = 0;
  for (size_t i = 0; i < ps.size(); ++i) {
    ShardedParam* p = ps[i];
    at::Tensor g = p->unsharded_grad_rows();
    if (g.defined()) {
      // In reduce_dtype and contiguous in the row frame; a no-op in the common
      // case.
      g = g.to(reduce_dtype_).contiguous();
    } else {
      // Every rank contributes to every segment: zeros stand in.
      g = at::zeros(p->frame_shape(), options);
    }
    rs_grads_.push_back(g);
    absl::StatusOr<comm::Buffer> whole = ToBuffer(g);
    if (!whole.ok()) core_->Fail(whole.status());
    const int64_t row_bytes =
        p->row_numel() * static_cast<int64_t>(comm::ElementSize(whole->dtype));
    for (int r = 0; r < size; ++r) {
      const int64_t begin = r * p->padded_rows_per_rank();
      const int64_t rows =
          std::clamp<int64_t>(p->rows() - begin, 0, p->padded_rows_per_rank());
      inputs[r].push_back(
          comm::Buffer{static_cast<char*>(whole->data) + begin * row_bytes,
                       rows * p->row_numel(), whole->dtype});
      if (r == rank && rs_in_place_) {
        outputs.push_back(inputs[r].back());
      } else if (r == rank) {
        const int64_t valid = rows * p->row_numel();
        absl::StatusOr<comm::Buffer> out =
            ToBuffer(rs_output_.narrow(0, offset, valid));
        if (!out.ok()) core_->Fail(out.status());
        outputs.push_back(*out);
        // Padding rows stay zero (the HSDP all-reduce reads the whole chunk).
        if (valid < p->shard_numel()) {
          rs_output_.narrow(0, offset + valid, p->shard_numel() - valid)
              .zero_();
        }
      }
    }
    offset += p->shard_numel();
  }
  for (int r = 0; r < size; ++r) {
    absl::StatusOr<comm::Buffer> flags = ToBuffer(rs_flags_[r]);
    if (!flags.ok()) core_->Fail(flags.status());
    inputs[r].push_back(*flags);
  }
  if (rs_in_place_) {
    outputs.push_back(inputs[rank].back());
  } else {
    absl::StatusOr<comm::Buffer> out =
        ToBuffer(rs_output_.narrow(0, offset, num_flags));
    if (!out.ok()) core_->Fail(out.status());
    outputs.push_back(*out);
  }
  for (ShardedParam* p : ps) p->ClearUnshardedGrad();
  rs_grad_bytes_ = 0;
  for (const at::Tensor& g : rs_grads_)
    rs_grad_bytes_ += static_cast<int64_t>(g.nbytes());
  core_->in_flight_grad_bytes += rs_grad_bytes_;
  core_->SampleTransientBytes();
  comm::Buffer scratch{
      nullptr, 0,
      outputs.empty() ? comm::DataType::kFloat32 : outputs[0].dtype};
  if (rs_scratch_.defined()) {
    absl::StatusOr<comm::Buffer> b = ToBuffer(rs_scratch_);
    if (!b.ok()) core_->Fail(b.status());
    scratch = *b;
  }
  rs_work_ = core_->mesh.shard->ReduceScatterSegments(
      inputs, outputs, scratch, core_->collective_reduce_op());
}

void UnitGroup::FinishReduction() {
  if (!reduction_pending_) return;
  reduction_pending_ = false;
  if (!direct_grads_.empty()) {
    for (size_t i = 0; i < params_.size(); ++i) {
      if (direct_grads_[i].defined()) {
        params_[i]->AccumulateShardedGrad(
            params_[i]->ToFrame(std::move(direct_grads_[i])),
            /*may_steal=*/true);
      }
    }
    direct_grads_.clear();
    return;
  }
  if (!sharded_.empty()) FinishReduceScatter();
  if (!replicated_.empty()) FinishReplicatedAllReduce();
}

void UnitGroup::FinishReduceScatter() {
  if (rs_work_) {
    absl::Status s =
        WaitWork(rs_work_, &stats_.reduce_scatter_seconds, "reduce-scatter",
                 rs_issued_ns_, TraceTrack::kShardComm);
    if (!s.ok()) core_->Fail(s);
  }
  if (rs_in_place_) {
    // Each gradient's own rows now hold this rank's reduced shard, zeros that
    // stood in for a missing gradient included: another rank may have had one.
    const std::vector<ShardedParam*>& ps = sharded_;
    const std::optional<double> scale = core_->reduced_grad_scale();
    for (size_t i = 0; i < ps.size(); ++i) {
      if (!ps[i]->sharded().requires_grad()) continue;
      at::Tensor rows =
          rs_grads_[i].narrow(0, ps[i]->row_offset(), ps[i]->valid_rows());
      if (scale.has_value()) rows.mul_(*scale);
      ps[i]->AccumulateShardedGrad(rows);
    }
    AddReducedFlags(grad_flags_, rs_flags_[core_->shard_rank()]);
  }
  // The segments path is done reading the gradients.
  rs_grads_.clear();
  core_->in_flight_grad_bytes -= rs_grad_bytes_;
  rs_grad_bytes_ = 0;
  if (rs_in_place_) {
    rs_in_place_ = false;
    ReleaseReductionBuffers();
    return;
  }
  // With one shard the input is already the (trivially) reduced chunk.
  at::Tensor& reduced = rs_output_.defined() ? rs_output_ : rs_input_;
  at::NoGradGuard no_grad;
  if (core_->replicate_size() > 1) {
    if (!rs_all_reduce_) {
      // HSDP without all-reduce this microbatch: hold the shard-reduced grads
      // until one with.
      HoldPartial(reduced, partial_reduce_);
      ReleaseReductionBuffers();
      return;
    }
    AllReduceReplicas(reduced, partial_reduce_);
  }
  if (const std::optional<double> scale = core_->reduced_grad_scale())
    reduced.mul_(*scale);  // the flags stay positive where they were
  {
    const std::vector<ShardedParam*>& ps = sharded_;
    const std::vector<at::Tensor> pieces = SplitReducedChunk(reduced, ps);
    for (size_t i = 0; i < ps.size(); ++i) {
      if (ps[i]->sharded().requires_grad())
        ps[i]->AccumulateShardedGrad(pieces[i]);
    }
    AddReducedFlags(
        grad_flags_,
        reduced.narrow(0, FlatChunkNumel(ps), static_cast<int64_t>(ps.size())));
  }  // the pieces (views of `reduced`) go before the buffers return
  ReleaseReductionBuffers();
}

void UnitGroup::HoldPartial(const at::Tensor& reduced, at::Tensor& partial) {
  at::NoGradGuard no_grad;
  if (partial.defined()) {
    partial.add_(reduced);
  } else {
    partial = reduced.clone();
  }
}

void UnitGroup::AllReduceReplicas(const at::Tensor& reduced,
                                  at::Tensor& partial) {
  at::NoGradGuard no_grad;
  if (partial.defined()) {
    reduced.add_(partial);
    partial.reset();
  }
  absl::StatusOr<comm::Buffer> buffer = ToBuffer(reduced);
  if (!buffer.ok()) core_->Fail(buffer.status());
  ++stats_.all_reduces;
  const int64_t issued = core_->trace ? TraceRecorder::NowNanos() : 0;
  std::unique_ptr<comm::Work> work =
      core_->mesh.replicate->AllReduce(*buffer, core_->collective_reduce_op());
  absl::Status s = WaitWork(work, &stats_.all_reduce_seconds, "all-reduce",
                            issued, TraceTrack::kReplicateComm);
  if (!s.ok()) core_->Fail(s);
}

void UnitGroup::FinishReplicatedAllReduce() {
  if (rp_work_) {
    absl::Status s =
        WaitWork(rp_work_, &stats_.all_reduce_seconds, "all-reduce",
                 rp_issued_ns_, TraceTrack::kShardComm);
    if (!s.ok()) core_->Fail(s);
  }
  at::NoGradGuard no_grad;
  if (core_->replicate_size() > 1) {
    if (!rs_all_reduce_) {
      HoldPartial(rp_buffer_, rp_partial_);
      core_->buffers.Release(rp_buffer_);
      return;
    }
    AllReduceReplicas(rp_buffer_, rp_partial_);
  }
  if (const std::optional<double> scale = core_->reduced_grad_scale())
    rp_buffer_.mul_(*scale);
  int64_t offset = 0;
  for (ShardedParam* p : replicated_) {
    if (p->sharded().requires_grad()) {
      p->AccumulateShardedGrad(
          rp_buffer_.narrow(0, offset, p->numel()).view(p->frame_shape()));
    }
    offset += p->numel();
  }
  AddReducedFlags(
      replicated_flags_,
      rp_buffer_.narrow(0, offset, static_cast<int64_t>(replicated_.size())));
  core_->buffers.Release(rp_buffer_);
}

void UnitGroup::ReleaseReductionBuffers() {
  if (rs_input_.defined()) {
    rs_output_.reset();  // a view of rs_input_: drop it before the pool checks
    core_->buffers.Release(rs_input_);
  } else {  // segments path: pool buffers of their own (if any)
    core_->buffers.Release(rs_output_);
  }
  core_->buffers.Release(rs_scratch_);
  rs_flags_.reset();
}

int64_t UnitGroup::ReductionChunkNumel() const {
  return FlatChunkNumel(sharded_) + static_cast<int64_t>(sharded_.size());
}

void UnitGroup::FillGradFlags(const std::vector<ShardedParam*>& params,
                              const at::Tensor& flags) {
  at::NoGradGuard no_grad;
  // One host-to-device copy rather than one fill per parameter.
  std::vector<float> local(params.size());
  for (size_t i = 0; i < params.size(); ++i)
    local[i] = params[i]->unsharded_grad().defined() ? 1.0f : 0.0f;
  flags.copy_(at::from_blob(local.data(), {static_cast<int64_t>(local.size())},
                            at::TensorOptions().dtype(at::kFloat)));
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
  ResolveUnusedGrads(sharded_, grad_flags_);
  ResolveUnusedGrads(replicated_, replicated_flags_);
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
  ag_work_.reset();
  rs_work_.reset();
  rp_work_.reset();
  core_->buffers.Release(rp_buffer_);
  rp_partial_.reset();
  replicated_flags_.reset();
  core_->buffers.Release(ag_output_);
  core_->buffers.Release(ag_input_);
  ReleaseReductionBuffers();
  rs_input_.reset();
  rs_output_.reset();
  rs_grads_.clear();
  core_->in_flight_grad_bytes -= rs_grad_bytes_;
  rs_grad_bytes_ = 0;
  rs_in_place_ = false;
  rs_all_reduce_ = false;
  reduction_pending_ = false;
  partial_reduce_.reset();
  rs_flags_.reset();
  grad_flags_.reset();
  direct_grads_.clear();
  for (ShardedParam* p : params()) {
    p->ClearUnshardedGrad();
    if (p->unsharded_allocated()) {
      p->FreeUnsharded();
      stats_.unsharded_bytes_alive -= p->unsharded_bytes();
      core_->AddUnshardedBytes(-p->unsharded_bytes());
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
  const int64_t chunk = ReductionChunkNumel();
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
