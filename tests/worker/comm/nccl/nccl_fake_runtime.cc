// A host-memory stand-in for the parts of the CUDA runtime and NCCL that
// NcclCommunicator and its test use, so nccl_communicator_test's device tests
// also run on machines without a GPU (linked into nccl_communicator_fake_test
// instead of libcudart + libnccl; the real-library binary is unchanged).
//
// What it models, because the communicator's logic depends on it:
//  * non-blocking communicators: init stays ncclInProgress until every rank of
//    the clique (same unique id) joined: a missing peer never completes;
//  * a collective runs when the last rank enqueued its matching (k-th) call, on
//    host memory with real sum/avg arithmetic (hsdp::comm::ReduceChunks), so a
//    rank whose peer never issues the call keeps a busy stream (watchdog);
//  * streams count issued/finished work; an event recorded on a stream is done
//    once the stream finished what was issued before the record;
//    cudaStreamWaitEvent makes the waiting stream's synchronous calls
//    (cudaMemcpy) block until the event is done; one default stream per device;
//  * ncclGroupStart/End defer enqueueing to the outermost End;
//  * ncclCommAbort tears a rank out; later calls on it fail.
// Devices: HSDP_FAKE_CUDA_DEVICES (default 2, so the two-rank tests run too).
// Not a model of performance or of kernel ordering.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "hsdp/communicator.h"
#include "worker/comm/reduce_kernels.h"

