#include "worker/comm/gloo_communicator.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <exception>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gloo/allgather.h"
#include "gloo/allreduce.h"
#include "gloo/alltoall.h"
#include "gloo/barrier.h"
#include "gloo/broadcast.h"
#include "gloo/common/error.h"
#include "gloo/rendezvous/context.h"
#include "gloo/transport/address.h"
#include "gloo/transport/pair.h"
#include "gloo/transport/tcp/address.h"
#include "gloo/transport/tcp/device.h"
#include "gloo/transport/unbound_buffer.h"
#include "gloo/types.h"
#include "worker/comm/gloo_store.h"
#include "worker/comm/reduce_kernels.h"

namespace hsdp::comm {
namespace {

// ReduceScatterSegments moves each stream in size-1 parts, one round each, so
// the peers' contributions need one output's worth of scratch, not size-1.
int Rounds(int size) { return std::max(1, size - 1); }

// AllGatherSegments packs segments smaller than this into one message per
// peer (a copy of a few KiB beats a Gloo round trip per segment).
constexpr size_t kPackBelowBytes = size_t{64} << 10;

// A segment list split for transfer: segments under kPackBelowBytes travel
// packed together, the others on their own (empty ones not at all).
struct SegmentSplit {
  std::vector<Buffer> large;
  std::vector<size_t> large_k;  // index in the full list of large[i]
  std::vector<size_t> small_k;
  size_t small_bytes = 0;
};

SegmentSplit SplitSegments(const std::vector<Buffer>& segments) {
  SegmentSplit split;
  for (size_t k = 0; k < segments.size(); ++k) {
    const size_t bytes = segments[k].bytes();
    if (bytes == 0) continue;
    if (bytes < kPackBelowBytes) {
      split.small_k.push_back(k);
      split.small_bytes += bytes;
    } else {
      split.large.push_back(segments[k]);
      split.large_k.push_back(k);
    }
  }
  return split;
}

// Slot prefix of the segment collectives' point-to-point messages; Gloo's own
// algorithms use other prefixes, and the tag (issue counter) separates calls.
constexpr uint8_t kSegmentSlotPrefix = 0x5e;
// Slot prefix of SendRecv's messages.
constexpr uint8_t kSendRecvSlotPrefix = 0x5f;

// Abort() unblocks a collective stuck in Gloo by shutting down (both ways)
// the TCP sockets of this rank's pairs: the device thread then reads EOF, and
// Gloo's own connection-lost path fails every pending operation of the pair
// (waking the blocked waiter) and closes it; the peer reads EOF too and fails
// at once. Debian's Gloo (2022-05) offers no public abort that wakes a local
// waiter: Context::closeConnections() and Pair::close() close the sockets
// without failing the pending operations (a local wait runs into its
// timeout), UnboundBuffer::abortWaitRecv/abortWaitSend reach only buffers the
// caller created (Gloo's algorithms create theirs inside), and the path Gloo
// takes on an application timeout (tcp::Pair::signalExceptionExternal) is
// protected, in a header whose include (gloo/common/memory.h) is missing from
// the package. The sockets are found among /proc/self/fd by both ends'
// addresses, checked on a dup()ed descriptor, so a number reused meanwhile is
// never shut down by mistake.
//
using SocketEnds = std::pair<std::string, std::string>;

// Shuts down every socket whose (local, remote) address pair, in Gloo's
// Address::str() form, is in `ends`; returns those it shut down.
std::set<SocketEnds> ShutdownSockets(const std::set<SocketEnds>& ends) {
  std::set<SocketEnds> found;
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return found;
  while (const dirent* entry = readdir(dir)) {
    int fd = -1;
    if (!absl::SimpleAtoi(entry->d_name, &fd) || fd == dirfd(dir)) continue;
    const int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (own < 0) continue;
    struct stat st;
    sockaddr_storage addr;
    socklen_t len = sizeof(addr);
    if (fstat(own, &st) == 0 && S_ISSOCK(st.st_mode) &&
        getsockname(own, reinterpret_cast<sockaddr*>(&addr), &len) == 0 &&
        (addr.ss_family == AF_INET || addr.ss_family == AF_INET6)) {
      len = sizeof(addr);
      if (getpeername(own, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
        SocketEnds key(gloo::transport::tcp::Address::fromSockName(own).str(),
                       gloo::transport::tcp::Address::fromPeerName(own).str());
        if (ends.count(key) > 0 && shutdown(own, SHUT_RDWR) == 0) {
          found.insert(std::move(key));
        }
      }
    }
    close(own);
  }
  closedir(dir);
  return found;
}

// Gloo's tcp transport says this when a send/recv did not complete within the
// timeout.
constexpr char kGlooTimeoutText[] = "Timed out";

std::chrono::milliseconds ToChrono(absl::Duration d) {
  return std::chrono::milliseconds(absl::ToInt64Milliseconds(d));
}

// Calls fn(T{}) with an unsigned integer type T of `element_size` bytes.
template <typename Fn>
void WithElementOfSize(size_t element_size, Fn&& fn) {
  switch (element_size) {
    case 1:
      return fn(uint8_t{});
    case 2:
      return fn(uint16_t{});
    case 4:
      return fn(uint32_t{});
    default:
      return fn(uint64_t{});
  }
}

constexpr char kPairAddressesKey[] = "pair_addresses";

// Gloo names a lost peer only by the TCP address of its end of the pair, so
// after connecting every rank publishes its pair ends (one line per peer rank)
// and reads which address each peer uses towards it. Returns that address per
// peer rank ("" for this rank).
absl::StatusOr<std::vector<std::string>> ExchangePairAddresses(
    Store& store, const std::string& prefix, gloo::Context& context,
    absl::Duration timeout) {
  std::vector<std::string> mine(context.size), theirs(context.size);
  if (context.size == 1) return theirs;
  for (int p = 0; p < context.size; ++p) {
    if (p != context.rank) mine[p] = context.getPair(p)->address().str();
  }
  auto key = [&prefix](int r) {
    return absl::StrCat(prefix, "/", kPairAddressesKey, "/", r);
  };
  absl::Status status = store.Set(key(context.rank), absl::StrJoin(mine, "\n"));
  if (!status.ok()) return status;
  for (int p = 0; p < context.size; ++p) {
    if (p == context.rank) continue;
    absl::StatusOr<std::string> value = store.Get(key(p), timeout);
    if (!value.ok()) return value.status();
    std::vector<std::string> lines = absl::StrSplit(*value, '\n');
    if (lines.size() != static_cast<size_t>(context.size)) {
      return absl::InternalError(
          absl::StrCat("malformed store value for ", key(p)));
    }
    theirs[p] = lines[context.rank];
  }
  return theirs;
}

// "[10.0.0.5]" of "[10.0.0.5]:4242" (Gloo's address format), "" if none.
std::string HostOf(const std::string& address) {
  const size_t end = address.find(']');
  return end == std::string::npos ? "" : address.substr(0, end + 1);
}

// All-gather output / reduce-scatter input (`whole`) must hold `size` x the
// elements of the per-rank `part`, in the same dtype.
absl::Status CheckPartAndWhole(const std::string& where, const Buffer& part,
                               const Buffer& whole, int size) {
  if (part.dtype == whole.dtype && part.count >= 0 &&
      whole.count == part.count * size) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      where,
      ": the full buffer must hold size() x the per-rank elements, same "
      "dtype (per-rank ",
      part.count, " ", DataTypeName(part.dtype), ", full ", whole.count, " ",
      DataTypeName(whole.dtype), ")"));
}

}  // namespace

