#include "worker/fsdp/collectives.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
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
                      const std::vector<ShardedParam*>& params) {
  at::NoGradGuard no_grad;
  const int64_t size = params.empty() ? 1 : params.front()->layout_size();
  const at::Tensor chunks = output.view({size, -1});
  int64_t offset = 0;
  for (const ShardedParam* p : params) {
    p->unsharded_padded()
        .view({size, p->shard_numel()})
        .copy_(chunks.narrow(1, offset, p->shard_numel()));
    offset += p->shard_numel();
  }
}

void ReduceScatterCopyIn(const std::vector<ShardedParam*>& params,
                         const at::Tensor& flat) {
  at::NoGradGuard no_grad;
  const int64_t size = params.empty() ? 1 : params.front()->layout_size();
  // Each rank's chunk may be longer than the gradients (a tail the caller
  // fills).
  const at::Tensor chunks = flat.view({size, flat.numel() / size});
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

}  // namespace hsdp::fsdp