namespace {

using hsdp::comm::DataType;

struct FakeStream;
// A point in a stream's work: done once `stream` finished `target` units.
struct StreamPoint {
  FakeStream* stream = nullptr;
  uint64_t target = 0;
};

struct FakeStream {
  std::atomic<uint64_t> issued{0};
  std::atomic<uint64_t> finished{0};
  // Points this stream was told to wait for (cudaStreamWaitEvent); synchronous
  // calls on it (cudaMemcpy) block until they are done, which is what makes
  // Work::Wait() observable here.
  std::mutex mu;
  std::vector<StreamPoint> waits;
};

bool Done(const StreamPoint& p) {
  return p.stream->finished.load() >= p.target;
}

constexpr int kMaxFakeDevices = 8;
constexpr auto kDrainTimeout = std::chrono::seconds(60);
thread_local int t_device = 0;
thread_local int t_group_depth = 0;
FakeStream g_legacy_streams[kMaxFakeDevices];  // one default stream per device,
                                               // as in CUDA

FakeStream* AsStream(cudaStream_t s) {
  return s == nullptr ? &g_legacy_streams[t_device]
                      : reinterpret_cast<FakeStream*>(s);
}

// Blocks until everything `stream` waits for is done (bounded: a broken test
// fails, not hangs).
bool Drain(FakeStream* stream) {
  const auto deadline = std::chrono::steady_clock::now() + kDrainTimeout;
  std::lock_guard<std::mutex> lock(stream->mu);
  for (const StreamPoint& p : stream->waits) {
    while (!Done(p)) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  stream->waits.clear();
  return true;
}

struct FakeEvent {
  StreamPoint point;
  bool recorded = false;
};

int DeviceCount() {
  const char* env = std::getenv("HSDP_FAKE_CUDA_DEVICES");
  return env != nullptr ? std::atoi(env) : 2;
}

// ---- NCCL clique ----

enum class OpKind { kAllGather, kReduceScatter, kAllReduce, kBroadcast };

struct RankCall {
  const void* send = nullptr;
  void* recv = nullptr;
  FakeStream* stream = nullptr;
};

struct PendingOp {
  OpKind kind;
  size_t count = 0;  // per-rank element count as passed to NCCL
  ncclDataType_t type;
  ncclRedOp_t op;
  int root = 0;
  std::map<int, RankCall> calls;
};

struct Clique {
  int nranks = 0;
  int joined = 0;
  std::map<uint64_t, PendingOp> ops;  // by per-rank call index
};

std::mutex g_mu;  // guards every Clique and FakeComm field below
std::map<std::string, std::shared_ptr<Clique>> g_cliques;
std::string g_last_error;

}  // namespace

struct ncclComm {
  std::shared_ptr<Clique> clique;
  int rank = 0;
  uint64_t calls = 0;
  bool aborted = false;
};

namespace {

DataType ToDataType(ncclDataType_t t) {
  switch (t) {
    case ncclFloat64:
      return DataType::kFloat64;
    case ncclBfloat16:
      return DataType::kBFloat16;
    case ncclFloat16:
      return DataType::kFloat16;
    case ncclInt32:
      return DataType::kInt32;
    case ncclInt64:
      return DataType::kInt64;
    case ncclUint8:
      return DataType::kUInt8;
    default:
      return DataType::kFloat32;
  }
}

// Runs `op` once every rank called it; then each rank's stream finishes one
// unit of work.
void Execute(PendingOp& op, int nranks) {
  const DataType dtype = ToDataType(op.type);
  const size_t elem = hsdp::comm::ElementSize(dtype);
  const size_t bytes = op.count * elem;
  const hsdp::comm::ReduceOp reduce = op.op == ncclAvg
                                          ? hsdp::comm::ReduceOp::kAvg
                                          : hsdp::comm::ReduceOp::kSum;
  std::vector<char> all(bytes * nranks);
  switch (op.kind) {
    case OpKind::kAllGather:
      for (int r = 0; r < nranks; ++r)
        std::memcpy(all.data() + r * bytes, op.calls[r].send, bytes);
      for (int r = 0; r < nranks; ++r)
        std::memcpy(op.calls[r].recv, all.data(), all.size());
      break;
    case OpKind::kAllReduce: {
      for (int r = 0; r < nranks; ++r)
        std::memcpy(all.data() + r * bytes, op.calls[r].send, bytes);
      std::vector<char> out(bytes);
      hsdp::comm::ReduceChunks(all.data(), nranks, op.count, dtype, reduce,
                               out.data());
      for (int r = 0; r < nranks; ++r)
        std::memcpy(op.calls[r].recv, out.data(), bytes);
      break;
    }
    case OpKind::kReduceScatter:
      // Rank r gets op over ranks of chunk r of every rank's input.
      for (int r = 0; r < nranks; ++r) {
        for (int src = 0; src < nranks; ++src) {
          std::memcpy(all.data() + src * bytes,
                      static_cast<const char*>(op.calls[src].send) + r * bytes,
                      bytes);
        }
        hsdp::comm::ReduceChunks(all.data(), nranks, op.count, dtype, reduce,
                                 op.calls[r].recv);
      }
      break;
    case OpKind::kBroadcast: {
      std::vector<char> value(
          static_cast<const char*>(op.calls[op.root].send),
          static_cast<const char*>(op.calls[op.root].send) + bytes);
      for (int r = 0; r < nranks; ++r)
        std::memcpy(op.calls[r].recv, value.data(), bytes);
      break;
    }
  }
  for (auto& [rank, call] : op.calls) call.stream->finished.fetch_add(1);
}

struct DeferredCall {
  ncclComm_t comm;
  OpKind kind;
  const void* send;
  void* recv;
  size_t count;
  ncclDataType_t type;
  ncclRedOp_t op;
  int root;
  cudaStream_t stream;
};
thread_local std::vector<DeferredCall> t_deferred;

ncclResult_t Enqueue(const DeferredCall& c) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (c.comm == nullptr || c.comm->aborted) {
    g_last_error = "communicator aborted";
    return ncclInvalidUsage;
  }
  Clique& clique = *c.comm->clique;
  if (clique.joined < clique.nranks) {
    g_last_error = "communicator not initialised";
    return ncclInvalidUsage;
  }
  PendingOp& op = clique.ops[c.comm->calls++];
  if (op.calls.empty()) {
    op.kind = c.kind;
    op.count = c.count;
    op.type = c.type;
    op.op = c.op;
    op.root = c.root;
  } else if (op.kind != c.kind || op.count != c.count || op.type != c.type) {
    g_last_error = "mismatched collective across ranks";
    return ncclInvalidUsage;
  }
  FakeStream* stream = AsStream(c.stream);
  stream->issued.fetch_add(1);
  op.calls[c.comm->rank] = RankCall{c.send, c.recv, stream};
  if (static_cast<int>(op.calls.size()) == clique.nranks) {
    Execute(op, clique.nranks);
    clique.ops.erase(c.comm->calls - 1);
  }
  return ncclSuccess;
}

ncclResult_t Submit(const DeferredCall& c) {
  if (t_group_depth > 0) {
    t_deferred.push_back(c);
    return ncclSuccess;
  }
  ncclResult_t result = Enqueue(c);
  // Non-blocking communicators report ncclInProgress for work still being
  // enqueued.
  return result == ncclSuccess ? ncclInProgress : result;
}

}  // namespace