int FindPeerInGlooError(const std::string& text,
                        const std::vector<std::string>& peer_addresses) {
  const int size = static_cast<int>(peer_addresses.size());
  for (int p = 0; p < size; ++p) {
    if (!peer_addresses[p].empty() &&
        absl::StrContains(text, peer_addresses[p])) {
      return p;
    }
  }
  // The accepting end of a pair knows the peer by its ephemeral port, which no
  // one published; the host alone still names the peer when it is unique.
  int found = -1;
  for (int p = 0; p < size; ++p) {
    const std::string host = HostOf(peer_addresses[p]);
    if (host.empty() || !absl::StrContains(text, host + ":")) continue;
    if (found >= 0) return -1;  // several peers on that host
    found = p;
  }
  return found;
}

// Everything a collective needs to execute. Thread-compatible: only the task
// the SerialExecutor is running touches it, one at a time.
struct GlooCommunicator::Core {
  Core(std::shared_ptr<gloo::Context> context, std::string name, int rank,
       int size, absl::Duration timeout)
      : context(std::move(context)),
        name(std::move(name)),
        rank(rank),
        size(size),
        timeout(timeout) {}

  std::string Describe(const std::string& what) const {
    return absl::StrCat(what, " on ", name, " (rank ", rank, " of ", size, ")");
  }

