// The collective-communication interface the sharding engine is written
// against.
//
// Backends: GlooCommunicator (CPU, TCP) and NcclCommunicator (CUDA). The
// interface is deliberately torch-free — it moves typed flat buffers — so the
// NCCL backend builds with only the CUDA runtime and NCCL, and the engine
// adapts at::Tensor to Buffer at its boundary.
//
// Ordering contract: every rank of a communicator must issue the same
// collectives in the same order. Calls return immediately with a Work handle;
// the collective runs on the backend's own thread or stream, in issue order.
// Buffers must stay alive and untouched until Wait() returns.
#ifndef HSDP_COMMUNICATOR_H_
#define HSDP_COMMUNICATOR_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace hsdp::comm {

enum class DataType {
  kFloat32,
  kFloat64,
  kBFloat16,
  kFloat16,
  kInt32,
  kInt64,
  kUInt8
};

// Size in bytes of one element of `dtype`.
size_t ElementSize(DataType dtype);
const char* DataTypeName(DataType dtype);

enum class ReduceOp { kSum, kAvg };

// A flat, contiguous buffer of `count` elements. Host memory for Gloo, device
// memory for NCCL.
struct Buffer {
  void* data = nullptr;
  int64_t count = 0;
  DataType dtype = DataType::kFloat32;

  size_t bytes() const {
    return static_cast<size_t>(count) * ElementSize(dtype);
  }
};

// A handle on one issued collective. Thread-compatible: one thread waits on a
// given Work.
class Work {
 public:
  virtual ~Work() = default;
  // Blocks until the collective finished (on CPU) or is ordered before the
  // caller's current compute stream (on CUDA). Returns the backend's error,
  // naming the collective and the peer when known, e.g. DEADLINE_EXCEEDED when
  // a peer never arrived.
  virtual absl::Status Wait() = 0;
  // True once Wait() would not block.
  virtual bool IsCompleted() = 0;
  // Seconds the collective itself took (from start on the comm thread/stream to
  // completion); valid after Wait() returned OK.
  virtual double ElapsedSeconds() const = 0;
  // Wall-clock time the collective completed, where the backend knows it (the
  // CPU backends' executor); empty otherwise. Places it on a trace timeline.
  virtual std::optional<absl::Time> CompletedAt() const { return std::nullopt; }
};

