// The collectives of a unit, stateless: the Tensor <-> comm::Buffer adapters,
// the fused copy-in/copy-out of the flat buffers, and the two ways a unit's
// bytes move (unit_group.h says when each applies), each a Start that issues
// the collective and fills a state record (FSDP2's AllGatherState /
// ReduceScatterState) that the unit keeps until it completes.
//
// Flat layout (rank-major, as FSDP2): a unit's flat shard is the concatenation
// over its parameters of each padded local shard (ceil(rows/S) rows of its row
// frame, sharded_param.h). The all-gather output is S such chunks; parameter
// j's piece of rank r's chunk is rows [r*ceil, (r+1)*ceil) of its padded
// unsharded tensor. Every parameter passed must be sharded over the same S
// ranks (not replicated). A reduction's chunk ends in one flag per parameter
// (1 where this rank had a gradient, 0 where zeros stood in), reduced with the
// gradients: whether any rank had one travels with the sums.
//
// Thread-compatible: the functions touch only what they are given.
#ifndef HSDP_WORKER_FSDP_COLLECTIVES_H_
#define HSDP_WORKER_FSDP_COLLECTIVES_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "hsdp/communicator.h"

namespace hsdp::fsdp {

class FlatBufferPool;
class ShardedParam;

// An all-gather from issue to completion: one unit's sharded parameters, or
// several units' (comm fusion: their parameter lists concatenated, which is
// the flat layout of the concatenation).
struct AllGatherState {
  // Flat path: S chunks from the pool, gathered in place.
  at::Tensor output;
  // Segments path, mixed precision: the shards cast to the compute dtype.
  at::Tensor input;
  std::unique_ptr<comm::Work> work;
  int64_t issued_ns = 0;  // when tracing
};

// One unit's part of a reduce-scatter, alone or fused with other units'
// (comm fusion: the parts' chunks lie side by side, each in the layout
// above, so each part's sums are the ones it would get alone).
struct ReduceScatterPart {
  // This rank's reduced chunk (gradients, then flags): a view of the
  // collective's input (flat path), or a pool buffer of its own in the flat
  // layout (segments path with replicas: HSDP all-reduces one flat chunk).
  // Undefined where the sums land in place.
  at::Tensor output;
  bool output_from_pool = false;
  // Elements of the chunk (ReductionChunkNumel of the part's parameters).
  int64_t chunk_numel = 0;
  // Segments path: this rank's flags, one copy per destination; the
  // gradients being sent (alive until the collective completes) and their
  // bytes.
  at::Tensor flags;
  std::vector<at::Tensor> grads;
  int64_t grad_bytes = 0;
  // Segments path without replicas: each sum lands in this rank's own rows of
  // the gradients, `output` stays undefined.
  bool in_place = false;
  // Segments path, from Prepare to Start: what goes to each rank, where this
  // rank's sums land.
  std::vector<std::vector<comm::Buffer>> send;
  std::vector<comm::Buffer> receive;
};

// One reduce-scatter collective over one part or several fused ones.
struct ReduceScatterState {
  // Flat path: S rows of the parts' chunks side by side, from the pool,
  // reduced in place (the parts' outputs are views of this rank's row).
  at::Tensor input;
  // Segments path: room for the peers' contributions, when the backend needs
  // it.
  at::Tensor scratch;
  std::unique_ptr<comm::Work> work;
  int64_t issued_ns = 0;  // when tracing
};

// The replicated parameters' all-reduce over the shard group: their
// gradients (zeros where this rank has none) and one flag each, in one flat
// buffer from the pool.
struct ReplicatedAllReduceState {
  at::Tensor buffer;
  std::unique_ptr<comm::Work> work;
  int64_t issued_ns = 0;  // when tracing
};

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
// storage. With `shards_per_piece` m > 1: the output of a host-group
// all-gather, S/m host shards (below).
void AllGatherCopyOut(const at::Tensor& output,
                      const std::vector<ShardedParam*>& params,
                      int shards_per_piece = 1);

// Hierarchical reshard. A host shard is a rank's part of `params`' gathered
// values within a host group of `host_size` consecutive shard ranks (m =
// S / host_size shards each): for each parameter in order, rows [j*m*ceil,
// (j+1)*m*ceil) of its padded unsharded tensor, j the rank in the host group.
// The host group's ranks' host shards, side by side, are the unsharded tensor.
int64_t HostShardNumel(const std::vector<ShardedParam*>& params, int host_size);
// Copies this rank's host shard out of the (allocated) unsharded storage.
void CopyHostShard(const std::vector<ShardedParam*>& params, int host_rank,
                   int host_size, const at::Tensor& host_shard);
// Starts the all-gather of the host shards over `group` (the host group):
// straight into the unsharded storage, which must be allocated, where the
// group takes segments; else into state.output (host_size host shards from
// `pool`), for AllGatherCopyOut(output, params, S / host_size).
absl::Status StartHostAllGather(const std::vector<ShardedParam*>& params,
                                const at::Tensor& host_shard,
                                comm::Communicator& group, FlatBufferPool& pool,
                                AllGatherState& state);

// Fills `chunks` (S rows, each at least FlatChunkNumel long; any row stride:
// a block of columns of a fused buffer) from the unsharded gradients in the
// rows' dtype, zeros for padding and for parameters without one. Columns past
// FlatChunkNumel are left as they are.
void ReduceScatterCopyIn(const std::vector<ShardedParam*>& params,
                         const at::Tensor& chunks);
// The rows of `output` (one reduced chunk) that belong to each parameter's
// local shard, in its row frame.
std::vector<at::Tensor> SplitReducedChunk(
    const at::Tensor& output, const std::vector<ShardedParam*>& params);

// Writes this rank's flags for `params` into `flags` (one element each: 1
// where it has an unsharded gradient).
void FillGradFlags(const std::vector<ShardedParam*>& params,
                   const at::Tensor& flags);
// Elements of one rank's chunk of a reduction of `params`: the gradients'
// flat chunk, then one flag per parameter.
int64_t ReductionChunkNumel(const std::vector<ShardedParam*>& params);

// Flat path (NCCL's: one contiguous buffer per collective). Copies this
// rank's shards into its chunk of S chunks from `pool` (in `options`) and
// starts the all-gather in place.
absl::Status StartAllGatherFlat(const std::vector<ShardedParam*>& params,
                                comm::Communicator& group, FlatBufferPool& pool,
                                const at::TensorOptions& options,
                                AllGatherState& state);
// Segments path (Gloo TCP, shared memory). Sends each shard (cast into a
// pool buffer when it is not in `options`' dtype) and receives every peer's
// piece straight into the unsharded storage, which must be allocated.
absl::Status StartAllGatherSegments(const std::vector<ShardedParam*>& params,
                                    comm::Communicator& group,
                                    FlatBufferPool& pool,
                                    const at::TensorOptions& options,
                                    AllGatherState& state);

// Flat path: fills S rows of every part's chunk side by side (from the pool;
// part k of `params[k]`'s unsharded gradients and flags), starts the
// reduce-scatter in place and points each part's output at its chunk of this
// rank's row. The gradients may be dropped once it returns.
absl::Status StartReduceScatterFlat(
    const std::vector<std::vector<ShardedParam*>>& params,
    comm::Communicator& group, FlatBufferPool& pool,
    const at::TensorOptions& options, comm::ReduceOp op,
    const std::vector<ReduceScatterPart*>& parts, ReduceScatterState& state);
// Segments path, one part: takes the unsharded gradients (in `options`'
// dtype, contiguous in the row frame; zeros where there is none) and lays out
// what each rank receives of them, the flags as one more segment. The module
// parameters' gradients may be dropped once it returns (part.grads holds
// them).
absl::Status PrepareReduceScatterSegments(
    const std::vector<ShardedParam*>& params, comm::Communicator& group,
    FlatBufferPool& pool, const at::TensorOptions& options, bool in_place,
    ReduceScatterPart& part);
// Segments path: starts one reduce-scatter of the prepared parts' segments,
// concatenated (each element is still summed over the ranks in rank order, so
// every part gets the bits it would alone), with one scratch for them all.
absl::Status StartReduceScatterSegments(
    const std::vector<ReduceScatterPart*>& parts, comm::Communicator& group,
    FlatBufferPool& pool, const at::TensorOptions& options, comm::ReduceOp op,
    ReduceScatterState& state);

// Fills state.buffer with the replicated parameters' gradients and flags.
absl::Status PrepareReplicatedAllReduce(
    const std::vector<ShardedParam*>& params, FlatBufferPool& pool,
    const at::TensorOptions& options, ReplicatedAllReduceState& state);

}  // namespace hsdp::fsdp

#endif  // HSDP_WORKER_FSDP_COLLECTIVES_H_
