#include "worker/fsdp/collectives.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "worker/fsdp/flat_buffer_pool.h"
#include "worker/fsdp/sharded_param.h"

namespace hsdp::fsdp {

absl::StatusOr<comm::DataType> ToCommDataType(c10::ScalarType type) {
  switch (type) {
    case c10::kFloat:
      return comm::DataType::kFloat32;
    case c10::kDouble:
      return comm::DataType::kFloat64;
    case c10::kBFloat16:
      return comm::DataType::kBFloat16;
    case c10::kHalf:
      return comm::DataType::kFloat16;
    case c10::kInt:
      return comm::DataType::kInt32;
    case c10::kLong:
      return comm::DataType::kInt64;
    case c10::kByte:
      return comm::DataType::kUInt8;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("no communication dtype for ", c10::toString(type)));
  }
}

absl::StatusOr<comm::Buffer> ToBuffer(const at::Tensor& tensor) {
  if (!tensor.is_contiguous()) {
    return absl::InvalidArgumentError(
        "communication buffers must be contiguous");
  }
  absl::StatusOr<comm::DataType> type = ToCommDataType(tensor.scalar_type());
  if (!type.ok()) return type.status();
  comm::Buffer buffer;
  buffer.data = tensor.data_ptr();
  buffer.count = tensor.numel();
  buffer.dtype = *type;
  return buffer;
}

int64_t FlatChunkNumel(const std::vector<ShardedParam*>& params) {
  int64_t numel = 0;
  for (const ShardedParam* p : params) numel += p->shard_numel();
  return numel;
}

void AllGatherCopyIn(const std::vector<ShardedParam*>& params,
                     const at::Tensor& flat) {
  at::NoGradGuard no_grad;
  int64_t offset = 0;
  for (const ShardedParam* p : params) {
    flat.narrow(0, offset, p->shard_numel())
        .copy_(p->sharded_padded().reshape({-1}));
    offset += p->shard_numel();
  }
}

void AllGatherCopyOut(const at::Tensor& output,
                      const std::vector<ShardedParam*>& params,
                      int shards_per_piece) {
  at::NoGradGuard no_grad;
  const int64_t size =
      params.empty() ? 1 : params.front()->layout_size() / shards_per_piece;
  const at::Tensor chunks = output.view({size, -1});
  int64_t offset = 0;
  for (const ShardedParam* p : params) {
    const int64_t piece = p->shard_numel() * shards_per_piece;
    p->unsharded_padded()
        .view({size, piece})
        .copy_(chunks.narrow(1, offset, piece));
    offset += piece;
  }
}

int64_t HostShardNumel(const std::vector<ShardedParam*>& params,
                       int host_size) {
  int64_t numel = 0;
  for (const ShardedParam* p : params)
    numel += p->shard_numel() * (p->layout_size() / host_size);
  return numel;
}

void CopyHostShard(const std::vector<ShardedParam*>& params, int host_rank,
                   int host_size, const at::Tensor& host_shard) {
  at::NoGradGuard no_grad;
  int64_t offset = 0;
  for (const ShardedParam* p : params) {
    const int64_t piece = p->shard_numel() * (p->layout_size() / host_size);
    host_shard.narrow(0, offset, piece)
        .copy_(p->unsharded_padded().view({host_size, piece})[host_rank]);
    offset += piece;
  }
}

void ReduceScatterCopyIn(const std::vector<ShardedParam*>& params,
                         const at::Tensor& chunks) {
  at::NoGradGuard no_grad;
  const int64_t size = chunks.size(0);
  int64_t offset = 0;
  for (const ShardedParam* p : params) {
    at::Tensor dst = chunks.narrow(1, offset, p->shard_numel());
    const at::Tensor grad = p->unsharded_grad_rows();
    const int64_t padded_rows = p->padded_rows_per_rank() * size;
    if (!grad.defined()) {
      dst.zero_();
    } else if (padded_rows == p->rows()) {
      dst.copy_(grad.reshape({size, p->shard_numel()}));
    } else {
      // Rows past the padding boundary of each rank's chunk are not contiguous
      // in `flat`, so copy rank by rank.
      const at::Tensor g = grad.reshape({p->rows(), p->row_numel()});
      for (int64_t r = 0; r < size; ++r) {
        const int64_t begin = r * p->padded_rows_per_rank();
        const int64_t n = std::clamp<int64_t>(p->rows() - begin, 0,
                                              p->padded_rows_per_rank());
        at::Tensor rank_rows =
            dst[r].view({p->padded_rows_per_rank(), p->row_numel()});
        if (n > 0) rank_rows.narrow(0, 0, n).copy_(g.narrow(0, begin, n));
        if (n < p->padded_rows_per_rank()) {
          rank_rows.narrow(0, n, p->padded_rows_per_rank() - n).zero_();
        }
      }
    }
    offset += p->shard_numel();
  }
}

