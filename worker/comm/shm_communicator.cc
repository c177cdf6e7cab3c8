#include "worker/comm/shm_communicator.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <fstream>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "common/status_util.h"
#include "worker/comm/reduce_kernels.h"

namespace hsdp::comm {
namespace {

constexpr size_t kCacheLine = 64;
// Slots stay whole elements of every dtype and whole cache lines.
constexpr size_t kSlotAlign = kCacheLine;
constexpr size_t kMinSlotBytes = size_t{16} << 10;
// Busy-wait this many polls before sleeping on the futex: a hand-over between
// running processes takes well under a microsecond, but ranks may outnumber
// cores, and then spinning only delays the writer.
constexpr int kSpinPolls = 200;
// Sleep slices of a wait: how soon a dead peer is noticed.
constexpr absl::Duration kWaitSlice = absl::Milliseconds(50);
constexpr uint64_t kMagic = 0x6873647073686d31;  // "hsdpshm1"

// One futex word on its own cache line (writers and readers of neighbouring
// counters must not share lines).
struct alignas(kCacheLine) Word {
  std::atomic<uint32_t> value;
};
static_assert(sizeof(Word) == kCacheLine);
static_assert(std::atomic<uint32_t>::is_always_lock_free);

struct alignas(kCacheLine) RankInfo {
  int64_t pid;
  uint64_t pid_namespace;  // inode of /proc/self/ns/pid, 0 if unknown
  // Set when the rank destroys its communicator (a normal exit, or an error
  // path that unwinds): peers still waiting on it fail at once, as with a
  // closed TCP connection.
  std::atomic<uint32_t> closed;
};

struct alignas(kCacheLine) Header {
  uint64_t magic;
  uint32_t size;
  uint32_t slot_bytes;
};

// A mailbox: two slots, each with a sequence counter (bumped by the writer
// once the slot holds message k+1 of its uses) and an acknowledge counter
// (bumped by each reader once done with it).
struct alignas(kCacheLine) SlotWords {
  Word seq;
  Word ack;
};

long Futex(std::atomic<uint32_t>* word, int op, uint32_t value,
           const timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value,
                 timeout, nullptr, 0);
}

void Wake(std::atomic<uint32_t>& word) {
  Futex(&word, FUTEX_WAKE, INT_MAX, nullptr);
}

uint64_t PidNamespace() {
  struct stat st;
  if (stat("/proc/self/ns/pid", &st) != 0) return 0;
  return static_cast<uint64_t>(st.st_ino);
}

// False once `pid` has exited — also while it is a zombie its parent has not
// reaped yet (a killed rank whose launcher is slow to wait for it is dead all
// the same).
bool ProcessRunning(pid_t pid) {
  if (kill(pid, 0) != 0) return errno != ESRCH;
  std::ifstream stat(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  if (!std::getline(stat, line)) return true;
  // "pid (comm) S ...": the state follows the last ')' (comm may hold any
  // character).
  const size_t close = line.rfind(')');
  if (close == std::string::npos || close + 2 >= line.size()) return true;
  const char state = line[close + 2];
  return state != 'Z' && state != 'X';
}

std::string RandomName() {
  std::random_device rd;
  const uint64_t r = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  return absl::StrFormat("/hsdp-%d-%016x", getpid(), r);
}

}  // namespace

// The mapped region and the per-rank view of it. Thread-compatible: used by
// the one task running on the communicator's executor (the counters below are
// that task's bookkeeping; the same on every rank by the ordering contract).
class ShmCommunicator::Region {
 public:
  struct Layout {
    size_t slot_bytes = 0;
    size_t mailbox_bytes = 0;  // slot words + 2 slots
    size_t mailboxes_offset = 0;
    size_t total_bytes = 0;
  };