// A group of `size()` ranks. Thread-safety: calls may come from any thread but
// must be serialised by the caller in the same order on every rank (the engine
// issues from the training thread only).
class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Short backend/group description for errors and logs, e.g. "gloo:shard".
  virtual std::string name() const = 0;

  // output.count == input.count * size(); rank r's input lands at output[r *
  // input.count].
  virtual std::unique_ptr<Work> AllGather(const Buffer& input,
                                          const Buffer& output) = 0;
  // input.count == output.count * size(); output = op over ranks of input[rank
  // * output.count]. Reduction happens in the buffers' dtype (both must match).
  virtual std::unique_ptr<Work> ReduceScatter(const Buffer& input,
                                              const Buffer& output,
                                              ReduceOp op) = 0;
  virtual std::unique_ptr<Work> AllReduce(const Buffer& buffer,
                                          ReduceOp op) = 0;

  // Segment-addressed variants, for callers whose data lives in many separate
  // tensors (a unit's parameters and gradients): a backend that can address
  // each piece moves them with no flat staging copy. Only called when
  // SupportsSegments(); the defaults return UNIMPLEMENTED.
  virtual bool SupportsSegments() const { return false; }
  // inputs: this rank's segments; outputs[r][k] receives rank r's inputs[k]
  // (outputs.size() == size(); every rank passes the same counts and dtypes).
  // outputs[rank()][k] may be inputs[k] itself (then nothing is copied).
  virtual std::unique_ptr<Work> AllGatherSegments(
      const std::vector<Buffer>& inputs,
      const std::vector<std::vector<Buffer>>& outputs);
  // inputs[r]: this rank's contribution to rank r's segments (inputs[r][k] has
  // rank r's outputs[k].count elements). outputs[k] = op over ranks, in rank
  // order, of their inputs[rank()][k] — the same sum, bit for bit, as
  // ReduceScatter of the concatenated segments. `scratch` receives the peers'
  // contributions: at least ReduceScatterScratchCount(total output count)
  // elements. outputs[k] may be inputs[rank()][k] itself (reduced in place);
  // otherwise outputs must not overlap the inputs.
  virtual int64_t ReduceScatterScratchCount(int64_t output_count) const {
    return output_count * (size() - 1);
  }
  virtual std::unique_ptr<Work> ReduceScatterSegments(
      const std::vector<std::vector<Buffer>>& inputs,
      const std::vector<Buffer>& outputs, const Buffer& scratch, ReduceOp op);
  virtual std::unique_ptr<Work> Broadcast(const Buffer& buffer, int root) = 0;
  virtual std::unique_ptr<Work> Barrier() = 0;

  // Point-to-point transfers, for callers that move different data between
  // different pairs at once (healing a rank from several peers). Only called
  // when SupportsSendRecv(); the default returns UNIMPLEMENTED. This rank sends
  // every `sends[i]` to its peer and receives every `recvs[j]` from its peer;
  // buffer k of a send pairs with buffer k of the peer's matching receive
  // (same byte size), and several transfers between one pair match in list
  // order. Like a collective, every rank of the communicator issues it in the
  // same order as its other calls (with empty lists when it moves nothing).
  // The Work completes when all of this rank's transfers did.
  struct PeerTransfer {
    int peer = 0;
    std::vector<Buffer> buffers;
  };
  virtual bool SupportsSendRecv() const { return false; }
  virtual std::unique_ptr<Work> SendRecv(
      const std::vector<PeerTransfer>& sends,
      const std::vector<PeerTransfer>& recvs);

  // Fails this communicator for good, from any thread — e.g. the thread that
  // learned from the coordinator that the generation ended while the training
  // thread is blocked in a collective on a dead peer. The collective running
  // and every queued or later one complete with ABORTED naming `reason`;
  // peers blocked on this rank fail promptly too (its connections close).
  // When Abort returns OK, no collective touches the callers' buffers any
  // more, so they may be freed. Idempotent. Build a new communicator (a new
  // rendezvous prefix) to communicate again. UNIMPLEMENTED when the backend
  // cannot abort; DEADLINE_EXCEEDED when the running collective did not stop
  // within the backend's timeout (its buffers must then stay alive).
  virtual absl::Status Abort(absl::string_view reason);
};

// For backends: walks the concatenation of `segments` (byte offsets).
// Calls fn(k, in_segment, in_range, len) for each piece of the concatenation
// of `segments` that overlaps bytes [offset, offset + n): `len` bytes of
// segment k, starting `in_segment` bytes into it and `in_range` bytes into
// the range. Empty segments (whose data may be null) are never passed: a
// zero-length memcpy from or to null is undefined behaviour.
template <typename Fn>
void ForEachSegmentPiece(const std::vector<Buffer>& segments, size_t offset,
                         size_t n, Fn&& fn) {
  size_t start = 0;
  for (size_t k = 0; k < segments.size(); ++k) {
    const size_t end = start + segments[k].bytes();
    if (end > start && end > offset && start < offset + n) {
      const size_t from = std::max(start, offset);
      const size_t to = std::min(end, offset + n);
      fn(k, from - start, from - offset, to - from);
    }
    if (end >= offset + n) break;
    start = end;
  }
}

// For backends: a Work already finished with `status` (argument errors found
// at issue, unsupported calls).
std::unique_ptr<Work> CompletedWork(absl::Status status);

// For backends: the elements and the bytes of a segment list.
int64_t TotalCount(const std::vector<Buffer>& segments);
size_t TotalBytes(const std::vector<Buffer>& segments);

// For backends: argument checks of the segment collectives, INVALID_ARGUMENT
// prefixed with `where` and naming the offending segment and rank.
absl::Status CheckAllGatherSegments(
    const std::string& where, const std::vector<Buffer>& inputs,
    const std::vector<std::vector<Buffer>>& outputs, int size);
absl::Status CheckReduceScatterSegments(
    const std::string& where, const std::vector<std::vector<Buffer>>& inputs,
    const std::vector<Buffer>& outputs, int rank, int size);
// Peers in range and not this rank, buffers with memory.
absl::Status CheckSendRecv(const std::string& where,
                           const std::vector<Communicator::PeerTransfer>& sends,
                           const std::vector<Communicator::PeerTransfer>& recvs,
                           int rank, int size);

}  // namespace hsdp::comm

#endif  // HSDP_COMMUNICATOR_H_