  // Converts the in-flight exception of a failed collective into a Status.
  // `where` is the collective's error prefix (Describe of its name).
  absl::Status CurrentExceptionToStatus(const std::string& where) const;

  const std::shared_ptr<gloo::Context> context;
  const std::string name;
  const int rank;
  const int size;
  const absl::Duration timeout;

  // peer_addresses[p]: the TCP address of peer p's end of our pair, which is
  // how Gloo names a peer in its errors (set once, before any collective).
  std::vector<std::string> peer_addresses;

  // The reduce-scatter receive buffer, kept across calls to avoid a large
  // allocation per call.
  std::vector<char> scratch;
  // Unbound buffers of a failed segment collective: Gloo may still hold
  // pointers to them, so they live as long as the (broken) communicator.
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> orphans;

  // Set once by Abort(); read by the failing collective to report ABORTED.
  // Thread-safe.
  void SetAborted(absl::string_view reason) {
    absl::MutexLock lock(&abort_mu);
    if (!aborted) {
      aborted = true;
      abort_reason = std::string(reason);
    }
  }
  bool IsAborted(std::string* reason) const {
    absl::MutexLock lock(&abort_mu);
    if (aborted && reason != nullptr) *reason = abort_reason;
    return aborted;
  }
  mutable absl::Mutex abort_mu;
  bool aborted ABSL_GUARDED_BY(abort_mu) = false;
  std::string abort_reason ABSL_GUARDED_BY(abort_mu);
};

namespace {

// The point-to-point messages of one segment collective. Waits with one
// deadline for the whole call; on an exception (timeout, lost peer) the
// buffers are handed to the communicator instead of being freed under Gloo.
class PointToPoint {
 public:
  PointToPoint(
      gloo::Context& context, uint32_t tag,
      std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>>& orphans,
      absl::Duration timeout, uint8_t slot_prefix = kSegmentSlotPrefix)
      : context_(context),
        slot_(gloo::Slot::build(slot_prefix, tag)),
        orphans_(orphans),
        deadline_(std::chrono::steady_clock::now() + ToChrono(timeout)) {}
  PointToPoint(const PointToPoint&) = delete;
  PointToPoint& operator=(const PointToPoint&) = delete;
  ~PointToPoint() {
    if (!finished_) {
      for (auto& b : buffers_) orphans_.push_back(std::move(b.buffer));
    }
  }

  // Messages between one pair on one slot are matched in posting order.
  void Send(void* data, size_t bytes, const std::vector<int>& peers) {
    if (bytes == 0 || peers.empty()) return;
    Entry& e = Add(data, bytes);
    for (int p : peers) e.buffer->send(p, slot_, 0, bytes);
    e.sends += static_cast<int>(peers.size());
  }
  // Receives `bytes` from `peer` at `offset` of the region (data,
  // region_bytes); consecutive receives into the same region share one buffer.
  void Recv(void* data, size_t region_bytes, size_t offset, size_t bytes,
            int peer) {
    if (bytes == 0) return;
    if (buffers_.empty() || buffers_.back().buffer->ptr != data ||
        buffers_.back().buffer->size != region_bytes) {
      Add(data, region_bytes);
    }
    Entry& e = buffers_.back();
    e.buffer->recv(peer, slot_, offset, bytes);
    ++e.recvs;
  }
  void WaitAll() {
    for (Entry& e : buffers_) {
      for (; e.recvs > 0; --e.recvs) e.buffer->waitRecv(Remaining());
    }
    for (Entry& e : buffers_) {
      for (; e.sends > 0; --e.sends) e.buffer->waitSend(Remaining());
    }
    finished_ = true;
  }

 private:
  struct Entry {
    std::unique_ptr<gloo::transport::UnboundBuffer> buffer;
    int sends = 0;
    int recvs = 0;
  };
  Entry& Add(void* data, size_t bytes) {
    buffers_.push_back(Entry{context_.createUnboundBuffer(data, bytes)});
    return buffers_.back();
  }
  // At least 1 ms: Gloo reads -1 ms as "the context default".
  std::chrono::milliseconds Remaining() const {
    return std::max(std::chrono::milliseconds(1),
                    std::chrono::duration_cast<std::chrono::milliseconds>(
                        deadline_ - std::chrono::steady_clock::now()));
  }

  gloo::Context& context_;
  const uint64_t slot_;
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>>& orphans_;
  const std::chrono::steady_clock::time_point deadline_;
  std::deque<Entry> buffers_;  // stable addresses while adding
  bool finished_ = false;
};

}  // namespace

