#include "worker/comm/shm/shm_region.h"

#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <fstream>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/status_util.h"

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

}  // namespace

struct alignas(kCacheLine) ShmRegion::Header {
  uint64_t magic;
  uint32_t size;
  uint32_t slot_bytes;
};

struct alignas(kCacheLine) ShmRegion::RankInfo {
  int64_t pid;
  uint64_t pid_namespace;  // inode of /proc/self/ns/pid, 0 if unknown
  // Set when the rank destroys its communicator (a normal exit, or an error
  // path that unwinds): peers still waiting on it fail at once, as with a
  // closed TCP connection.
  std::atomic<uint32_t> closed;
};

// A mailbox: two slots, each with a sequence counter (bumped by the writer
// once the slot holds message k+1 of its uses) and an acknowledge counter
// (bumped by each reader once done with it).
struct alignas(kCacheLine) ShmRegion::SlotWords {
  Word seq;
  Word ack;
};

// Mailboxes: `size` broadcast ones (index = writer), then size x size pair
// ones (index = size + writer * size + reader; the diagonal is unused).
ShmRegion::Layout ShmRegion::ComputeLayout(int size, size_t max_slot_bytes,
                                           size_t max_region_bytes) {
  Layout l;
  const size_t mailboxes = static_cast<size_t>(size) * (size + 1);
  const size_t fixed = sizeof(Header) + sizeof(RankInfo) * size;
  size_t slot = max_slot_bytes;
  // Shrink the slots until the region fits (not below the minimum).
  while (slot > kMinSlotBytes &&
         fixed + mailboxes * (sizeof(SlotWords) * 2 + 2 * slot) >
             max_region_bytes) {
    slot /= 2;
  }
  slot = std::max(kSlotAlign, slot / kSlotAlign * kSlotAlign);
  l.slot_bytes = slot;
  l.mailbox_bytes = sizeof(SlotWords) * 2 + 2 * slot;
  l.mailboxes_offset = (fixed + kCacheLine - 1) / kCacheLine * kCacheLine;
  l.total_bytes = l.mailboxes_offset + mailboxes * l.mailbox_bytes;
  return l;
}

std::string ShmRegion::RandomName() {
  std::random_device rd;
  const uint64_t r = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  return absl::StrFormat("/hsdp-%d-%016x", getpid(), r);
}

ShmRegion::ShmRegion(void* base, Layout layout, int rank, int size,
                     absl::Duration timeout)
    : base_(static_cast<char*>(base)),
      layout_(layout),
      rank_(rank),
      size_(size),
      timeout_(timeout),
      my_namespace_(PidNamespace()),
      sent_(static_cast<size_t>(size) * (size + 1), 0),
      received_(static_cast<size_t>(size) * (size + 1), 0) {}

ShmRegion::~ShmRegion() {
  info(rank_).closed.store(1, std::memory_order_release);
  munmap(base_, layout_.total_bytes);
}

void ShmRegion::InitHeader() {
  header().magic = kMagic;
  header().size = static_cast<uint32_t>(size_);
  header().slot_bytes = static_cast<uint32_t>(layout_.slot_bytes);
}

void ShmRegion::Publish() {
  info(rank_).pid = getpid();
  info(rank_).pid_namespace = my_namespace_;
}

ShmRegion::Header& ShmRegion::header() {
  return *reinterpret_cast<Header*>(base_);
}

ShmRegion::RankInfo& ShmRegion::info(int r) {
  return reinterpret_cast<RankInfo*>(base_ + sizeof(Header))[r];
}

char* ShmRegion::mailbox(int m) {
  return base_ + layout_.mailboxes_offset + m * layout_.mailbox_bytes;
}

ShmRegion::SlotWords& ShmRegion::words(int m, uint64_t slot) {
  return reinterpret_cast<SlotWords*>(mailbox(m))[slot];
}

char* ShmRegion::data(int m, uint64_t slot) {
  return mailbox(m) + 2 * sizeof(SlotWords) + slot * layout_.slot_bytes;
}

absl::StatusOr<char*> ShmRegion::AcquireSend(int m, int readers, int peer,
                                             const std::string& what) {
  const uint64_t n = sent_[m];
  SlotWords& w = words(m, n % 2);
  const uint32_t want = static_cast<uint32_t>((n / 2) * readers);
  HSDP_RETURN_IF_ERROR(Await(w.ack.value, want, peer, what));
  return data(m, n % 2);
}

void ShmRegion::CommitSend(int m) {
  const uint64_t n = sent_[m]++;
  SlotWords& w = words(m, n % 2);
  w.seq.value.store(static_cast<uint32_t>(n / 2 + 1),
                    std::memory_order_release);
  Wake(w.seq.value);
}

absl::StatusOr<const char*> ShmRegion::AcquireRecv(int m, int writer,
                                                   const std::string& what) {
  const uint64_t n = received_[m];
  SlotWords& w = words(m, n % 2);
  HSDP_RETURN_IF_ERROR(
      Await(w.seq.value, static_cast<uint32_t>(n / 2 + 1), writer, what));
  return data(m, n % 2);
}

void ShmRegion::ReleaseRecv(int m) {
  const uint64_t n = received_[m]++;
  SlotWords& w = words(m, n % 2);
  w.ack.value.fetch_add(1, std::memory_order_acq_rel);
  Wake(w.ack.value);
}

void ShmRegion::Abort(absl::string_view reason) {
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

bool ShmRegion::PeerAlive(int peer) {
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

absl::Status ShmRegion::AbortedStatus(const std::string& what) {
  absl::MutexLock lock(&abort_mu_);
  return absl::AbortedError(absl::StrCat(what, " aborted: ", abort_reason_));
}

absl::Status ShmRegion::Await(std::atomic<uint32_t>& word, uint32_t want,
                              int peer, const std::string& what) {
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
    const timespec ts = absl::ToTimespec(std::min(kWaitSlice, deadline - now));
    Futex(&word, FUTEX_WAIT, seen, &ts);
  }
}

}  // namespace hsdp::comm
