// The shared region of a ShmCommunicator and one rank's view of it: the
// mailboxes the collectives hand chunks over with, and the waits on them.
//
// Layout: a header, one RankInfo per rank (pid, PID namespace, closed flag),
// then the mailboxes: per rank one broadcast mailbox (written once, read by
// every peer) and per ordered pair one mailbox (a writer's data for one
// reader). A mailbox has two slots, each with a sequence counter (bumped by
// the writer once the slot holds its next message) and an acknowledge counter
// (bumped by each reader once done with it), so a writer fills one slot while
// readers drain the other. Counters are futex words on their own cache lines:
// a wait spins briefly, then sleeps (ranks may outnumber cores).
//
// Failure: every wait is bounded by the timeout (DEADLINE_EXCEEDED naming the
// rank waited for); a peer that closed its view, or whose process exited (when
// it shares our PID namespace), fails the wait within ~50 ms (UNAVAILABLE
// naming its rank); after Abort() every wait fails with ABORTED.
//
// Thread-safety: thread-compatible, used by the one task running on the
// communicator's executor (the message counters are that task's bookkeeping;
// the same on every rank by the ordering contract) — except Abort(), which any
// thread may call.
#ifndef HSDP_WORKER_COMM_SHM_SHM_REGION_H_
#define HSDP_WORKER_COMM_SHM_SHM_REGION_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace hsdp::comm {

class ShmRegion {
 public:
  struct Layout {
    size_t slot_bytes = 0;
    size_t mailbox_bytes = 0;  // slot words + 2 slots
    size_t mailboxes_offset = 0;
    size_t total_bytes = 0;
  };

  // The layout for a group of `size`: slots of at most `max_slot_bytes`,
  // shrunk (not below a minimum) until the region fits `max_region_bytes`. A
  // caller checks total_bytes against its limit: the minimum may not fit.
  static Layout ComputeLayout(int size, size_t max_slot_bytes,
                              size_t max_region_bytes);
  // A fresh shm_open name, unique to this process and call.
  static std::string RandomName();

  // Takes over the mapping at `base` (munmap on destruction) of a region of
  // `layout`, as rank `rank` of `size`.
  ShmRegion(void* base, Layout layout, int rank, int size,
            absl::Duration timeout);
  ShmRegion(const ShmRegion&) = delete;
  ShmRegion& operator=(const ShmRegion&) = delete;
  // Marks this rank closed (peers waiting on it fail at once) and unmaps.
  ~ShmRegion();

  // Rank 0, before any peer reads the region: stamps the header.
  void InitHeader();
  // Makes this rank's pid known, so peers notice when its process exits.
  void Publish();

  size_t slot_bytes() const { return layout_.slot_bytes; }
  int rank() const { return rank_; }
  int size() const { return size_; }

  // Mailbox indices: `writer`'s broadcast mailbox, and the mailbox of the
  // ordered pair (writer, reader).
  int Broadcast(int writer) const { return writer; }
  int Pair(int writer, int reader) const {
    return size_ + writer * size_ + reader;
  }

  // Writer side of mailbox `m` read by `readers` ranks: waits until the next
  // slot is free and returns it. `peer` is whom we wait for (-1: any of them).
  // `what` prefixes the error.
  absl::StatusOr<char*> AcquireSend(int m, int readers, int peer,
                                    const std::string& what);
  void CommitSend(int m);
  // Reader side: waits for the next message of mailbox `m` (written by
  // `writer`) and returns it.
  absl::StatusOr<const char*> AcquireRecv(int m, int writer,
                                          const std::string& what);
  void ReleaseRecv(int m);

  // From any thread: makes every wait of this rank fail with ABORTED, marks
  // the rank closed for its peers, and wakes every sleeper on the region (ours
  // and the peers', who then see the rank closed). The first reason stays.
  void Abort(absl::string_view reason);

 private:
  struct Header;
  struct RankInfo;
  struct SlotWords;

  Header& header();
  RankInfo& info(int r);
  char* mailbox(int m);
  SlotWords& words(int m, uint64_t slot);
  char* data(int m, uint64_t slot);

  // Whether `peer` (every peer when -1) may still be running.
  bool PeerAlive(int peer);
  absl::Status AbortedStatus(const std::string& what);
  // Waits until `word` holds `want`; `peer` and `what` as in AcquireSend.
  absl::Status Await(std::atomic<uint32_t>& word, uint32_t want, int peer,
                     const std::string& what);

  char* const base_;
  const Layout layout_;
  const int rank_;
  const int size_;
  const absl::Duration timeout_;
  const uint64_t my_namespace_;
  // Messages written to / read from each mailbox by this rank so far.
  std::vector<uint64_t> sent_;
  std::vector<uint64_t> received_;
  // Set by Abort() from any thread; read by the waits.
  std::atomic<bool> aborted_{false};
  absl::Mutex abort_mu_;
  std::string abort_reason_ ABSL_GUARDED_BY(abort_mu_);
};

}  // namespace hsdp::comm

#endif  // HSDP_WORKER_COMM_SHM_SHM_REGION_H_