absl::StatusOr<std::shared_ptr<gloo::transport::Device>> CreateGlooDevice(
    const GlooDeviceOptions& options) {
  if (!options.hostname.empty() && !options.iface.empty()) {
    return absl::InvalidArgumentError(
        "set either a Gloo hostname or an interface, not both");
  }
  gloo::transport::tcp::attr attr;
  attr.hostname = options.hostname;
  attr.iface = options.iface;
  try {
    return gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat(
        "cannot create Gloo tcp device (hostname '", options.hostname,
        "', iface '", options.iface, "'): ", e.what()));
  }
}

absl::StatusOr<std::unique_ptr<GlooCommunicator>> GlooCommunicator::Create(
    Store& store, const std::string& prefix, int rank, int size,
    std::shared_ptr<gloo::transport::Device> device,
    const GlooCommunicatorOptions& options) {
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(
        absl::StrCat(options.name, ": bad rank ", rank, " for size ", size));
  }
  if (device == nullptr)
    return absl::InvalidArgumentError(options.name + ": no Gloo device");
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(options.name +
                                      ": timeout must be positive");
  }
  auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
  context->setTimeout(ToChrono(options.timeout));
  GlooStoreAdapter gloo_store(store, prefix, options.timeout);
  try {
    context->connectFullMesh(gloo_store, device);
  } catch (const std::exception& e) {
    const std::string where =
        absl::StrCat(options.name, " (rank ", rank, " of ", size,
                     ", store prefix '", prefix, "'): rendezvous failed");
    absl::Status store_error = gloo_store.first_error();
    if (!store_error.ok()) {
      // Gloo waits for key "<r>" of every peer r: the keys still missing name
      // the ranks that never came (a cheap probe, only on this failure path).
      std::vector<std::string> missing;
      for (int r = 0; r < size; ++r) {
        if (r == rank) continue;
        if (!store
                 .Get(gloo_store.FullKey(std::to_string(r)),
                      absl::ZeroDuration())
                 .ok()) {
          missing.push_back(std::to_string(r));
        }
      }
      return absl::Status(
          store_error.code(),
          absl::StrCat(where, ": rank(s) ",
                       missing.empty() ? "?" : absl::StrJoin(missing, ", "),
                       " never arrived within ",
                       absl::FormatDuration(options.timeout), " (",
                       store_error.message(), ")"));
    }
    const bool timed_out = absl::StrContains(e.what(), kGlooTimeoutText) ||
                           absl::StrContains(e.what(), "timeout");
    return absl::Status(timed_out ? absl::StatusCode::kDeadlineExceeded
                                  : absl::StatusCode::kUnavailable,
                        absl::StrCat(where, ": ", e.what()));
  }
  auto core = std::make_shared<Core>(std::move(context), options.name, rank,
                                     size, options.timeout);
  absl::StatusOr<std::vector<std::string>> peer_addresses =
      ExchangePairAddresses(store, prefix, *core->context, options.timeout);
  if (!peer_addresses.ok()) {
    return absl::Status(
        peer_addresses.status().code(),
        absl::StrCat(options.name, " (rank ", rank, " of ", size,
                     ", store prefix '", prefix, "'): rendezvous failed: ",
                     peer_addresses.status().message()));
  }
  core->peer_addresses = *std::move(peer_addresses);
  return std::unique_ptr<GlooCommunicator>(
      new GlooCommunicator(std::move(core)));
}

GlooCommunicator::GlooCommunicator(std::shared_ptr<Core> core)
    : name_(core->name),
      rank_(core->rank),
      size_(core->size),
      timeout_(core->timeout),
      core_(std::move(core)),
      executor_([core = core_](const std::string& what) {
        return core->Describe(what);
      }) {}

// The executor drains the queued collectives and joins its thread; the TCP
// pairs close when the last Core reference goes (here, unless a Work handle is
// still alive).
GlooCommunicator::~GlooCommunicator() = default;

std::string GlooCommunicator::Describe(const std::string& what) const {
  return core_->Describe(what);
}

