#include "worker/comm/gloo/gloo_communicator.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gloo/allgather.h"
#include "gloo/allreduce.h"
#include "gloo/alltoall.h"
#include "gloo/barrier.h"
#include "gloo/broadcast.h"
#include "gloo/common/error.h"
#include "gloo/rendezvous/context.h"
#include "gloo/transport/pair.h"
#include "gloo/transport/tcp/device.h"
#include "gloo/transport/unbound_buffer.h"
#include "worker/comm/gloo/gloo_pairs.h"
#include "worker/comm/gloo/gloo_segments.h"
#include "worker/comm/gloo/gloo_store.h"
#include "worker/comm/reduce_kernels.h"

namespace hsdp::comm {
namespace {

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

// Everything a collective needs to execute. Thread-compatible: only the task
// the SerialExecutor is running touches it, one at a time.
struct GlooCommunicator::Core {
  Core(std::shared_ptr<gloo::Context> context, int rank, int size,
       const GlooCommunicatorOptions& options)
      : context(std::move(context)),
        name(options.name),
        rank(rank),
        size(size),
        timeout(options.timeout),
        pack_below_bytes(options.pack_below_bytes) {}

  std::string Describe(const std::string& what) const {
    return absl::StrCat(what, " on ", name, " (rank ", rank, " of ", size, ")");
  }

  // Converts the in-flight exception of a failed collective into a Status.
  // `where` is the collective's error prefix (Describe of its name).
  absl::Status CurrentExceptionToStatus(const std::string& where) const;

  // The options of the point-to-point collective with issue number `tag`.
  GlooSegmentsOptions SegmentsOptions(uint32_t tag) {
    GlooSegmentsOptions options;
    options.context = context.get();
    options.tag = tag;
    options.timeout = timeout;
    options.orphans = &orphans;
    options.pack_below_bytes = pack_below_bytes;
    return options;
  }

  const std::shared_ptr<gloo::Context> context;
  const std::string name;
  const int rank;
  const int size;
  const absl::Duration timeout;
  const size_t pack_below_bytes;

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
  auto core = std::make_shared<Core>(std::move(context), rank, size, options);
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
  const std::vector<int> closed =
      ShutdownGlooPairs(*core_->context, core_->peer_addresses);
  if (!executor_.WaitIdle(absl::Now() + timeout_)) {
    return absl::DeadlineExceededError(absl::StrCat(
        Describe("Abort"), ": the running collective did not stop within ",
        absl::FormatDuration(timeout_), "; its buffers must stay alive",
        closed.empty()
            ? std::string()
            : absl::StrCat(" (no open socket found for peer rank(s) ",
                           absl::StrJoin(closed, ", "),
                           ": those pairs were closed, which does not wake a "
                           "local wait)")));
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
  size_t bytes = 0;
  for (const PeerTransfer& t : sends) bytes += TotalBytes(t.buffers);
  return Enqueue(absl::StrCat("SendRecv(", sends.size(), " sends, ", bytes,
                              " B out, ", recvs.size(), " receives)"),
                 [sends, recvs](Core& core, uint32_t tag) {
                   GlooSendRecv(core.SegmentsOptions(tag), sends, recvs);
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
  return Enqueue(absl::StrCat("AllGatherSegments(", inputs.size(),
                              " segments, ", TotalBytes(inputs), " B/rank)"),
                 [inputs, outputs](Core& core, uint32_t tag) {
                   GlooAllGatherSegments(core.SegmentsOptions(tag), inputs,
                                         outputs);
                 });
}

int64_t GlooCommunicator::ReduceScatterScratchCount(
    int64_t output_count) const {
  return GlooReduceScatterScratchCount(size_, output_count);
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
                   TotalBytes(outputs), " B/rank, ", DataTypeName(dtype), ")"),
      [inputs, outputs, scratch, op](Core& core, uint32_t tag) {
        GlooReduceScatterSegments(core.SegmentsOptions(tag), inputs, outputs,
                                  scratch, op);
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
