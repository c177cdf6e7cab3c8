// Gloo backend of Communicator: CPU collectives over TCP.
//
// Each GlooCommunicator owns one gloo::rendezvous::Context (a full mesh of TCP
// pairs set up through a Store) and one communication thread that runs the
// issued collectives in issue order, so the training thread only enqueues and
// later waits. Several communicators of one process (e.g. the shard and
// replicate groups of a DeviceMesh) can share one tcp device.
//
// Failure model: the rendezvous and every collective are bounded by the
// communicator's timeout. A rendezvous that misses a peer fails with
// DEADLINE_EXCEEDED naming the rank(s) that never arrived. A Gloo error in a
// collective completes the Work with DEADLINE_EXCEEDED (a peer did not take
// part in time; Gloo does not say which) or UNAVAILABLE (a peer closed or
// reset its connection: named by rank), naming the collective, its sequence
// number and the communicator. The communicator is then unusable (its TCP pairs
// are in an unknown state) and every later call fails fast with that error.
// Abort() (from any thread) fails the running and every later collective with
// ABORTED.
//
// Memory: ReduceScatter receives into a buffer of the input's size, kept for
// the communicator's life (grown to the largest input seen) to avoid a large
// allocation per call.
#ifndef HSDP_WORKER_COMM_GLOO_GLOO_COMMUNICATOR_H_
#define HSDP_WORKER_COMM_GLOO_GLOO_COMMUNICATOR_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "hsdp/communicator.h"
#include "hsdp/gloo_options.h"
#include "hsdp/store.h"
#include "worker/comm/serial_executor.h"

namespace gloo {
class Context;
namespace transport {
class Device;
}  // namespace transport
}  // namespace gloo

namespace hsdp::comm {

// Creates a Gloo tcp device (one listening socket + one event-loop thread),
// shareable by any number of GlooCommunicators of this process.
absl::StatusOr<std::shared_ptr<gloo::transport::Device>> CreateGlooDevice(
    const GlooDeviceOptions& options);

// Thread-safety: the Communicator methods may be called from any thread but, as
// the interface says, in the same order on every rank; issuing is serialised
// internally by a mutex. Collectives execute one at a time in issue order on
// the communicator's own thread — except that Wait() on a collective that is
// next in line and not yet started runs it on the waiting thread (same order,
// no thread hand-off when the caller would block anyway).
class GlooCommunicator final : public Communicator {
 public:
  // Rendezvous of `size` ranks through `store` under `prefix` (distinct per
  // group and per generation), then a full TCP mesh on `device`. Blocks until
  // all ranks joined; DEADLINE_EXCEEDED naming the missing rank(s) after
  // options.timeout. Keys used: "<prefix>/<rank>" (Gloo's, binary values) and
  // "<prefix>/pair_addresses/<rank>". `store` is not used after Create.
  static absl::StatusOr<std::unique_ptr<GlooCommunicator>> Create(
      Store& store, const std::string& prefix, int rank, int size,
      std::shared_ptr<gloo::transport::Device> device,
      const GlooCommunicatorOptions& options);

  GlooCommunicator(const GlooCommunicator&) = delete;
  GlooCommunicator& operator=(const GlooCommunicator&) = delete;
  // Runs the collectives still queued (each bounded by the timeout), joins the
  // communication thread, then closes the TCP pairs; peers blocked on this rank
  // then fail with UNAVAILABLE.
  ~GlooCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return name_; }

  // AllGather works in place when input.data == output.data + rank *
  // input.bytes().
  std::unique_ptr<Work> AllGather(const Buffer& input,
                                  const Buffer& output) override;
  // Built from gloo::alltoall + a local sum in rank order (deterministic,
  // identical bits for any issue pattern); bf16/fp16 are summed in float and
  // rounded once. `output` may alias `input`.
  std::unique_ptr<Work> ReduceScatter(const Buffer& input, const Buffer& output,
                                      ReduceOp op) override;
  std::unique_ptr<Work> AllReduce(const Buffer& buffer, ReduceOp op) override;
  // Segments travel as point-to-point messages over Gloo's unbound buffers,
  // straight from and into the caller's memory (every rank sends its segments
  // to every peer: the bytes of a ring, no staging copy); see gloo_segments.h.
  bool SupportsSegments() const override { return true; }
  // The reduce-scatter runs in size()-1 rounds, so its scratch is about one
  // output's worth (size()-1 parts of 1/(size()-1) each).
  int64_t ReduceScatterScratchCount(int64_t output_count) const override;
  std::unique_ptr<Work> AllGatherSegments(
      const std::vector<Buffer>& inputs,
      const std::vector<std::vector<Buffer>>& outputs) override;
  std::unique_ptr<Work> ReduceScatterSegments(
      const std::vector<std::vector<Buffer>>& inputs,
      const std::vector<Buffer>& outputs, const Buffer& scratch,
      ReduceOp op) override;
  std::unique_ptr<Work> Broadcast(const Buffer& buffer, int root) override;
  std::unique_ptr<Work> Barrier() override;
  // Point-to-point messages over Gloo's unbound buffers, straight from and
  // into the callers' memory; every transfer of the call is in flight at once.
  bool SupportsSendRecv() const override { return true; }
  std::unique_ptr<Work> SendRecv(
      const std::vector<PeerTransfer>& sends,
      const std::vector<PeerTransfer>& recvs) override;
  // Shuts down this rank's TCP sockets of the group, so Gloo fails every
  // pending operation as for a lost connection (peers blocked on this rank see
  // the connection end within milliseconds), then waits — at most the timeout
  // — for the running collective to return.
  absl::Status Abort(absl::string_view reason) override;

  absl::Duration timeout() const { return timeout_; }

 private:
  struct Core;

  explicit GlooCommunicator(std::shared_ptr<Core> core);

  // Queues `run` (executed in issue order with the collective's tag) and
  // returns its Work.
  std::unique_ptr<Work> Enqueue(
      std::string what, std::function<void(Core& core, uint32_t tag)> run);
  // A Work already completed with `status` (argument errors found at issue
  // time).
  std::unique_ptr<Work> Failed(absl::Status status);
  std::string Describe(const std::string& what) const;

  const std::string name_;
  const int rank_;
  const int size_;
  const absl::Duration timeout_;
  // Queue, Gloo context and execution state; shared with the Work handles so a
  // Work may outlive the communicator.
  const std::shared_ptr<Core> core_;
  // Runs the collectives in issue order; destroyed (drained) first.
  SerialExecutor executor_;
};

}  // namespace hsdp::comm

#endif  // HSDP_WORKER_COMM_GLOO_GLOO_COMMUNICATOR_H_