absl::Status GlooCommunicator::Core::CurrentExceptionToStatus(
    const std::string& where) const {
  std::string reason;
  if (IsAborted(&reason)) {
    // Whatever Gloo says now (our own signal, or a peer that aborted too) is
    // the consequence of the abort.
    return absl::AbortedError(absl::StrCat(where, " aborted: ", reason));
  }
  try {
    throw;
  } catch (const gloo::IoException& e) {
    const std::string text = e.what();
    if (absl::StrContains(text, kGlooTimeoutText)) {
      return absl::DeadlineExceededError(absl::StrCat(
          where, " timed out after ", absl::FormatDuration(timeout),
          ": a peer of this group did not take part (never issued it, stuck, "
          "or dead); Gloo: ",
          text));
    }
    const int lost = FindPeerInGlooError(text, peer_addresses);
    const std::string peer =
        lost >= 0 ? absl::StrCat("peer rank ", lost) : std::string("a peer");
    return absl::UnavailableError(
        absl::StrCat(where, " failed: lost ", peer,
                     " (connection closed or reset); Gloo: ", text));
  } catch (const gloo::Exception& e) {
    return absl::InternalError(
        absl::StrCat(where, " failed in Gloo: ", e.what()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(where, " failed: ", e.what()));
  } catch (...) {
    return absl::InternalError(
        absl::StrCat(where, " failed with an unknown exception"));
  }
}

std::unique_ptr<Work> GlooCommunicator::Enqueue(
    std::string what, std::function<void(Core& core, uint32_t tag)> run) {
  return executor_.Enqueue(
      what,
      [core = core_, run = std::move(run)](
          uint64_t tag, const std::string& name) -> absl::Status {
        try {
          // Tags only need to differ between collectives in flight at once;
          // the issue counter gives that, wrapping after 2^32 calls.
          run(*core, static_cast<uint32_t>(tag));
          return absl::OkStatus();
        } catch (...) {
          return core->CurrentExceptionToStatus(name);
        }
      });
}

std::unique_ptr<Work> GlooCommunicator::Failed(absl::Status status) {
  return CompletedWork(std::move(status));
}

absl::Status GlooCommunicator::Abort(absl::string_view reason) {
  core_->SetAborted(reason);
  // Queued collectives never start; the running one is unblocked below.
  executor_.Abort(reason);
  std::vector<SocketEnds> pair_ends(size_);
  std::set<SocketEnds> ends;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_ || core_->peer_addresses[p].empty()) continue;
    pair_ends[p] = SocketEnds(core_->context->getPair(p)->address().str(),
                              core_->peer_addresses[p]);
    ends.insert(pair_ends[p]);
  }
  const std::set<SocketEnds> shut = ShutdownSockets(ends);
  for (int p = 0; p < size_; ++p) {
    // A socket not found (no /proc, or Gloo closed it after an error):
    // closing the pair still tells the peer; a local wait on it, if any, then
    // ends at its timeout.
    if (p != rank_ && shut.count(pair_ends[p]) == 0) {
      core_->context->getPair(p)->close();
    }
  }
  if (!executor_.WaitIdle(absl::Now() + timeout_)) {
    return absl::DeadlineExceededError(absl::StrCat(
        Describe("Abort"), ": the running collective did not stop within ",
        absl::FormatDuration(timeout_), "; its buffers must stay alive"));
  }
  return absl::OkStatus();
}

std::unique_ptr<Work> GlooCommunicator::SendRecv(
    const std::vector<PeerTransfer>& sends,
    const std::vector<PeerTransfer>& recvs) {
  const std::string where = Describe("SendRecv");
  if (absl::Status status = CheckSendRecv(where, sends, recvs, rank_, size_);
      !status.ok()) {
    return Failed(std::move(status));
  }
  int64_t bytes = 0;
  for (const PeerTransfer& t : sends) {
    for (const Buffer& b : t.buffers) bytes += static_cast<int64_t>(b.bytes());
  }
  return Enqueue(absl::StrCat("SendRecv(", sends.size(), " sends, ", bytes,
                              " B out, ", recvs.size(), " receives)"),
                 [sends, recvs](Core& core, uint32_t tag) {
                   PointToPoint messages(*core.context, tag, core.orphans,
                                         core.timeout, kSendRecvSlotPrefix);
                   for (const PeerTransfer& t : recvs) {
                     for (const Buffer& b : t.buffers) {
                       messages.Recv(b.data, b.bytes(), 0, b.bytes(), t.peer);
                     }
                   }
                   for (const PeerTransfer& t : sends) {
                     for (const Buffer& b : t.buffers) {
                       messages.Send(b.data, b.bytes(), {t.peer});
                     }
                   }
                   messages.WaitAll();
                 });
}

