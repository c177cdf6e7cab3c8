// Adapts at::Tensor to the torch-free comm::Buffer and implements the fused
// copy-in/copy-out of a unit's flat all-gather and reduce-scatter buffers.
//
// Flat layout (rank-major, as FSDP2): a unit's flat shard is the concatenation
// over its parameters of each padded local shard (ceil(rows/S) rows of its row
// frame, sharded_param.h). The all-gather output is S such chunks; parameter
// j's piece of rank r's chunk is rows [r*ceil, (r+1)*ceil) of its padded
// unsharded tensor. Every parameter passed must be sharded over the same S
// ranks (not replicated). Stateless functions; thread-compatible.
#ifndef HSDP_WORKER_FSDP_COLLECTIVES_H_
#define HSDP_WORKER_FSDP_COLLECTIVES_H_

#include <ATen/core/Tensor.h>

#include <vector>

#include "absl/status/statusor.h"
#include "worker/comm/communicator.h"

namespace hsdp::fsdp {

class ShardedParam;

absl::StatusOr<comm::DataType> ToCommDataType(c10::ScalarType type);
// A view of a contiguous tensor as a Buffer (no copy). The tensor must outlive
// the Buffer's use.
absl::StatusOr<comm::Buffer> ToBuffer(const at::Tensor& tensor);

// Elements of one rank's flat chunk for `params`.
int64_t FlatChunkNumel(const std::vector<ShardedParam*>& params);

// Fills `flat` (FlatChunkNumel elements, the all-gather input) with every local
// padded shard, cast to its dtype.
void AllGatherCopyIn(const std::vector<ShardedParam*>& params,
                     const at::Tensor& flat);
// Scatters the all-gather output (S chunks) into each parameter's unsharded
// storage.
void AllGatherCopyOut(const at::Tensor& output,
                      const std::vector<ShardedParam*>& params);

// Fills `flat` (S chunks, the reduce-scatter input, in its dtype) from the
// unsharded gradients (zeros for padding and for parameters without one). A
// chunk may be longer than FlatChunkNumel: its tail is left as it is.
void ReduceScatterCopyIn(const std::vector<ShardedParam*>& params,
                         const at::Tensor& flat);
// The rows of `output` (one reduced chunk) that belong to each parameter's
// local shard, in its row frame.
std::vector<at::Tensor> SplitReducedChunk(
    const at::Tensor& output, const std::vector<ShardedParam*>& params);

}  // namespace hsdp::fsdp

#endif  // HSDP_WORKER_FSDP_COLLECTIVES_H_