std::vector<at::Tensor> SplitReducedChunk(
    const at::Tensor& output, const std::vector<ShardedParam*>& params) {
  std::vector<at::Tensor> pieces;
  pieces.reserve(params.size());
  int64_t offset = 0;
  for (const ShardedParam* p : params) {
    std::vector<int64_t> shape = p->frame_shape();
    shape[0] = p->padded_rows_per_rank();
    pieces.push_back(output.narrow(0, offset, p->shard_numel())
                         .view(shape)
                         .narrow(0, 0, p->valid_rows()));
    offset += p->shard_numel();
  }
  return pieces;
}

void FillGradFlags(const std::vector<ShardedParam*>& params,
                   const at::Tensor& flags) {
  at::NoGradGuard no_grad;
  // One host-to-device copy rather than one fill per parameter.
  std::vector<float> local(params.size());
  for (size_t i = 0; i < params.size(); ++i)
    local[i] = params[i]->unsharded_grad().defined() ? 1.0f : 0.0f;
  flags.copy_(at::from_blob(local.data(), {static_cast<int64_t>(local.size())},
                            at::TensorOptions().dtype(at::kFloat)));
}

int64_t ReductionChunkNumel(const std::vector<ShardedParam*>& params) {
  return FlatChunkNumel(params) + static_cast<int64_t>(params.size());
}

absl::Status StartAllGatherFlat(const std::vector<ShardedParam*>& params,
                                comm::Communicator& group, FlatBufferPool& pool,
                                const at::TensorOptions& options,
                                AllGatherState& state) {
  // In place: this rank's chunk is copied into its slot of the gathered
  // buffer, so a unit needs one flat buffer, not two.
  const int64_t chunk = FlatChunkNumel(params);
  state.output = pool.Acquire(chunk * group.size(), options);
  const at::Tensor own = state.output.narrow(0, chunk * group.rank(), chunk);
  AllGatherCopyIn(params, own);
  if (group.size() == 1) return absl::OkStatus();
  absl::StatusOr<comm::Buffer> in = ToBuffer(own);
  if (!in.ok()) return in.status();
  absl::StatusOr<comm::Buffer> out = ToBuffer(state.output);
  if (!out.ok()) return out.status();
  state.work = group.AllGather(*in, *out);
  return absl::OkStatus();
}

namespace {

// Sends inputs[i] and receives every rank's piece of params[i] (as many
// elements) straight into its unsharded storage, rank r's at r * piece.
absl::Status StartPieceGather(const std::vector<at::Tensor>& inputs,
                              const std::vector<ShardedParam*>& params,
                              comm::Communicator& group,
                              AllGatherState& state) {
  const int size = group.size();
  std::vector<comm::Buffer> in_buffers;
  std::vector<std::vector<comm::Buffer>> outputs(static_cast<size_t>(size));
  for (size_t i = 0; i < params.size(); ++i) {
    absl::StatusOr<comm::Buffer> in = ToBuffer(inputs[i]);
    if (!in.ok()) return in.status();
    absl::StatusOr<comm::Buffer> out = ToBuffer(params[i]->unsharded_padded());
    if (!out.ok()) return out.status();
    in_buffers.push_back(*in);
    const int64_t n = in->count;
    for (int r = 0; r < size; ++r) {
      comm::Buffer piece = *out;
      piece.data = static_cast<char*>(out->data) +
                   r * n * static_cast<int64_t>(comm::ElementSize(out->dtype));
      piece.count = n;
      outputs[r].push_back(piece);
    }
  }
  state.work = group.AllGatherSegments(in_buffers, outputs);
  return absl::OkStatus();
}

}  // namespace

absl::Status StartAllGatherSegments(const std::vector<ShardedParam*>& params,
                                    comm::Communicator& group,
                                    FlatBufferPool& pool,
                                    const at::TensorOptions& options,
                                    AllGatherState& state) {
  bool cast = false;
  for (const ShardedParam* p : params) {
    cast = cast || p->sharded_padded().scalar_type() !=
                       c10::typeMetaToScalarType(options.dtype());
  }
  if (cast) {
    // Mixed precision: the shards go out in the compute dtype.
    state.input = pool.Acquire(FlatChunkNumel(params), options);
    AllGatherCopyIn(params, state.input);
  }
  std::vector<at::Tensor> inputs;
  int64_t offset = 0;
  for (const ShardedParam* p : params) {
    const int64_t n = p->shard_numel();
    inputs.push_back(cast ? state.input.narrow(0, offset, n)
                          : p->sharded_padded());
    offset += n;
  }
  return StartPieceGather(inputs, params, group, state);
}