std::unique_ptr<Work> GlooCommunicator::AllGather(const Buffer& input,
                                                  const Buffer& output) {
  if (absl::Status status =
          CheckPartAndWhole(Describe("AllGather"), input, output, size_);
      !status.ok()) {
    return Failed(std::move(status));
  }
  const size_t bytes = input.bytes();
  char* out = static_cast<char*>(output.data);
  const bool in_place = input.data == out + rank_ * bytes;
  return Enqueue(absl::StrCat("AllGather(", bytes, " B/rank)"),
                 [in = static_cast<char*>(input.data), out, bytes, in_place](
                     Core& core, uint32_t tag) {
                   if (bytes == 0) return;
                   gloo::AllgatherOptions opts(core.context);
                   // Without an input Gloo takes this rank's part from the
                   // output (in place).
                   if (!in_place) opts.setInput(in, bytes);
                   opts.setOutput(out, bytes * core.size);
                   opts.setTag(tag);
                   gloo::allgather(opts);
                 });
}

std::unique_ptr<Work> GlooCommunicator::ReduceScatter(const Buffer& input,
                                                      const Buffer& output,
                                                      ReduceOp op) {
  if (absl::Status status =
          CheckPartAndWhole(Describe("ReduceScatter"), output, input, size_);
      !status.ok()) {
    return Failed(std::move(status));
  }
  const DataType dtype = input.dtype;
  const int64_t count = output.count;
  return Enqueue(
      absl::StrCat("ReduceScatter(", output.bytes(), " B/rank, ",
                   DataTypeName(dtype), ")"),
      [in = static_cast<char*>(input.data), out = output.data, count, dtype,
       op](Core& core, uint32_t tag) {
        if (count == 0) return;
        const size_t total_bytes =
            static_cast<size_t>(count) * ElementSize(dtype) * core.size;
        if (core.scratch.size() < total_bytes) core.scratch.resize(total_bytes);
        // After the all-to-all, scratch chunk r holds rank r's
        // contribution to our shard.
        gloo::AlltoallOptions opts(core.context);
        opts.setInput(in, total_bytes);
        opts.setOutput(core.scratch.data(), total_bytes);
        opts.setTag(tag);
        gloo::alltoall(opts);
        ReduceChunks(core.scratch.data(), core.size, count, dtype, op, out);
      });
}

std::unique_ptr<Work> GlooCommunicator::AllGatherSegments(
    const std::vector<Buffer>& inputs,
    const std::vector<std::vector<Buffer>>& outputs) {
  if (absl::Status status = CheckAllGatherSegments(
          Describe("AllGatherSegments"), inputs, outputs, size_);
      !status.ok()) {
    return Failed(std::move(status));
  }
  int64_t bytes = 0;
  for (const Buffer& b : inputs) bytes += static_cast<int64_t>(b.bytes());
  return Enqueue(
      absl::StrCat("AllGatherSegments(", inputs.size(), " segments, ", bytes,
                   " B/rank)"),
      [inputs, outputs](Core& core, uint32_t tag) {
        std::vector<int> peers;
        for (int p = 0; p < core.size; ++p) {
          if (p != core.rank) peers.push_back(p);
        }
        // Small segments (biases, norms) travel packed in one message per
        // peer: each message costs Gloo a round trip, which dominates for a
        // few hundred bytes.
        const SegmentSplit split = SplitSegments(inputs);
        const size_t packed_bytes = split.small_bytes;
        // [0]: ours; [1 + i]: the i-th peer's.
        std::vector<char> packed(packed_bytes * core.size);
        size_t at = 0;
        for (size_t k : split.small_k) {
          std::memcpy(packed.data() + at, inputs[k].data, inputs[k].bytes());
          at += inputs[k].bytes();
        }
        PointToPoint messages(*core.context, tag, core.orphans, core.timeout);
        messages.Send(packed.data(), packed_bytes, peers);
        for (const Buffer& in : split.large) {
          messages.Send(in.data, in.bytes(), peers);
        }
        for (size_t i = 0; i < peers.size(); ++i) {
          const int p = peers[i];
          messages.Recv(packed.data(), packed.size(), (1 + i) * packed_bytes,
                        packed_bytes, p);
          for (size_t k : split.large_k) {
            const Buffer& out = outputs[p][k];
            messages.Recv(out.data, out.bytes(), 0, out.bytes(), p);
          }
        }
        // Our own segments while the peers' arrive.
        for (size_t k = 0; k < inputs.size(); ++k) {
          const Buffer& own = outputs[core.rank][k];
          if (own.data != inputs[k].data && own.count > 0)
            std::memcpy(own.data, inputs[k].data, own.bytes());
        }
        messages.WaitAll();
        for (size_t i = 0; i < peers.size(); ++i) {
          size_t from = (1 + i) * packed_bytes;
          for (size_t k : split.small_k) {
            const Buffer& out = outputs[peers[i]][k];
            std::memcpy(out.data, packed.data() + from, out.bytes());
            from += out.bytes();
          }
        }
      });
}

