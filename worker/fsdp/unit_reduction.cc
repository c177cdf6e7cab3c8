// UnitGroup's reductions (unit_group.h): after a unit's backward, its
// gradients reduce-scattered over the shard group (alone, or with its fusion
// peers in one collective), all-reduced across the replicate group in HSDP,
// and accumulated into the sharded gradients; the replicated parameters'
// all-reduces; the flags that tell a parameter no rank had a gradient for.
#include <ATen/ATen.h>

#include <optional>
#include <utility>

#include "worker/fsdp/collectives.h"
#include "worker/fsdp/unit_group.h"

namespace hsdp::fsdp {

void UnitGroup::IssueReduction(const std::vector<UnitGroup*>& members) {
  core_->CheckOk();
  if (core_->shard_size() == 1 && core_->replicate_size() == 1) {
    // Nothing to reduce with: the gradients themselves, in reduce_dtype, are
    // the reduced shards (no flat buffer, no copy when the dtypes agree). No
    // unit has fusion peers then.
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
    std::vector<UnitGroup*> scattered;
    for (UnitGroup* m : members) {
      if (!m->sharded_.empty()) scattered.push_back(m);
    }
    if (!scattered.empty()) IssueReduceScatter(scattered);
    for (UnitGroup* m : members) {
      if (!m->replicated_.empty()) m->IssueReplicatedAllReduce();
    }
  }
  for (UnitGroup* m : members) {
    m->step_.all_reduce = core_->requires_all_reduce;
    m->step_.pending = true;
  }
  reduced_with_ = members;
  core_->pending_reductions.push_back(this);
}

void UnitGroup::IssueReduceScatter(const std::vector<UnitGroup*>& members) {
  ++stats_.reduce_scatters;
  for (UnitGroup* m : members) {
    if (m != this) ++m->stats_.fused_reduce_scatters;
  }
  if (core_->trace != nullptr)
    reduce_scatter_.issued_ns = TraceRecorder::NowNanos();
  const at::TensorOptions options =
      at::TensorOptions().dtype(reduce_dtype_).device(core_->options.device);
  std::vector<ReduceScatterPart*> parts;
  for (UnitGroup* m : members) parts.push_back(&m->reduce_part_);
  if (UseSegments()) {
    for (UnitGroup* m : members) {
      Check(PrepareReduceScatterSegments(
          m->sharded_, *core_->mesh.shard, core_->buffers, options,
          /*in_place=*/core_->replicate_size() == 1, m->reduce_part_));
      for (ShardedParam* p : m->sharded_) p->ClearUnshardedGrad();
      core_->memory.in_flight_grad_bytes += m->reduce_part_.grad_bytes;
    }
    Check(StartReduceScatterSegments(parts, *core_->mesh.shard, core_->buffers,
                                     options, core_->collective_reduce_op(),
                                     reduce_scatter_));
    core_->SampleTransientBytes();
  } else {
    std::vector<std::vector<ShardedParam*>> params;
    for (UnitGroup* m : members) params.push_back(m->sharded_);
    Check(StartReduceScatterFlat(params, *core_->mesh.shard, core_->buffers,
                                 options, core_->collective_reduce_op(), parts,
                                 reduce_scatter_));
    core_->SampleTransientBytes();
    for (UnitGroup* m : members) {
      for (ShardedParam* p : m->sharded_) p->ClearUnshardedGrad();
    }
  }
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
  if (!step_.direct_grads.empty()) {
    step_.pending = false;
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
  if (reduce_scatter_.work) {
    WaitWork(reduce_scatter_.work, &stats_.reduce_scatter_seconds,
             "reduce-scatter", reduce_scatter_.issued_ns,
             SpanTrack::kShardComm);
  }
  // The peers' contributions are summed: their scratch can go now.
  core_->buffers.Release(reduce_scatter_.scratch);
  const std::vector<UnitGroup*> members = std::move(reduced_with_);
  reduced_with_.clear();
  for (UnitGroup* m : members) {
    m->step_.pending = false;
    if (!m->sharded_.empty()) m->FinishReduceScatter();
  }
  // Every part read its sums out of the flat buffer.
  ReleaseReductionBuffers();
  for (UnitGroup* m : members) {
    if (!m->replicated_.empty()) m->FinishReplicatedAllReduce();
  }
}

void UnitGroup::FinishReduceScatter() {
  ReduceScatterPart& rs = reduce_part_;
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
    ReleaseReductionPart();
    return;
  }
  const at::Tensor reduced = rs.output;
  at::NoGradGuard no_grad;
  if (core_->replicate_size() > 1 &&
      !ReduceAcrossReplicas(reduced, step_.held)) {
    ReleaseReductionPart();
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
  ReleaseReductionPart();
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
           SpanTrack::kReplicateComm);
  return true;
}

void UnitGroup::FinishReplicatedAllReduce() {
  ReplicatedAllReduceState& ar = replicated_all_reduce_;
  if (ar.work) {
    WaitWork(ar.work, &stats_.all_reduce_seconds, "all-reduce", ar.issued_ns,
             SpanTrack::kShardComm);
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
  ReduceScatterPart& rs = reduce_part_;
  rs.grads.clear();
  core_->memory.in_flight_grad_bytes -= rs.grad_bytes;
  rs.grad_bytes = 0;
}

void UnitGroup::ReleaseReductionPart() {
  ReduceScatterPart& rs = reduce_part_;
  ReleaseSentGradients();
  rs.in_place = false;
  if (rs.output_from_pool) {
    core_->buffers.Release(rs.output);
  } else {
    rs.output.reset();  // a view of the issuer's input
  }
  rs.output_from_pool = false;
  rs.flags.reset();
  rs.send.clear();
  rs.receive.clear();
}

void UnitGroup::ReleaseReductionBuffers() {
  core_->buffers.Release(reduce_scatter_.input);
  core_->buffers.Release(reduce_scatter_.scratch);
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

}  // namespace hsdp::fsdp