absl::Status StartHostAllGather(const std::vector<ShardedParam*>& params,
                                const at::Tensor& host_shard,
                                comm::Communicator& group, FlatBufferPool& pool,
                                AllGatherState& state) {
  const int host_size = group.size();
  std::vector<at::Tensor> inputs;
  int64_t offset = 0;
  for (const ShardedParam* p : params) {
    const int64_t piece = p->shard_numel() * (p->layout_size() / host_size);
    inputs.push_back(host_shard.narrow(0, offset, piece));
    offset += piece;
  }
  if (group.SupportsSegments())
    return StartPieceGather(inputs, params, group, state);
  // One contiguous buffer (NCCL): k host shards, copied out on completion.
  state.output = pool.Acquire(offset * host_size, host_shard.options());
  absl::StatusOr<comm::Buffer> in = ToBuffer(host_shard);
  if (!in.ok()) return in.status();
  absl::StatusOr<comm::Buffer> out = ToBuffer(state.output);
  if (!out.ok()) return out.status();
  state.work = group.AllGather(*in, *out);
  return absl::OkStatus();
}

namespace {

// Fills `chunks` (S rows of ReductionChunkNumel(params)) with the gradients'
// rows for each rank and this rank's flags in every row's tail.
void FillReductionChunks(const std::vector<ShardedParam*>& params,
                         const at::Tensor& chunks) {
  ReduceScatterCopyIn(params, chunks);
  at::NoGradGuard no_grad;
  const int64_t grads = FlatChunkNumel(params);
  const at::Tensor flags =
      chunks.narrow(1, grads, static_cast<int64_t>(params.size()));
  FillGradFlags(params, flags[0]);
  for (int64_t r = 1; r < chunks.size(0); ++r) flags[r].copy_(flags[0]);
}

}  // namespace

absl::Status StartReduceScatterFlat(
    const std::vector<std::vector<ShardedParam*>>& params,
    comm::Communicator& group, FlatBufferPool& pool,
    const at::TensorOptions& options, comm::ReduceOp op,
    const std::vector<ReduceScatterPart*>& parts, ReduceScatterState& state) {
  const int size = group.size();
  int64_t chunk = 0;
  for (size_t k = 0; k < params.size(); ++k) {
    parts[k]->chunk_numel = ReductionChunkNumel(params[k]);
    chunk += parts[k]->chunk_numel;
  }
  state.input = pool.Acquire(chunk * size, options);
  const at::Tensor rows = state.input.view({size, chunk});
  int64_t offset = 0;
  for (size_t k = 0; k < params.size(); ++k) {
    FillReductionChunks(params[k],
                        rows.narrow(1, offset, parts[k]->chunk_numel));
    offset += parts[k]->chunk_numel;
  }
  // In place: the reduced chunk lands in this rank's row of the input (with
  // one rank, the input is the reduced chunk).
  const at::Tensor own = rows[group.rank()];
  offset = 0;
  for (ReduceScatterPart* part : parts) {
    part->output = own.narrow(0, offset, part->chunk_numel);
    part->output_from_pool = false;
    part->in_place = false;
    offset += part->chunk_numel;
  }
  if (size == 1) return absl::OkStatus();
  absl::StatusOr<comm::Buffer> in = ToBuffer(state.input);
  if (!in.ok()) return in.status();
  absl::StatusOr<comm::Buffer> out = ToBuffer(own);
  if (!out.ok()) return out.status();
  state.work = group.ReduceScatter(*in, *out, op);
  return absl::OkStatus();
}