int64_t GlooCommunicator::ReduceScatterScratchCount(
    int64_t output_count) const {
  if (size_ == 1) return 0;
  const int rounds = Rounds(size_);
  return (size_ - 1) * ((output_count + rounds - 1) / rounds);
}

std::unique_ptr<Work> GlooCommunicator::ReduceScatterSegments(
    const std::vector<std::vector<Buffer>>& inputs,
    const std::vector<Buffer>& outputs, const Buffer& scratch, ReduceOp op) {
  const std::string where = Describe("ReduceScatterSegments");
  if (absl::Status status =
          CheckReduceScatterSegments(where, inputs, outputs, rank_, size_);
      !status.ok()) {
    return Failed(std::move(status));
  }
  const int64_t total = TotalCount(outputs);
  const DataType dtype = outputs.empty() ? scratch.dtype : outputs[0].dtype;
  const int64_t needed = ReduceScatterScratchCount(total);
  if (scratch.dtype != dtype || scratch.count < needed) {
    return Failed(absl::InvalidArgumentError(
        absl::StrCat(where, ": scratch holds ", scratch.count, " ",
                     DataTypeName(scratch.dtype), ", needs ", needed, " ",
                     DataTypeName(dtype))));
  }
  return Enqueue(
      absl::StrCat("ReduceScatterSegments(", outputs.size(), " segments, ",
                   total * static_cast<int64_t>(ElementSize(dtype)),
                   " B/rank, ", DataTypeName(dtype), ")"),
      [inputs, outputs, scratch, total, dtype, op](Core& core, uint32_t tag) {
        const size_t element = ElementSize(dtype);
        const int rounds = Rounds(core.size);
        const int me = core.rank;
        // Each stream (our contributions to a peer, the peers' to us) is split
        // by the receiver's segment sizes, which both ends know: small
        // segments travel packed in one message in round 0, large ones
        // straight from and into the caller's memory over the rounds.
        const SegmentSplit mine = SplitSegments(outputs);
        std::vector<SegmentSplit> to(static_cast<size_t>(core.size));
        for (int p = 0; p < core.size; ++p) {
          if (p != me) to[p] = SplitSegments(inputs[p]);
        }
        auto slot_of = [me](int p) { return p < me ? p : p - 1; };
        std::vector<std::vector<char>> packed_out(core.size);
        std::vector<char> packed_in(mine.small_bytes * (core.size - 1));
        // Round j moves part j of every large stream (elements [E*j/R,
        // E*(j+1)/R) of E): the peers' parts of ours land in scratch slot
        // slot_of(p), then are summed.
        auto part = [rounds, element](int64_t elements, int j) {
          const size_t lo = static_cast<size_t>(elements * j / rounds);
          const size_t hi = static_cast<size_t>(elements * (j + 1) / rounds);
          return std::pair<size_t, size_t>(lo * element, (hi - lo) * element);
        };
        const int64_t large_total = TotalCount(mine.large);
        const size_t slot_bytes =
            static_cast<size_t>((total + rounds - 1) / rounds) * element;
        char* base = static_cast<char*>(scratch.data);
        const size_t scratch_bytes = slot_bytes * (core.size - 1);
        std::vector<const void*> terms(static_cast<size_t>(core.size));
        for (int j = 0; j < rounds; ++j) {
          PointToPoint messages(*core.context, tag, core.orphans, core.timeout);
          for (int p = 0; p < core.size; ++p) {
            if (p == me) continue;
            if (j == 0 && !to[p].small_k.empty()) {
              packed_out[p].resize(to[p].small_bytes);
              size_t at = 0;
              for (size_t k : to[p].small_k) {
                std::memcpy(packed_out[p].data() + at, inputs[p][k].data,
                            inputs[p][k].bytes());
                at += inputs[p][k].bytes();
              }
              messages.Send(packed_out[p].data(), at, {p});
            }
            if (j == 0 && !mine.small_k.empty()) {
              messages.Recv(packed_in.data(), packed_in.size(),
                            slot_of(p) * mine.small_bytes, mine.small_bytes, p);
            }
            const auto [to_offset, to_bytes] = part(TotalCount(to[p].large), j);
            ForEachSegmentPiece(
                to[p].large, to_offset, to_bytes,
                [&](size_t i, size_t in_segment, size_t, size_t len) {
                  messages.Send(
                      static_cast<char*>(to[p].large[i].data) + in_segment, len,
                      {p});
                });
            const auto [from_offset, from_bytes] = part(large_total, j);
            const size_t slot = static_cast<size_t>(slot_of(p)) * slot_bytes;
            ForEachSegmentPiece(
                mine.large, from_offset, from_bytes,
                [&](size_t, size_t, size_t in_range, size_t len) {
                  messages.Recv(base, scratch_bytes, slot + in_range, len, p);
                });
          }
          messages.WaitAll();
          if (j == 0) {
            size_t at = 0;
            for (size_t k : mine.small_k) {
              for (int r = 0; r < core.size; ++r) {
                terms[r] = r == me ? inputs[me][k].data
                                   : packed_in.data() +
                                         slot_of(r) * mine.small_bytes + at;
              }
              ReduceBuffers(terms.data(), core.size, outputs[k].count, dtype,
                            op, outputs[k].data);
              at += outputs[k].bytes();
            }
          }
          const auto [offset, bytes] = part(large_total, j);
          ForEachSegmentPiece(
              mine.large, offset, bytes,
              [&](size_t i, size_t in_segment, size_t in_range, size_t len) {
                const size_t k = mine.large_k[i];
                for (int r = 0; r < core.size; ++r) {
                  terms[r] =
                      r == me
                          ? static_cast<const char*>(inputs[me][k].data) +
                                in_segment
                          : base +
                                static_cast<size_t>(slot_of(r)) * slot_bytes +
                                in_range;
                }
                ReduceBuffers(terms.data(), core.size,
                              static_cast<int64_t>(len / element), dtype, op,
                              static_cast<char*>(outputs[k].data) + in_segment);
              });
        }
      });
}

