// The point-to-point collectives of the Gloo backend: the segment-addressed
// all-gather and reduce-scatter, and SendRecv. Each is an options object plus
// a free function, as Gloo's own collectives are (gloo/allgather.h): fill a
// GlooSegmentsOptions, call the function on the thread that runs the
// collective. GlooCommunicator queues these calls and turns their exceptions
// into a Status; the argument checks (communicator.h) come before.
//
// Segments travel as messages over Gloo's unbound buffers, straight from and
// into the callers' memory; segments under `pack_below_bytes` travel packed in
// one message per peer (each message costs a round trip, which dominates for a
// few hundred bytes). The reduce-scatter moves each stream in size-1 parts,
// one round each, so its scratch is about one output's worth.
//
// Failure: like Gloo's collectives, these functions throw Gloo's exceptions
// (a timeout, a lost peer). The unbound buffers of a failed call are handed to
// `orphans`, because Gloo may still hold pointers to them.
//
// Thread-compatibility: a call uses the context alone; the caller runs one
// call per context at a time, in the same order on every rank.
#ifndef HSDP_WORKER_COMM_GLOO_GLOO_SEGMENTS_H_
#define HSDP_WORKER_COMM_GLOO_GLOO_SEGMENTS_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/time/time.h"
#include "hsdp/communicator.h"
#include "hsdp/gloo_options.h"

namespace gloo {
class Context;
namespace transport {
class UnboundBuffer;
}  // namespace transport
}  // namespace gloo

namespace hsdp::comm {

struct GlooSegmentsOptions {
  // The group; this rank and the size come from it. Must outlive the call.
  gloo::Context* context = nullptr;
  // Tells this call's messages from other calls' in flight: the same on every
  // rank (the issue counter).
  uint32_t tag = 0;
  // One deadline for the whole call.
  absl::Duration timeout = absl::Seconds(30);
  // Receives the unbound buffers of a call that failed. Must outlive them.
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>>* orphans =
      nullptr;
  // See GlooCommunicatorOptions::pack_below_bytes.
  size_t pack_below_bytes = kGlooPackBelowBytes;
};

// Communicator::AllGatherSegments, arguments already checked.
void GlooAllGatherSegments(const GlooSegmentsOptions& options,
                           const std::vector<Buffer>& inputs,
                           const std::vector<std::vector<Buffer>>& outputs);

// Communicator::ReduceScatterSegments, arguments already checked; `scratch`
// holds at least GlooReduceScatterScratchCount(size, total output count)
// elements of the outputs' dtype.
void GlooReduceScatterSegments(const GlooSegmentsOptions& options,
                               const std::vector<std::vector<Buffer>>& inputs,
                               const std::vector<Buffer>& outputs,
                               const Buffer& scratch, ReduceOp op);
int64_t GlooReduceScatterScratchCount(int size, int64_t output_count);

// Communicator::SendRecv, arguments already checked: every transfer of the
// call is in flight at once.
void GlooSendRecv(const GlooSegmentsOptions& options,
                  const std::vector<Communicator::PeerTransfer>& sends,
                  const std::vector<Communicator::PeerTransfer>& recvs);

}  // namespace hsdp::comm

#endif  // HSDP_WORKER_COMM_GLOO_GLOO_SEGMENTS_H_