  // Mailboxes: `size` broadcast ones (index = writer), then size x size pair
  // ones (index = size + writer * size + reader; the diagonal is unused).
  static Layout ComputeLayout(int size, const ShmOptions& options) {
    Layout l;
    const size_t mailboxes = static_cast<size_t>(size) * (size + 1);
    const size_t fixed = sizeof(Header) + sizeof(RankInfo) * size;
    size_t slot = options.max_slot_bytes;
    // Shrink the slots until the region fits (not below the minimum).
    while (slot > kMinSlotBytes &&
           fixed + mailboxes * (sizeof(SlotWords) * 2 + 2 * slot) >
               options.max_region_bytes) {
      slot /= 2;
    }
    slot = std::max(kSlotAlign, slot / kSlotAlign * kSlotAlign);
    l.slot_bytes = slot;
    l.mailbox_bytes = sizeof(SlotWords) * 2 + 2 * slot;
    l.mailboxes_offset = (fixed + kCacheLine - 1) / kCacheLine * kCacheLine;
    l.total_bytes = l.mailboxes_offset + mailboxes * l.mailbox_bytes;
    return l;
  }

  Region(void* base, Layout layout, int rank, int size, absl::Duration timeout)
      : base_(static_cast<char*>(base)),
        layout_(layout),
        rank_(rank),
        size_(size),
        timeout_(timeout),
        my_namespace_(PidNamespace()),
        sent_(static_cast<size_t>(size) * (size + 1), 0),
        received_(static_cast<size_t>(size) * (size + 1), 0) {}
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;
  ~Region() {
    info(rank_).closed.store(1, std::memory_order_release);
    munmap(base_, layout_.total_bytes);
  }

  Header& header() { return *reinterpret_cast<Header*>(base_); }
  RankInfo& info(int r) {
    return reinterpret_cast<RankInfo*>(base_ + sizeof(Header))[r];
  }
  void Publish() {
    info(rank_).pid = getpid();
    info(rank_).pid_namespace = my_namespace_;
  }
  size_t slot_bytes() const { return layout_.slot_bytes; }
  int rank() const { return rank_; }
  int size() const { return size_; }

  int Broadcast(int writer) const { return writer; }
  int Pair(int writer, int reader) const {
    return size_ + writer * size_ + reader;
  }

  // Writer side of mailbox `m` read by `readers` ranks: waits until the next
  // slot is free and returns it. `peer` is whom we wait for (-1: any of them).
  absl::StatusOr<char*> AcquireSend(int m, int readers, int peer,
                                    const std::string& what) {
    const uint64_t n = sent_[m];
    SlotWords& w = words(m, n % 2);
    const uint32_t want = static_cast<uint32_t>((n / 2) * readers);
    HSDP_RETURN_IF_ERROR(Await(w.ack.value, want, peer, what));
    return data(m, n % 2);
  }
  void CommitSend(int m) {
    const uint64_t n = sent_[m]++;
    SlotWords& w = words(m, n % 2);
    w.seq.value.store(static_cast<uint32_t>(n / 2 + 1),
                      std::memory_order_release);
    Wake(w.seq.value);
  }
  // Reader side: waits for the next message of mailbox `m` (written by
  // `writer`) and returns it.
  absl::StatusOr<const char*> AcquireRecv(int m, int writer,
                                          const std::string& what) {
    const uint64_t n = received_[m];
    SlotWords& w = words(m, n % 2);
    HSDP_RETURN_IF_ERROR(
        Await(w.seq.value, static_cast<uint32_t>(n / 2 + 1), writer, what));
    return data(m, n % 2);
  }
  void ReleaseRecv(int m) {
    const uint64_t n = received_[m]++;
    SlotWords& w = words(m, n % 2);
    w.ack.value.fetch_add(1, std::memory_order_acq_rel);
    Wake(w.ack.value);
  }

