// Shared-memory transport for the ranks of a group that live on one host.
//
// Over loopback TCP every byte of a collective is copied twice by the kernel
// and each message costs system calls and event-loop wake-ups; on a CPU
// machine that is CPU time taken from the training itself. ShmCommunicator
// moves the engine's segment collectives (AllGatherSegments,
// ReduceScatterSegments — every all-gather and reduce-scatter of a unit)
// through one shared region instead: a writer copies a chunk into a mailbox
// slot, readers copy (all-gather) or sum (reduce-scatter) straight out of it.
// The other collectives (AllReduce, Broadcast, Barrier, flat AllGather /
// ReduceScatter: small or rare) go to the wrapped communicator, normally Gloo.
//
// Region (shm_region.h): per rank one broadcast mailbox (all-gather: written
// once, read by every peer) and per ordered pair one mailbox (reduce-scatter:
// a writer's contribution to one peer), each with two slots so a writer fills
// one while readers drain the other. Slots hand over with sequence/acknowledge
// counters and futexes (short spin, then sleep: ranks may outnumber cores).
//
// Failure model: every wait is bounded by the timeout and fails with
// DEADLINE_EXCEEDED naming the collective and the rank waited for; a peer
// that destroyed its communicator, or whose process exited (when it shares our
// PID namespace), is noticed within ~50 ms: UNAVAILABLE naming its rank. After
// a failure the communicator is unusable (later calls fail fast), as with Gloo.
// Abort() from any thread fails the running and every later collective with
// ABORTED, and peers waiting on this rank with UNAVAILABLE, within
// milliseconds (every sleeper on the region is woken).
//
// Thread-safety: as Communicator. Segment collectives run one at a time in
// issue order on this communicator's own SerialExecutor; delegated calls
// (ForwardingCommunicator) run on the wrapped communicator's. The two never
// share state, and every rank issues the same sequence on each, so their
// interleaving cannot deadlock.
#ifndef HSDP_WORKER_COMM_SHM_SHM_COMMUNICATOR_H_
#define HSDP_WORKER_COMM_SHM_SHM_COMMUNICATOR_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "hsdp/communicator.h"
#include "hsdp/store.h"
#include "worker/comm/forwarding_communicator.h"
#include "worker/comm/serial_executor.h"

namespace hsdp::comm {

class ShmRegion;

struct ShmOptions {
  // Largest slot; smaller for big groups so the region stays within
  // `max_region_bytes`.
  size_t max_slot_bytes = size_t{256} << 10;
  // The region is reserved up front (tmpfs would otherwise SIGBUS when /dev/shm
  // fills mid-run); a group that needs more falls back to the wrapped
  // communicator.
  size_t max_region_bytes = size_t{64} << 20;
  absl::Duration timeout = absl::Seconds(30);
};

class ShmCommunicator final : public ForwardingCommunicator {
 public:
  // Collective: every rank of `inner`'s group calls it with the same `prefix`
  // (distinct per group and generation). Creates and maps the group's region
  // through `store` (keys "<prefix>/shm/..."). When any rank cannot map it
  // (another host, another IPC namespace, /dev/shm full), every rank returns
  // `inner` itself — the same decision everywhere — and `fallback_reason`
  // (when given) says why. Groups of one are returned as is.
  static absl::StatusOr<std::unique_ptr<Communicator>> Wrap(
      Store& store, const std::string& prefix,
      std::unique_ptr<Communicator> inner, const ShmOptions& options,
      std::string* fallback_reason = nullptr);

  ShmCommunicator(const ShmCommunicator&) = delete;
  ShmCommunicator& operator=(const ShmCommunicator&) = delete;
  // Drains the queued collectives, then unmaps the region.
  ~ShmCommunicator() override;

  // "shm+<inner name>", e.g. "shm+gloo:shard".
  std::string name() const override { return name_; }

  // The flat collectives, Broadcast, Barrier and SendRecv (small or rare) go
  // to the wrapped communicator as they are.
  // Fails this rank's waits (ABORTED) and marks it closed in the region, so
  // peers waiting on it fail at once; aborts the wrapped communicator too.
  absl::Status Abort(absl::string_view reason) override;

  bool SupportsSegments() const override { return true; }
  // Sums straight out of the mailboxes: `scratch` is not used.
  int64_t ReduceScatterScratchCount(int64_t) const override { return 0; }
  std::unique_ptr<Work> AllGatherSegments(
      const std::vector<Buffer>& inputs,
      const std::vector<std::vector<Buffer>>& outputs) override;
  std::unique_ptr<Work> ReduceScatterSegments(
      const std::vector<std::vector<Buffer>>& inputs,
      const std::vector<Buffer>& outputs, const Buffer& scratch,
      ReduceOp op) override;

  // Bytes of one mailbox slot (chunk size of the collectives).
  size_t slot_bytes() const;

 private:
  ShmCommunicator(std::unique_ptr<Communicator> inner,
                  std::shared_ptr<ShmRegion> region, absl::Duration timeout);

  const int rank_;
  const int size_;
  const std::string name_;
  const absl::Duration timeout_;
  const std::shared_ptr<ShmRegion> region_;
  // Runs the segment collectives in issue order; destroyed (drained) first.
  SerialExecutor executor_;
};

}  // namespace hsdp::comm

#endif  // HSDP_WORKER_COMM_SHM_SHM_COMMUNICATOR_H_