std::unique_ptr<Work> GlooCommunicator::AllReduce(const Buffer& buffer,
                                                  ReduceOp op) {
  const DataType dtype = buffer.dtype;
  const size_t element_size = ElementSize(dtype);
  return Enqueue(absl::StrCat("AllReduce(", buffer.bytes(), " B, ",
                              DataTypeName(dtype), ")"),
                 [data = static_cast<char*>(buffer.data), count = buffer.count,
                  element_size, dtype, op](Core& core, uint32_t tag) {
                   if (count == 0) return;
                   gloo::AllreduceOptions opts(core.context);
                   // Gloo only needs the element size (it splits segments on
                   // element boundaries); the reduce function does the dtype's
                   // arithmetic.
                   WithElementOfSize(element_size, [&](auto element) {
                     opts.setOutput(reinterpret_cast<decltype(element)*>(data),
                                    static_cast<size_t>(count));
                   });
                   opts.setReduceFunction(
                       [dtype](void* out, const void* a, const void* b,
                               size_t n) { AddBuffers(dtype, out, a, b, n); });
                   opts.setTag(tag);
                   gloo::allreduce(opts);
                   if (op == ReduceOp::kAvg)
                     DivideBuffer(dtype, data, count, core.size);
                 });
}

std::unique_ptr<Work> GlooCommunicator::Broadcast(const Buffer& buffer,
                                                  int root) {
  if (root < 0 || root >= size_) {
    return Failed(absl::InvalidArgumentError(
        absl::StrCat(Describe("Broadcast"), ": root ", root, " out of range")));
  }
  return Enqueue(
      absl::StrCat("Broadcast(", buffer.bytes(), " B from ", root, ")"),
      [data = static_cast<char*>(buffer.data), bytes = buffer.bytes(), root](
          Core& core, uint32_t tag) {
        if (bytes == 0) return;
        gloo::BroadcastOptions opts(core.context);
        opts.setOutput(data, bytes);
        opts.setRoot(root);
        opts.setTag(tag);
        gloo::broadcast(opts);
      });
}

std::unique_ptr<Work> GlooCommunicator::Barrier() {
  return Enqueue("Barrier", [](Core& core, uint32_t tag) {
    gloo::BarrierOptions opts(core.context);
    opts.setTag(tag);
    gloo::barrier(opts);
  });
}

}  // namespace hsdp::comm