  // From any thread: makes every wait of this rank fail with ABORTED, marks
  // the rank closed for its peers, and wakes every sleeper on the region (ours
  // and the peers', who then see the rank closed). The first reason stays.
  void Abort(absl::string_view reason) {
    {
      absl::MutexLock lock(&abort_mu_);
      if (aborted_.load(std::memory_order_relaxed)) return;
      abort_reason_ = std::string(reason);
      aborted_.store(true, std::memory_order_release);
    }
    info(rank_).closed.store(1, std::memory_order_release);
    const int mailboxes = size_ * (size_ + 1);
    for (int m = 0; m < mailboxes; ++m) {
      for (int slot = 0; slot < 2; ++slot) {
        Wake(words(m, slot).seq.value);
        Wake(words(m, slot).ack.value);
      }
    }
  }

 private:
  char* mailbox(int m) {
    return base_ + layout_.mailboxes_offset + m * layout_.mailbox_bytes;
  }
  SlotWords& words(int m, uint64_t slot) {
    return reinterpret_cast<SlotWords*>(mailbox(m))[slot];
  }
  char* data(int m, uint64_t slot) {
    return mailbox(m) + 2 * sizeof(SlotWords) + slot * layout_.slot_bytes;
  }

  // Whether `peer` (every peer when -1) may still be running.
  bool PeerAlive(int peer) {
    if (peer < 0) {
      for (int p = 0; p < size_; ++p) {
        if (p != rank_ && !PeerAlive(p)) return false;
      }
      return true;
    }
    RankInfo& i = info(peer);
    if (i.closed.load(std::memory_order_acquire) != 0) return false;
    // Another PID namespace (or unknown): its pid means nothing here.
    if (i.pid_namespace == 0 || i.pid_namespace != my_namespace_) return true;
    return ProcessRunning(static_cast<pid_t>(i.pid));
  }

  absl::Status AbortedStatus(const std::string& what) {
    absl::MutexLock lock(&abort_mu_);
    return absl::AbortedError(absl::StrCat(what, " aborted: ", abort_reason_));
  }

  absl::Status Await(std::atomic<uint32_t>& word, uint32_t want, int peer,
                     const std::string& what) {
    for (int i = 0; i < kSpinPolls; ++i) {
      if (word.load(std::memory_order_acquire) == want) return absl::OkStatus();
      __builtin_ia32_pause();
    }
    const absl::Time deadline = absl::Now() + timeout_;
    for (;;) {
      if (aborted_.load(std::memory_order_acquire)) return AbortedStatus(what);
      const uint32_t seen = word.load(std::memory_order_acquire);
      if (seen == want) return absl::OkStatus();
      const absl::Time now = absl::Now();
      if (now >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            what, " timed out after ", absl::FormatDuration(timeout_),
            " waiting for ",
            peer < 0 ? std::string("a peer") : absl::StrCat("rank ", peer),
            " (it never issued this collective, is stuck, or is dead)"));
      }
      if (!PeerAlive(peer)) {
        // It may have done what we wait for just before leaving (a normal
        // end): what it stored before closing is visible now.
        if (word.load(std::memory_order_acquire) == want) {
          return absl::OkStatus();
        }
        int lost = peer;
        for (int p = 0; lost < 0 && p < size_; ++p) {
          if (p != rank_ && !PeerAlive(p)) lost = p;
        }
        return absl::UnavailableError(absl::StrCat(
            what, " failed: lost peer rank ", lost,
            info(lost).closed.load(std::memory_order_acquire) != 0
                ? " (it closed its communicator)"
                : absl::StrCat(" (process ", info(lost).pid, " exited)")));
      }
      const timespec ts =
          absl::ToTimespec(std::min(kWaitSlice, deadline - now));
      Futex(&word, FUTEX_WAIT, seen, &ts);
    }
  }

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