extern "C" {

// ---- CUDA runtime ----

cudaError_t cudaGetDeviceCount(int* count) {
  *count = DeviceCount();
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  *device = t_device;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= DeviceCount() || device >= kMaxFakeDevices) {
    return cudaErrorInvalidDevice;
  }
  t_device = device;
  return cudaSuccess;
}
cudaError_t cudaGetLastError(void) { return cudaSuccess; }
const char* cudaGetErrorName(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorInsufficientDriver:
      return "cudaErrorInsufficientDriver";
    case cudaErrorNoDevice:
      return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice:
      return "cudaErrorInvalidDevice";
    case cudaErrorNotReady:
      return "cudaErrorNotReady";
    case cudaErrorLaunchFailure:
      return "cudaErrorLaunchFailure";
    default:
      return "cudaErrorUnknown";
  }
}
const char* cudaGetErrorString(cudaError_t error) {
  return cudaGetErrorName(error);
}

cudaError_t cudaDeviceGetStreamPriorityRange(int* least, int* greatest) {
  *least = 0;
  *greatest = -5;
  return cudaSuccess;
}
cudaError_t cudaStreamCreateWithPriority(cudaStream_t* stream, unsigned int,
                                         int) {
  *stream = reinterpret_cast<cudaStream_t>(new FakeStream);
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  delete AsStream(stream);
  return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event,
                                unsigned int) {
  auto* e = reinterpret_cast<FakeEvent*>(event);
  if (!e->recorded || Done(e->point)) return cudaSuccess;
  FakeStream* s = AsStream(stream);
  std::lock_guard<std::mutex> lock(s->mu);
  s->waits.push_back(e->point);
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) {
  *event = reinterpret_cast<cudaEvent_t>(new FakeEvent);
  return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int) {
  return cudaEventCreate(event);
}
cudaError_t cudaEventDestroy(cudaEvent_t event) {
  delete reinterpret_cast<FakeEvent*>(event);
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  auto* e = reinterpret_cast<FakeEvent*>(event);
  FakeStream* s = AsStream(stream);
  e->point = StreamPoint{s, s->issued.load()};
  e->recorded = true;
  return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t event) {
  auto* e = reinterpret_cast<FakeEvent*>(event);
  if (!e->recorded) return cudaSuccess;
  return Done(e->point) ? cudaSuccess : cudaErrorNotReady;
}
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start,
                                 cudaEvent_t end) {
  if (cudaEventQuery(start) != cudaSuccess ||
      cudaEventQuery(end) != cudaSuccess) {
    return cudaErrorNotReady;
  }
  // Host-synchronous work has no device duration; report a tiny positive one.
  *ms = 1e-3f;
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** ptr, size_t size) {
  *ptr = std::malloc(size == 0 ? 1 : size);
  return *ptr != nullptr ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaFree(void* ptr) {
  std::free(ptr);
  return cudaSuccess;
}
cudaError_t cudaMemset(void* ptr, int value, size_t count) {
  std::memset(ptr, value, count);
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void* dst, const void* src, size_t count,
                       enum cudaMemcpyKind) {
  // Synchronous on the current device's default stream: first what that stream
  // waits for.
  if (!Drain(AsStream(nullptr))) return cudaErrorLaunchFailure;
  std::memcpy(dst, src, count);
  return cudaSuccess;
}

// ---- NCCL ----

const char* ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess:
      return "no error";
    case ncclUnhandledCudaError:
      return "unhandled cuda error (fake)";
    case ncclSystemError:
      return "unhandled system error (fake)";
    case ncclInternalError:
      return "internal error (fake)";
    case ncclInvalidArgument:
      return "invalid argument (fake)";
    case ncclInvalidUsage:
      return "invalid usage (fake)";
    case ncclRemoteError:
      return "remote process exited or there was a network error (fake)";
    case ncclInProgress:
      return "NCCL operation in progress (fake)";
    default:
      return "unknown result code (fake)";
  }
}
const char* ncclGetLastError(ncclComm_t) {
  std::lock_guard<std::mutex> lock(g_mu);
  static thread_local std::string copy;
  copy = g_last_error;
  return copy.c_str();
}
ncclResult_t ncclGetVersion(int* version) {
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}
ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  static std::atomic<uint64_t> next{1};
  std::memset(id->internal, 0, sizeof(id->internal));
  const uint64_t v = next.fetch_add(1);
  std::memcpy(id->internal, &v, sizeof(v));
  return ncclSuccess;
}
ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks,
                                    ncclUniqueId id, int rank, ncclConfig_t*) {
  std::lock_guard<std::mutex> lock(g_mu);
  std::shared_ptr<Clique>& clique =
      g_cliques[std::string(id.internal, sizeof(id.internal))];
  if (clique == nullptr) {
    clique = std::make_shared<Clique>();
    clique->nranks = nranks;
  }
  if (clique->nranks != nranks || rank < 0 || rank >= nranks)
    return ncclInvalidArgument;
  ++clique->joined;
  *comm = new ncclComm{clique, rank};
  return ncclInProgress;
}
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* state) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (comm->aborted) {
    *state = ncclInvalidUsage;
  } else {
    *state = comm->clique->joined < comm->clique->nranks ? ncclInProgress
                                                         : ncclSuccess;
  }
  return ncclSuccess;
}
ncclResult_t ncclCommAbort(ncclComm_t comm) {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    comm->aborted = true;
    // Its calls can never complete now, and must not touch its freed
    // buffers/streams later.
    for (auto& [index, op] : comm->clique->ops) op.calls.erase(comm->rank);
  }
  delete comm;
  return ncclSuccess;
}
ncclResult_t ncclCommFinalize(ncclComm_t) { return ncclSuccess; }
ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclGroupStart() {
  ++t_group_depth;
  return ncclSuccess;
}
ncclResult_t ncclGroupEnd() {
  if (t_group_depth == 0) return ncclInvalidUsage;
  if (--t_group_depth > 0) return ncclSuccess;
  std::vector<DeferredCall> calls;
  calls.swap(t_deferred);
  for (const DeferredCall& c : calls) {
    ncclResult_t result = Enqueue(c);
    if (result != ncclSuccess) return result;
  }
  return calls.empty() ? ncclSuccess : ncclInProgress;
}

ncclResult_t ncclAllGather(const void* send, void* recv, size_t count,
                           ncclDataType_t type, ncclComm_t comm,
                           cudaStream_t stream) {
  return Submit(
      {comm, OpKind::kAllGather, send, recv, count, type, ncclSum, 0, stream});
}
ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t count,
                               ncclDataType_t type, ncclRedOp_t op,
                               ncclComm_t comm, cudaStream_t stream) {
  return Submit(
      {comm, OpKind::kReduceScatter, send, recv, count, type, op, 0, stream});
}
ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count,
                           ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,
                           cudaStream_t stream) {
  return Submit(
      {comm, OpKind::kAllReduce, send, recv, count, type, op, 0, stream});
}
ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count,
                           ncclDataType_t type, int root, ncclComm_t comm,
                           cudaStream_t stream) {
  return Submit({comm, OpKind::kBroadcast, send, recv, count, type, ncclSum,
                 root, stream});
}

}  // extern "C"