absl::Status PrepareReduceScatterSegments(
    const std::vector<ShardedParam*>& params, comm::Communicator& group,
    FlatBufferPool& pool, const at::TensorOptions& options, bool in_place,
    ReduceScatterPart& state) {
  const int size = group.size();
  const int rank = group.rank();
  const int64_t chunk = ReductionChunkNumel(params);
  const int64_t num_flags = static_cast<int64_t>(params.size());
  state.chunk_numel = chunk;
  // Without replicas the sum lands in place, in this rank's own rows of each
  // gradient (no output buffer). HSDP all-reduces one flat chunk, so there the
  // sum goes to a chunk in the flat path's padded layout.
  state.in_place = in_place;
  state.output_from_pool = !in_place;
  if (!in_place) state.output = pool.Acquire(chunk, options);
  // The flags go to every rank as one more segment (a copy per rank, since
  // this rank's copy also receives the sum in place).
  state.flags = at::empty({size, num_flags}, options);
  FillGradFlags(params, state.flags[0]);
  for (int r = 1; r < size; ++r) state.flags[r].copy_(state.flags[0]);
  state.grads.clear();
  state.send.assign(static_cast<size_t>(size), {});
  state.receive.clear();
  at::NoGradGuard no_grad;
  int64_t offset = 0;
  for (const ShardedParam* p : params) {
    at::Tensor g = p->unsharded_grad_rows();
    if (g.defined()) {
      // In the reduce dtype and contiguous in the row frame; a no-op in the
      // common case.
      g = g.to(c10::typeMetaToScalarType(options.dtype())).contiguous();
    } else {
      // Every rank contributes to every segment: zeros stand in.
      g = at::zeros(p->frame_shape(), options);
    }
    state.grads.push_back(g);
    absl::StatusOr<comm::Buffer> whole = ToBuffer(g);
    if (!whole.ok()) return whole.status();
    const int64_t row_bytes =
        p->row_numel() * static_cast<int64_t>(comm::ElementSize(whole->dtype));
    for (int r = 0; r < size; ++r) {
      const int64_t begin = r * p->padded_rows_per_rank();
      const int64_t rows =
          std::clamp<int64_t>(p->rows() - begin, 0, p->padded_rows_per_rank());
      state.send[r].push_back(
          comm::Buffer{static_cast<char*>(whole->data) + begin * row_bytes,
                       rows * p->row_numel(), whole->dtype});
      if (r != rank) continue;
      if (in_place) {
        state.receive.push_back(state.send[r].back());
        continue;
      }
      const int64_t valid = rows * p->row_numel();
      absl::StatusOr<comm::Buffer> out =
          ToBuffer(state.output.narrow(0, offset, valid));
      if (!out.ok()) return out.status();
      state.receive.push_back(*out);
      // Padding rows stay zero (the HSDP all-reduce reads the whole chunk).
      if (valid < p->shard_numel()) {
        state.output.narrow(0, offset + valid, p->shard_numel() - valid)
            .zero_();
      }
    }
    offset += p->shard_numel();
  }
  for (int r = 0; r < size; ++r) {
    absl::StatusOr<comm::Buffer> flags = ToBuffer(state.flags[r]);
    if (!flags.ok()) return flags.status();
    state.send[r].push_back(*flags);
  }
  if (in_place) {
    state.receive.push_back(state.send[rank].back());
  } else {
    absl::StatusOr<comm::Buffer> out =
        ToBuffer(state.output.narrow(0, offset, num_flags));
    if (!out.ok()) return out.status();
    state.receive.push_back(*out);
  }
  state.grad_bytes = 0;
  for (const at::Tensor& g : state.grads)
    state.grad_bytes += static_cast<int64_t>(g.nbytes());
  return absl::OkStatus();
}

absl::Status StartReduceScatterSegments(
    const std::vector<ReduceScatterPart*>& parts, comm::Communicator& group,
    FlatBufferPool& pool, const at::TensorOptions& options, comm::ReduceOp op,
    ReduceScatterState& state) {
  std::vector<std::vector<comm::Buffer>> send(
      static_cast<size_t>(group.size()));
  std::vector<comm::Buffer> receive;
  int64_t chunk = 0;
  for (ReduceScatterPart* part : parts) {
    for (size_t r = 0; r < send.size(); ++r) {
      send[r].insert(send[r].end(), part->send[r].begin(), part->send[r].end());
    }
    receive.insert(receive.end(), part->receive.begin(), part->receive.end());
    chunk += part->chunk_numel;
    part->send.clear();
    part->receive.clear();
  }
  // Room for the peers' contributions if the backend receives them before
  // summing.
  absl::StatusOr<comm::DataType> dtype =
      ToCommDataType(c10::typeMetaToScalarType(options.dtype()));
  if (!dtype.ok()) return dtype.status();
  comm::Buffer scratch{nullptr, 0, *dtype};
  const int64_t scratch_count = group.ReduceScatterScratchCount(chunk);
  if (scratch_count > 0) {
    state.scratch = pool.Acquire(scratch_count, options);
    absl::StatusOr<comm::Buffer> b = ToBuffer(state.scratch);
    if (!b.ok()) return b.status();
    scratch = *b;
  }
  state.work = group.ReduceScatterSegments(send, receive, scratch, op);
  return absl::OkStatus();
}

absl::Status PrepareReplicatedAllReduce(
    const std::vector<ShardedParam*>& params, FlatBufferPool& pool,
    const at::TensorOptions& options, ReplicatedAllReduceState& state) {
  at::NoGradGuard no_grad;
  int64_t numel = 0;
  for (const ShardedParam* p : params) numel += p->numel();
  const int64_t num_flags = static_cast<int64_t>(params.size());
  state.buffer = pool.Acquire(numel + num_flags, options);
  int64_t offset = 0;
  for (const ShardedParam* p : params) {
    at::Tensor dst = state.buffer.narrow(0, offset, p->numel());
    const at::Tensor g = p->unsharded_grad_rows();
    if (g.defined()) {
      dst.copy_(g.reshape({-1}));
    } else {
      dst.zero_();
    }
    offset += p->numel();
  }
  FillGradFlags(params, state.buffer.narrow(0, numel, num_flags));
  return absl::OkStatus();
}

}  // namespace hsdp::fsdp