namespace {

// Copies bytes [offset, offset + n) of the concatenation of `segments` to
// `dst` (gather) or from `src` into it (scatter).
void Gather(const std::vector<Buffer>& segments, size_t offset, size_t n,
            char* dst) {
  ForEachSegmentPiece(
      segments, offset, n,
      [&](size_t k, size_t in_segment, size_t in_range, size_t len) {
        std::memcpy(dst + in_range,
                    static_cast<const char*>(segments[k].data) + in_segment,
                    len);
      });
}

void Scatter(const char* src, size_t offset, size_t n,
             const std::vector<Buffer>& segments) {
  ForEachSegmentPiece(
      segments, offset, n,
      [&](size_t k, size_t in_segment, size_t in_range, size_t len) {
        std::memcpy(static_cast<char*>(segments[k].data) + in_segment,
                    src + in_range, len);
      });
}

size_t TotalBytes(const std::vector<Buffer>& segments) {
  size_t total = 0;
  for (const Buffer& b : segments) total += b.bytes();
  return total;
}

size_t Chunks(size_t bytes, size_t chunk) {
  return (bytes + chunk - 1) / chunk;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> ShmCommunicator::Wrap(
    Store& store, const std::string& prefix,
    std::unique_ptr<Communicator> inner, const ShmOptions& options,
    std::string* fallback_reason) {
  if (inner == nullptr) {
    return absl::InvalidArgumentError("ShmCommunicator::Wrap: no communicator");
  }
  const int size = inner->size();
  const int rank = inner->rank();
  auto fall_back = [&](std::string reason) {
    if (fallback_reason != nullptr) *fallback_reason = std::move(reason);
    return std::move(inner);
  };
  if (size == 1) return fall_back("a group of one has no peers");
  const Region::Layout layout = Region::ComputeLayout(size, options);
  // Decided alike on every rank (same size, same options).
  if (layout.total_bytes > options.max_region_bytes) {
    return fall_back(absl::StrCat("a group of ", size, " needs ",
                                  layout.total_bytes,
                                  " bytes of shared memory, more than the ",
                                  options.max_region_bytes, " allowed"));
  }
  const std::string name_key = absl::StrCat(prefix, "/shm/name");
  auto ready_key = [&prefix](int r) {
    return absl::StrCat(prefix, "/shm/ready/", r);
  };

  // Rank 0 creates and reserves the region; the others open it by name.
  std::string name, problem;
  int fd = -1;
  if (rank == 0) {
    name = RandomName();
    fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) {
      problem = absl::StrCat("shm_open(", name, "): ", std::strerror(errno));
    } else if (const int err = posix_fallocate(
                   fd, 0, static_cast<off_t>(layout.total_bytes));
               err != 0) {
      problem = absl::StrCat("reserving ", layout.total_bytes, " bytes in ",
                             name, ": ", std::strerror(err));
    }
    HSDP_RETURN_IF_ERROR(store.Set(name_key, problem.empty() ? name : ""));
  } else {
    HSDP_ASSIGN_OR_RETURN(name, store.Get(name_key, options.timeout));
    if (name.empty()) {
      problem = "rank 0 could not create the region";
    } else {
      fd = shm_open(name.c_str(), O_RDWR, 0);
      struct stat st;
      if (fd < 0) {
        problem = absl::StrCat("shm_open(", name, "): ", std::strerror(errno),
                               " (another host or IPC namespace?)");
      } else if (fstat(fd, &st) != 0 ||
                 static_cast<size_t>(st.st_size) != layout.total_bytes) {
        problem = absl::StrCat(name, " has an unexpected size");
      }
    }
  }
  void* base = MAP_FAILED;
  if (problem.empty()) {
    base = mmap(nullptr, layout.total_bytes, PROT_READ | PROT_WRITE, MAP_SHARED,
                fd, 0);
    if (base == MAP_FAILED) {
      problem = absl::StrCat("mmap(", name, "): ", std::strerror(errno));
    }
  }
  if (fd >= 0) close(fd);
  std::shared_ptr<Region> region;
  if (base != MAP_FAILED) {
    region =
        std::make_shared<Region>(base, layout, rank, size, options.timeout);
    if (rank == 0) {
      region->header().magic = kMagic;
      region->header().size = static_cast<uint32_t>(size);
      region->header().slot_bytes = static_cast<uint32_t>(layout.slot_bytes);
    }
    region->Publish();  // before "ready": peers may check our pid from then
  }

  // Everyone learns whether everyone mapped it: the same decision on every
  // rank.
  HSDP_RETURN_IF_ERROR(
      store.Set(ready_key(rank), problem.empty() ? "ok" : problem));
  std::string first_problem;
  for (int r = 0; r < size; ++r) {
    HSDP_ASSIGN_OR_RETURN(const std::string v,
                          store.Get(ready_key(r), options.timeout));
    if (v != "ok" && first_problem.empty()) {
      first_problem = absl::StrCat("rank ", r, ": ", v);
    }
  }
  // Mapped everywhere (or given up): the name is no longer needed, and
  // unlinking now leaves nothing behind in /dev/shm when processes die.
  if (rank == 0 && !name.empty()) shm_unlink(name.c_str());
  if (!first_problem.empty()) return fall_back(first_problem);
  return std::unique_ptr<Communicator>(new ShmCommunicator(
      std::move(inner), std::move(region), options.timeout));
}

ShmCommunicator::ShmCommunicator(std::unique_ptr<Communicator> inner,
                                 std::shared_ptr<Region> region,
                                 absl::Duration timeout)
    : rank_(inner->rank()),
      size_(inner->size()),
      name_(absl::StrCat("shm+", inner->name())),
      timeout_(timeout),
      inner_(std::move(inner)),
      region_(std::move(region)),
      executor_(
          [name = name_, rank = rank_, size = size_](const std::string& what) {
            return absl::StrCat(what, " on ", name, " (rank ", rank, " of ",
                                size, ")");
          }) {}

ShmCommunicator::~ShmCommunicator() = default;

absl::Status ShmCommunicator::Abort(absl::string_view reason) {
  executor_.Abort(reason);
  region_->Abort(reason);
  const absl::Status inner = inner_->Abort(reason);
  if (!executor_.WaitIdle(absl::Now() + timeout_)) {
    return absl::DeadlineExceededError(absl::StrCat(
        "Abort on ", name_, ": the running collective did not stop within ",
        absl::FormatDuration(timeout_), "; its buffers must stay alive"));
  }
  return inner;
}

size_t ShmCommunicator::slot_bytes() const { return region_->slot_bytes(); }

std::unique_ptr<Work> ShmCommunicator::AllGatherSegments(
    const std::vector<Buffer>& inputs,
    const std::vector<std::vector<Buffer>>& outputs) {
  const std::string where = absl::StrCat("AllGatherSegments on ", name_);
  if (absl::Status status =
          CheckAllGatherSegments(where, inputs, outputs, size_);
      !status.ok()) {
    return CompletedWork(std::move(status));
  }
  const size_t total = TotalBytes(inputs);
  return executor_.Enqueue(
      absl::StrCat("AllGatherSegments(", inputs.size(), " segments, ", total,
                   " B/rank)"),
      [region = region_, inputs, outputs, total](
          uint64_t, const std::string& where) -> absl::Status {
        Region& r = *region;
        const int me = r.rank(), size = r.size();
        const size_t chunk = r.slot_bytes();
        for (size_t k = 0; k < inputs.size(); ++k) {
          const Buffer& own = outputs[me][k];
          if (own.data != inputs[k].data && own.count > 0)
            std::memcpy(own.data, inputs[k].data, own.bytes());
        }
        for (size_t c = 0; c < Chunks(total, chunk); ++c) {
          const size_t offset = c * chunk;
          const size_t n = std::min(chunk, total - offset);
          // Our chunk once into our broadcast mailbox, read by every peer.
          HSDP_ASSIGN_OR_RETURN(
              char* slot,
              r.AcquireSend(r.Broadcast(me), size - 1, /*peer=*/-1, where));
          Gather(inputs, offset, n, slot);
          r.CommitSend(r.Broadcast(me));
          // Peers in ring order from our right: spreads the readers out.
          for (int i = 1; i < size; ++i) {
            const int p = (me + i) % size;
            HSDP_ASSIGN_OR_RETURN(const char* src,
                                  r.AcquireRecv(r.Broadcast(p), p, where));
            Scatter(src, offset, n, outputs[p]);
            r.ReleaseRecv(r.Broadcast(p));
          }
        }
        return absl::OkStatus();
      });
}

std::unique_ptr<Work> ShmCommunicator::ReduceScatterSegments(
    const std::vector<std::vector<Buffer>>& inputs,
    const std::vector<Buffer>& outputs, const Buffer& /*scratch*/,
    ReduceOp op) {
  const std::string where = absl::StrCat("ReduceScatterSegments on ", name_);
  if (absl::Status status =
          CheckReduceScatterSegments(where, inputs, outputs, rank_, size_);
      !status.ok()) {
    return CompletedWork(std::move(status));
  }
  const DataType dtype =
      outputs.empty() ? DataType::kFloat32 : outputs[0].dtype;
  const size_t total = TotalBytes(outputs);
  return executor_.Enqueue(
      absl::StrCat("ReduceScatterSegments(", outputs.size(), " segments, ",
                   total, " B/rank, ", DataTypeName(dtype), ")"),
      [region = region_, inputs, outputs, total, dtype, op](
          uint64_t, const std::string& where) -> absl::Status {
        Region& r = *region;
        const int me = r.rank(), size = r.size();
        const size_t chunk = r.slot_bytes();
        const size_t element = ElementSize(dtype);
        std::vector<size_t> to_peer(size);
        size_t rounds = Chunks(total, chunk);
        for (int q = 0; q < size; ++q) {
          to_peer[q] = TotalBytes(inputs[q]);
          if (q != me) rounds = std::max(rounds, Chunks(to_peer[q], chunk));
        }
        std::vector<const char*> from(size);
        std::vector<const void*> terms(size);
        for (size_t c = 0; c < rounds; ++c) {
          const size_t offset = c * chunk;
          // Our contribution to each peer's chunk c, into our pair mailbox.
          for (int i = 1; i < size; ++i) {
            const int q = (me + i) % size;
            if (offset >= to_peer[q]) continue;
            HSDP_ASSIGN_OR_RETURN(char* slot,
                                  r.AcquireSend(r.Pair(me, q), 1, q, where));
            Gather(inputs[q], offset, std::min(chunk, to_peer[q] - offset),
                   slot);
            r.CommitSend(r.Pair(me, q));
          }
          if (offset >= total) continue;
          const size_t n = std::min(chunk, total - offset);
          for (int p = 0; p < size; ++p) {
            if (p == me) continue;
            HSDP_ASSIGN_OR_RETURN(from[p],
                                  r.AcquireRecv(r.Pair(p, me), p, where));
          }
          // Sum chunk c segment by segment, terms in rank order (the same
          // bits as the flat ReduceScatter), straight out of the mailboxes.
          ForEachSegmentPiece(
              outputs, offset, n,
              [&](size_t k, size_t in_segment, size_t in_range, size_t len) {
                for (int p = 0; p < size; ++p) {
                  terms[p] =
                      p == me ? static_cast<const char*>(inputs[me][k].data) +
                                    in_segment
                              : from[p] + in_range;
                }
                ReduceBuffers(terms.data(), size,
                              static_cast<int64_t>(len / element), dtype, op,
                              static_cast<char*>(outputs[k].data) + in_segment);
              });
          for (int p = 0; p < size; ++p) {
            if (p != me) r.ReleaseRecv(r.Pair(p, me));
          }
        }
        return absl::OkStatus();
      });
}

}  // namespace hsdp::comm
