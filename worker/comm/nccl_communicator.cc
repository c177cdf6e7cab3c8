#include "worker/comm/nccl_communicator.h"

#include <atomic>
#include <cstring>
#include <deque>
#include <iostream>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"

namespace hsdp::comm {
namespace {

// Enqueue/init polling starts fast (most non-blocking enqueues finish in
// microseconds) and backs off so a slow rendezvous does not spin a core that
// the training thread needs.
constexpr absl::Duration kPollInitialSleep = absl::Microseconds(20);
constexpr absl::Duration kPollMaxSleep = absl::Milliseconds(5);
// Finalize (flush) on destruction: long enough for in-flight collectives, short
// enough that a dead peer does not hang shutdown; after it we abort.
constexpr absl::Duration kMaxFinalizeTimeout = absl::Seconds(30);

// Makes `device` current for the scope: events and streams belong to the device
// that was current when they were created or recorded, and the caller's thread
// may have another device current.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device) cudaSetDevice(device);
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

// Invalid-argument style results leave the communicator usable; anything else
// means NCCL's state (or a peer) is broken and the communicator must be
// aborted.
bool IsFatal(ncclResult_t result) {
  return result != ncclSuccess && result != ncclInProgress &&
         result != ncclInvalidArgument && result != ncclInvalidUsage;
}

}  // namespace

// ---- Device-free helpers ----

absl::StatusOr<int> CudaDeviceCount() {
  int count = 0;
  cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    // Clear the sticky "last error" so later CUDA calls in this process don't
    // report it again.
    cudaGetLastError();
    return absl::UnavailableError(absl::StrCat(
        "no CUDA device: cudaGetDeviceCount failed with ",
        cudaGetErrorName(error), " (", cudaGetErrorString(error), ")"));
  }
  if (count == 0)
    return absl::UnavailableError(
        "no CUDA device: cudaGetDeviceCount returned 0");
  return count;
}

absl::StatusOr<ncclDataType_t> ToNcclDataType(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32:
      return ncclFloat32;
    case DataType::kFloat64:
      return ncclFloat64;
    case DataType::kBFloat16:
      return ncclBfloat16;
    case DataType::kFloat16:
      return ncclFloat16;
    case DataType::kInt32:
      return ncclInt32;
    case DataType::kInt64:
      return ncclInt64;
    case DataType::kUInt8:
      return ncclUint8;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("no NCCL type for DataType ", static_cast<int>(dtype)));
}

ncclRedOp_t ToNcclRedOp(ReduceOp op) {
  return op == ReduceOp::kAvg ? ncclAvg : ncclSum;
}

absl::Status NcclResultToStatus(ncclResult_t result, absl::string_view what,
                                ncclComm_t comm) {
  if (result == ncclSuccess) return absl::OkStatus();
  std::string message =
      absl::StrFormat("%s: NCCL error %d (%s)", what, static_cast<int>(result),
                      ncclGetErrorString(result));
  const char* detail = ncclGetLastError(comm);
  if (detail != nullptr && detail[0] != '\0')
    absl::StrAppend(&message, ": ", detail);
  switch (result) {
    case ncclInvalidArgument:
      return absl::InvalidArgumentError(message);
    case ncclInvalidUsage:
      return absl::FailedPreconditionError(message);
    case ncclSystemError:  // sockets, shared memory, /dev/shm, ... on this host
    case ncclRemoteError:  // a peer failed or went away
    case ncclInProgress:
      return absl::UnavailableError(message);
    case ncclUnhandledCudaError:
    case ncclInternalError:
      return absl::InternalError(message);
    default:
      return absl::UnknownError(message);
  }
}

absl::Status CudaErrorToStatus(cudaError_t error, absl::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  std::string message = absl::StrCat(what, ": ", cudaGetErrorName(error), " (",
                                     cudaGetErrorString(error), ")");
  switch (error) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(message);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
      return absl::UnavailableError(message);
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevice:
      return absl::InvalidArgumentError(message);
    default:
      return absl::InternalError(message);
  }
}

std::string EncodeUniqueId(const ncclUniqueId& id) {
  return std::string(id.internal, sizeof(id.internal));
}

absl::StatusOr<ncclUniqueId> DecodeUniqueId(absl::string_view bytes) {
  ncclUniqueId id;
  if (bytes.size() != sizeof(id.internal)) {
    return absl::InvalidArgumentError(
        absl::StrCat("NCCL unique id must be ", sizeof(id.internal),
                     " bytes, got ", bytes.size()));
  }
  std::memcpy(id.internal, bytes.data(), bytes.size());
  return id;
}

// ---- Shared state ----

class NcclCommState;

// One issued collective. `end_recorded` flips once its completion event is on
// the stream (at issue, or at the end of the enclosing NcclGroup). Thread-safe.
struct NcclWorkState {
  std::shared_ptr<NcclCommState> comm;
  std::string what;  // "all_gather #12 on nccl:shard (rank 1 of 4, cuda:1)
                     // (1048576 x bfloat16)"
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr;  // null unless timing is enabled
  cudaEvent_t end = nullptr;
  absl::Time issued;

  absl::Mutex mu;
  bool end_recorded ABSL_GUARDED_BY(mu) = false;
  absl::Status status
      ABSL_GUARDED_BY(mu);  // an error specific to this collective

  ~NcclWorkState();
  bool Completed();  // end recorded and the GPU passed it
};

// Everything a communicator and its Work objects share. `mu` is a reader/writer
// lock: NCCL calls on `comm` hold it shared, ncclCommAbort holds it
// exclusively, so a watchdog abort never races a call on the same ncclComm_t.
// Issuing is serialised by the Communicator contract.
class NcclCommState : public std::enable_shared_from_this<NcclCommState> {
 public:
  NcclCommState(int rank, int size, NcclOptions options)
      : rank_(rank), size_(size), options_(std::move(options)) {
    label_ = absl::StrFormat("%s (rank %d of %d, cuda:%d)", options_.name,
                             rank_, size_, options_.device);
  }
  ~NcclCommState();
  NcclCommState(const NcclCommState&) = delete;
  NcclCommState& operator=(const NcclCommState&) = delete;

  absl::Status InitResources();
  absl::Status InitComm(const ncclUniqueId& id, const std::string& store_key);
  void StartWatchdog();
  void StopWatchdog();
  // Stops the watchdog, flushes and frees the NCCL communicator (aborts if the
  // flush times out).
  void Destroy();

  enum class StreamKind { kParam, kGrad };
  using NcclCall = std::function<ncclResult_t(ncclComm_t, cudaStream_t)>;
  std::unique_ptr<Work> Issue(StreamKind kind, std::string what,
                              const NcclCall& call);

  // Polls ncclCommGetAsyncError until the communicator leaves ncclInProgress;
  // aborts on error or after `timeout`. `what` names the operation being waited
  // for.
  absl::Status PollUntilReady(absl::string_view what, absl::Duration timeout);
  absl::Status Synchronize(absl::Duration timeout);
  void Abort(const absl::Status& reason);
  absl::Status status() const {
    absl::ReaderMutexLock lock(&mu_);
    return error_;
  }
  // Records `work`'s completion event and starts tracking it. Called at issue,
  // or by NcclGroup.
  void RecordEnd(const std::shared_ptr<NcclWorkState>& work);

  int rank() const { return rank_; }
  int size() const { return size_; }
  int device() const { return options_.device; }
  const NcclOptions& options() const { return options_; }
  const std::string& label() const { return label_; }
  cudaStream_t stream(StreamKind kind) const {
    return kind == StreamKind::kParam ? param_stream_ : grad_stream_;
  }
  cudaStream_t compute_stream() const {
    return options_.compute_stream ? options_.compute_stream() : nullptr;
  }
  float* barrier_scratch() const { return barrier_scratch_; }
  uint64_t NextSequence() { return ++sequence_; }

 private:
  void WatchdogLoop();
  void FinalizeComm();
  void CheckOutstanding();

  const int rank_;
  const int size_;
  const NcclOptions options_;
  std::string label_;
  cudaStream_t param_stream_ = nullptr;
  cudaStream_t grad_stream_ = nullptr;
  // "Inputs ready" events recorded on the compute stream; one per comm stream,
  // re-recorded per collective (cudaStreamWaitEvent captures the event's state
  // at call time).
  cudaEvent_t param_ready_ = nullptr;
  cudaEvent_t grad_ready_ = nullptr;
  float* barrier_scratch_ = nullptr;
  std::atomic<uint64_t> sequence_{0};

  mutable absl::Mutex mu_;
  ncclComm_t comm_ ABSL_GUARDED_BY(mu_) = nullptr;
  absl::Status error_ ABSL_GUARDED_BY(mu_);

  absl::Mutex outstanding_mu_;
  std::deque<std::shared_ptr<NcclWorkState>> outstanding_
      ABSL_GUARDED_BY(outstanding_mu_);

  absl::Notification stop_watchdog_;
  std::thread watchdog_;
};

NcclWorkState::~NcclWorkState() {
  DeviceGuard guard(comm->device());
  if (start != nullptr) cudaEventDestroy(start);
  if (end != nullptr) cudaEventDestroy(end);
}

bool NcclWorkState::Completed() {
  {
    absl::MutexLock lock(&mu);
    if (!end_recorded) return false;
  }
  cudaError_t query = cudaEventQuery(end);
  if (query == cudaErrorNotReady) return false;
  if (query != cudaSuccess)
    cudaGetLastError();  // e.g. after abort; treat as done
  return true;
}

// Wait() orders the caller's compute stream after the collective; see the
// header for why this replaces recordStream.
class NcclWork : public Work {
 public:
  explicit NcclWork(std::shared_ptr<NcclWorkState> state)
      : state_(std::move(state)) {}

  absl::Status Wait() override {
    {
      absl::MutexLock lock(&state_->mu);
      if (!state_->status.ok()) return state_->status;
      if (!state_->end_recorded) {
        return absl::FailedPreconditionError(absl::StrCat(
            "Wait() on ", state_->what, " before its NcclGroup ended"));
      }
    }
    if (!state_->Completed()) {
      absl::Status comm_status = state_->comm->status();
      if (!comm_status.ok()) {
        return absl::Status(comm_status.code(),
                            absl::StrCat(state_->what, " did not complete: ",
                                         comm_status.message()));
      }
    }
    DeviceGuard guard(state_->comm->device());
    return CudaErrorToStatus(
        cudaStreamWaitEvent(state_->comm->compute_stream(), state_->end, 0),
        absl::StrCat("making the compute stream wait for ", state_->what));
  }

  bool IsCompleted() override {
    {
      absl::MutexLock lock(&state_->mu);
      if (!state_->status.ok()) return true;
    }
    return state_->Completed() || !state_->comm->status().ok();
  }

  double ElapsedSeconds() const override {
    if (state_->start == nullptr || !state_->Completed()) return 0.0;
    float ms = 0.0f;
    if (cudaEventElapsedTime(&ms, state_->start, state_->end) != cudaSuccess) {
      cudaGetLastError();
      return 0.0;
    }
    return ms / 1e3;
  }

 private:
  std::shared_ptr<NcclWorkState> state_;
};

// ---- Groups ----

namespace {
// ncclGroupStart/End are per thread, so is our bookkeeping of the works whose
// completion events can only be recorded once the group launched.
thread_local int g_group_depth = 0;
thread_local std::vector<std::shared_ptr<NcclWorkState>> g_group_pending;
}  // namespace

NcclGroup::NcclGroup() {
  start_status_ = NcclResultToStatus(ncclGroupStart(), "ncclGroupStart");
  if (start_status_.ok()) ++g_group_depth;
}

NcclGroup::~NcclGroup() {
  absl::Status status = End();
  if (!status.ok())
    std::cerr << "hsdp: NcclGroup ended with error: " << status << "\n";
}

absl::Status NcclGroup::End() {
  if (ended_) return absl::OkStatus();
  ended_ = true;
  if (!start_status_.ok()) return start_status_;
  --g_group_depth;
  ncclResult_t result = ncclGroupEnd();
  if (g_group_depth > 0)
    return NcclResultToStatus(result == ncclInProgress ? ncclSuccess : result,
                              "ncclGroupEnd (nested)");
  std::vector<std::shared_ptr<NcclWorkState>> pending;
  pending.swap(g_group_pending);
  absl::Status first_error;
  for (const auto& work : pending) {
    absl::Status status;
    if (result == ncclSuccess || result == ncclInProgress) {
      // Non-blocking communicators may still be enqueueing the grouped kernels
      // in the background.
      status = work->comm->PollUntilReady(
          absl::StrCat("ncclGroupEnd for ", work->what),
          work->comm->options().collective_timeout);
    } else {
      status = NcclResultToStatus(
          result, absl::StrCat("ncclGroupEnd for ", work->what));
      if (IsFatal(result)) work->comm->Abort(status);
    }
    if (status.ok()) {
      work->comm->RecordEnd(work);
    } else {
      absl::MutexLock lock(&work->mu);
      work->status = status;
    }
    if (first_error.ok()) first_error = status;
  }
  if (first_error.ok() && pending.empty()) {
    return NcclResultToStatus(result == ncclInProgress ? ncclSuccess : result,
                              "ncclGroupEnd");
  }
  return first_error;
}

// ---- NcclCommState ----

absl::Status NcclCommState::InitResources() {
  DeviceGuard guard(options_.device);
  int least = 0, greatest = 0;
  absl::Status status =
      CudaErrorToStatus(cudaDeviceGetStreamPriorityRange(&least, &greatest),
                        "cudaDeviceGetStreamPriorityRange");
  // High priority: collectives are latency-critical and short; compute kernels
  // fill the gaps.
  if (status.ok()) {
    status =
        CudaErrorToStatus(cudaStreamCreateWithPriority(
                              &param_stream_, cudaStreamNonBlocking, greatest),
                          "creating the parameter (all-gather) stream");
  }
  if (status.ok()) {
    status =
        CudaErrorToStatus(cudaStreamCreateWithPriority(
                              &grad_stream_, cudaStreamNonBlocking, greatest),
                          "creating the gradient (reduce-scatter) stream");
  }
  if (status.ok()) {
    status = CudaErrorToStatus(
        cudaEventCreateWithFlags(&param_ready_, cudaEventDisableTiming),
        "cudaEventCreate");
  }
  if (status.ok()) {
    status = CudaErrorToStatus(
        cudaEventCreateWithFlags(&grad_ready_, cudaEventDisableTiming),
        "cudaEventCreate");
  }
  if (status.ok()) {
    status = CudaErrorToStatus(
        cudaMalloc(reinterpret_cast<void**>(&barrier_scratch_), sizeof(float)),
        "cudaMalloc");
  }
  if (status.ok()) {
    status = CudaErrorToStatus(cudaMemset(barrier_scratch_, 0, sizeof(float)),
                               "cudaMemset");
  }
  return status;
}

absl::Status NcclCommState::InitComm(const ncclUniqueId& id,
                                     const std::string& store_key) {
  DeviceGuard guard(options_.device);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0)
  config.commName = options_.name.c_str();
#endif
  const std::string what =
      absl::StrCat("ncclCommInitRankConfig for ", label_,
                   " (unique id from store key '", store_key, "')");
  ncclResult_t result;
  {
    absl::WriterMutexLock lock(&mu_);
    result = ncclCommInitRankConfig(&comm_, size_, id, rank_, &config);
  }
  if (result != ncclSuccess && result != ncclInProgress) {
    absl::Status status = NcclResultToStatus(result, what);
    Abort(status);
    return status;
  }
  absl::Status status = PollUntilReady(what, options_.init_timeout);
  if (absl::IsDeadlineExceeded(status)) {
    return absl::DeadlineExceededError(
        absl::StrCat(status.message(), " — a peer probably never joined"));
  }
  return status;
}

absl::Status NcclCommState::PollUntilReady(absl::string_view what,
                                           absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::Duration sleep = kPollInitialSleep;
  while (true) {
    ncclResult_t state = ncclSuccess;
    ncclResult_t result;
    {
      absl::ReaderMutexLock lock(&mu_);
      if (comm_ == nullptr) {
        return error_.ok() ? absl::FailedPreconditionError(
                                 absl::StrCat(label_, " is destroyed"))
                           : error_;
      }
      result = ncclCommGetAsyncError(comm_, &state);
    }
    if (result != ncclSuccess) state = result;
    if (state == ncclSuccess) return absl::OkStatus();
    if (state != ncclInProgress) {
      absl::Status status = NcclResultToStatus(state, what);
      Abort(status);
      return status;
    }
    if (absl::Now() >= deadline) {
      absl::Status status = absl::DeadlineExceededError(absl::StrCat(
          what, " did not finish within ", absl::FormatDuration(timeout), "; ",
          label_, " aborted"));
      Abort(status);
      return status;
    }
    absl::SleepFor(sleep);
    sleep = std::min(sleep * 2, kPollMaxSleep);
  }
}

void NcclCommState::Abort(const absl::Status& reason) {
  bool aborted = false;
  {
    absl::WriterMutexLock lock(&mu_);
    if (error_.ok()) error_ = reason;
    if (comm_ != nullptr) {
      DeviceGuard guard(options_.device);
      ncclCommAbort(comm_);
      comm_ = nullptr;
      aborted = true;
    }
  }
  if (aborted)
    std::cerr << "hsdp: aborted NCCL communicator " << label_ << ": " << reason
              << "\n";
}

void NcclCommState::RecordEnd(const std::shared_ptr<NcclWorkState>& work) {
  DeviceGuard guard(options_.device);
  cudaError_t error = cudaEventRecord(work->end, work->stream);
  {
    absl::MutexLock lock(&work->mu);
    if (error != cudaSuccess) {
      work->status = CudaErrorToStatus(
          error, absl::StrCat("recording the end of ", work->what));
      return;
    }
    work->end_recorded = true;
  }
  // Not under work->mu: CheckOutstanding takes outstanding_mu_ then work->mu
  // (in Completed()).
  absl::MutexLock outstanding_lock(&outstanding_mu_);
  outstanding_.push_back(work);
}

std::unique_ptr<Work> NcclCommState::Issue(StreamKind kind, std::string what,
                                           const NcclCall& call) {
  if (absl::Status status = this->status(); !status.ok()) {
    return CompletedWork(absl::Status(
        status.code(),
        absl::StrCat(what, ": communicator unusable: ", status.message())));
  }
  DeviceGuard guard(options_.device);
  auto work = std::make_shared<NcclWorkState>();
  work->comm = shared_from_this();
  work->what = std::move(what);
  work->stream = stream(kind);
  work->issued = absl::Now();

  // Order the collective after what the compute stream has issued so far (its
  // inputs).
  cudaEvent_t ready = kind == StreamKind::kParam ? param_ready_ : grad_ready_;
  absl::Status status = CudaErrorToStatus(
      cudaEventRecord(ready, compute_stream()), "recording the compute stream");
  if (status.ok()) {
    status = CudaErrorToStatus(cudaStreamWaitEvent(work->stream, ready, 0),
                               "cudaStreamWaitEvent");
  }
  if (status.ok() && options_.enable_timing) {
    status =
        CudaErrorToStatus(cudaEventCreate(&work->start), "cudaEventCreate");
    if (status.ok()) {
      status = CudaErrorToStatus(cudaEventRecord(work->start, work->stream),
                                 "cudaEventRecord");
    }
  }
  if (status.ok()) {
    status = CudaErrorToStatus(
        cudaEventCreateWithFlags(&work->end, options_.enable_timing
                                                 ? cudaEventDefault
                                                 : cudaEventDisableTiming),
        "cudaEventCreate");
  }
  if (!status.ok()) {
    return CompletedWork(absl::Status(
        status.code(), absl::StrCat(work->what, ": ", status.message())));
  }

  ncclResult_t result;
  {
    absl::ReaderMutexLock lock(&mu_);
    if (comm_ == nullptr) {
      return CompletedWork(absl::FailedPreconditionError(absl::StrCat(
          work->what, ": communicator unusable: ", error_.message())));
    }
    result = call(comm_, work->stream);
  }
  if (result != ncclSuccess && result != ncclInProgress) {
    status = NcclResultToStatus(result, work->what);
    if (IsFatal(result)) Abort(status);
    return CompletedWork(status);
  }
  if (g_group_depth > 0) {
    // Inside NcclGroup: the kernel launches at ncclGroupEnd; the end event is
    // recorded then.
    g_group_pending.push_back(work);
    return std::make_unique<NcclWork>(std::move(work));
  }
  if (result == ncclInProgress) {
    status = PollUntilReady(absl::StrCat("enqueueing ", work->what),
                            options_.collective_timeout);
    if (!status.ok()) return CompletedWork(status);
  }
  RecordEnd(work);
  return std::make_unique<NcclWork>(std::move(work));
}

void NcclCommState::StartWatchdog() {
  watchdog_ = std::thread([this] { WatchdogLoop(); });
}

void NcclCommState::StopWatchdog() {
  if (!watchdog_.joinable()) return;
  stop_watchdog_.Notify();
  watchdog_.join();
}

void NcclCommState::WatchdogLoop() {
  DeviceGuard guard(options_.device);
  while (!stop_watchdog_.WaitForNotificationWithTimeout(
      options_.watchdog_interval)) {
    CheckOutstanding();
  }
}

// Drops finished collectives; aborts on an async NCCL error or when the oldest
// unfinished one is older than collective_timeout (a peer died or issued a
// different collective).
void NcclCommState::CheckOutstanding() {
  ncclResult_t async_state = ncclSuccess;
  {
    absl::ReaderMutexLock lock(&mu_);
    if (comm_ == nullptr) return;
    if (ncclCommGetAsyncError(comm_, &async_state) != ncclSuccess)
      async_state = ncclInternalError;
  }
  std::shared_ptr<NcclWorkState> oldest;
  {
    absl::MutexLock lock(&outstanding_mu_);
    while (!outstanding_.empty() && outstanding_.front()->Completed())
      outstanding_.pop_front();
    if (!outstanding_.empty()) oldest = outstanding_.front();
  }
  if (async_state != ncclSuccess && async_state != ncclInProgress) {
    Abort(NcclResultToStatus(async_state,
                             absl::StrCat("asynchronous error on ", label_,
                                          oldest ? " while running " : "",
                                          oldest ? oldest->what : "")));
    return;
  }
  if (oldest != nullptr &&
      absl::Now() - oldest->issued > options_.collective_timeout) {
    Abort(absl::DeadlineExceededError(absl::StrCat(
        oldest->what, " did not complete within ",
        absl::FormatDuration(options_.collective_timeout), "; ", label_,
        " aborted (a peer died, hung, or issued a different collective)")));
  }
}

absl::Status NcclCommState::Synchronize(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::Duration sleep = kPollInitialSleep;
  while (true) {
    if (absl::Status status = this->status(); !status.ok()) return status;
    std::shared_ptr<NcclWorkState> oldest;
    {
      absl::MutexLock lock(&outstanding_mu_);
      while (!outstanding_.empty() && outstanding_.front()->Completed())
        outstanding_.pop_front();
      if (outstanding_.empty()) return absl::OkStatus();
      oldest = outstanding_.front();
    }
    if (absl::Now() >= deadline) {
      absl::Status status = absl::DeadlineExceededError(
          absl::StrCat(oldest->what, " did not complete within ",
                       absl::FormatDuration(timeout), " (Synchronize); ",
                       label_, " aborted"));
      Abort(status);
      return status;
    }
    absl::SleepFor(sleep);
    sleep = std::min(sleep * 2, kPollMaxSleep);
  }
}

void NcclCommState::Destroy() {
  StopWatchdog();
  FinalizeComm();
  // Outstanding works point back at this state: drop them so the state
  // (streams, events) is freed once the last Work handle goes.
  absl::MutexLock lock(&outstanding_mu_);
  outstanding_.clear();
}

void NcclCommState::FinalizeComm() {
  ncclComm_t comm;
  {
    absl::ReaderMutexLock lock(&mu_);
    comm = comm_;
  }
  if (comm == nullptr) return;  // never initialised or aborted
  DeviceGuard guard(options_.device);
  // Finalize flushes issued collectives and is non-blocking here; wait for it,
  // then free.
  const std::string what = absl::StrCat("ncclCommFinalize on ", label_);
  ncclResult_t result;
  {
    absl::ReaderMutexLock lock(&mu_);
    result = ncclCommFinalize(comm_);
  }
  absl::Status status =
      NcclResultToStatus(result == ncclInProgress ? ncclSuccess : result, what);
  if (status.ok()) {
    status = PollUntilReady(
        what, std::min(options_.collective_timeout, kMaxFinalizeTimeout));
  }
  absl::WriterMutexLock lock(&mu_);
  if (comm_ == nullptr) return;  // PollUntilReady aborted it
  if (status.ok()) {
    ncclCommDestroy(comm_);
  } else {
    ncclCommAbort(comm_);
  }
  comm_ = nullptr;
}

NcclCommState::~NcclCommState() {
  DeviceGuard guard(options_.device);
  if (param_ready_ != nullptr) cudaEventDestroy(param_ready_);
  if (grad_ready_ != nullptr) cudaEventDestroy(grad_ready_);
  if (param_stream_ != nullptr) cudaStreamDestroy(param_stream_);
  if (grad_stream_ != nullptr) cudaStreamDestroy(grad_stream_);
  if (barrier_scratch_ != nullptr) cudaFree(barrier_scratch_);
}

// ---- NcclCommunicator ----

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(
    Store& store, const std::string& store_key, int rank, int size,
    NcclOptions options) {
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(
        absl::StrFormat("NCCL communicator %s: rank %d outside [0, %d)",
                        options.name, rank, size));
  }
  absl::StatusOr<int> devices = CudaDeviceCount();
  if (!devices.ok()) {
    return absl::Status(devices.status().code(),
                        absl::StrCat("NCCL communicator ", options.name, ": ",
                                     devices.status().message()));
  }
  if (options.device < 0 || options.device >= *devices) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "NCCL communicator %s: cuda:%d does not exist (%d devices)",
        options.name, options.device, *devices));
  }

  ncclUniqueId id;
  if (rank == 0) {
    DeviceGuard guard(options.device);
    if (absl::Status s =
            NcclResultToStatus(ncclGetUniqueId(&id), "ncclGetUniqueId");
        !s.ok()) {
      return s;
    }
    if (absl::Status s = store.Set(store_key, EncodeUniqueId(id)); !s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat("publishing the NCCL unique id of ",
                                       options.name, ": ", s.message()));
    }
  } else {
    absl::StatusOr<std::string> bytes =
        store.Get(store_key, options.init_timeout);
    if (!bytes.ok()) {
      return absl::Status(
          bytes.status().code(),
          absl::StrCat("waiting for rank 0's NCCL unique id of ", options.name,
                       ": ", bytes.status().message()));
    }
    absl::StatusOr<ncclUniqueId> decoded = DecodeUniqueId(*bytes);
    if (!decoded.ok()) return decoded.status();
    id = *decoded;
  }

  auto state = std::make_shared<NcclCommState>(rank, size, std::move(options));
  if (absl::Status s = state->InitResources(); !s.ok()) return s;
  if (absl::Status s = state->InitComm(id, store_key); !s.ok()) return s;
  state->StartWatchdog();
  return std::unique_ptr<NcclCommunicator>(
      new NcclCommunicator(std::move(state)));
}

NcclCommunicator::NcclCommunicator(std::shared_ptr<NcclCommState> state)
    : state_(std::move(state)) {}

NcclCommunicator::~NcclCommunicator() { state_->Destroy(); }

int NcclCommunicator::rank() const { return state_->rank(); }
int NcclCommunicator::size() const { return state_->size(); }
std::string NcclCommunicator::name() const { return state_->options().name; }
cudaStream_t NcclCommunicator::param_stream() const {
  return state_->stream(NcclCommState::StreamKind::kParam);
}
cudaStream_t NcclCommunicator::grad_stream() const {
  return state_->stream(NcclCommState::StreamKind::kGrad);
}
absl::Status NcclCommunicator::Synchronize(absl::Duration timeout) {
  return state_->Synchronize(timeout);
}
void NcclCommunicator::Abort(const absl::Status& reason) {
  state_->Abort(reason);
}
absl::Status NcclCommunicator::Abort(absl::string_view reason) {
  state_->Abort(absl::AbortedError(reason));
  return absl::OkStatus();
}
absl::Status NcclCommunicator::status() const { return state_->status(); }

namespace {
std::string Describe(NcclCommState& state, absl::string_view op,
                     const Buffer& buffer) {
  return absl::StrFormat("%s #%d on %s (%d x %s)", op, state.NextSequence(),
                         state.label(), buffer.count,
                         DataTypeName(buffer.dtype));
}

// The NCCL type of a collective's buffers; INVALID_ARGUMENT naming `what` when
// `sized` differs from `reference` in dtype or is not `expected_count` long.
absl::StatusOr<ncclDataType_t> CheckedType(const std::string& what,
                                           const Buffer& reference,
                                           const Buffer& sized,
                                           int64_t expected_count,
                                           absl::string_view role) {
  if (reference.dtype != sized.dtype || sized.count != expected_count) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: %s must be %d x %s, got %d x %s", what, role, expected_count,
        DataTypeName(reference.dtype), sized.count, DataTypeName(sized.dtype)));
  }
  absl::StatusOr<ncclDataType_t> type = ToNcclDataType(reference.dtype);
  if (!type.ok()) {
    return absl::Status(type.status().code(),
                        absl::StrCat(what, ": ", type.status().message()));
  }
  return type;
}
}  // namespace

std::unique_ptr<Work> NcclCommunicator::AllGather(const Buffer& input,
                                                  const Buffer& output) {
  std::string what = Describe(*state_, "all_gather", input);
  absl::StatusOr<ncclDataType_t> type =
      CheckedType(what, input, output, input.count * size(), "output");
  if (!type.ok()) return CompletedWork(type.status());
  return state_->Issue(NcclCommState::StreamKind::kParam, std::move(what),
                       [&](ncclComm_t comm, cudaStream_t stream) {
                         return ncclAllGather(input.data, output.data,
                                              input.count, *type, comm, stream);
                       });
}

std::unique_ptr<Work> NcclCommunicator::ReduceScatter(const Buffer& input,
                                                      const Buffer& output,
                                                      ReduceOp op) {
  std::string what = Describe(*state_, "reduce_scatter", input);
  absl::StatusOr<ncclDataType_t> type =
      CheckedType(what, output, input, output.count * size(), "input");
  if (!type.ok()) return CompletedWork(type.status());
  return state_->Issue(NcclCommState::StreamKind::kGrad, std::move(what),
                       [&](ncclComm_t comm, cudaStream_t stream) {
                         return ncclReduceScatter(
                             input.data, output.data, output.count, *type,
                             ToNcclRedOp(op), comm, stream);
                       });
}

std::unique_ptr<Work> NcclCommunicator::AllReduce(const Buffer& buffer,
                                                  ReduceOp op) {
  std::string what = Describe(*state_, "all_reduce", buffer);
  absl::StatusOr<ncclDataType_t> type =
      CheckedType(what, buffer, buffer, buffer.count, "buffer");
  if (!type.ok()) return CompletedWork(type.status());
  return state_->Issue(NcclCommState::StreamKind::kGrad, std::move(what),
                       [&](ncclComm_t comm, cudaStream_t stream) {
                         return ncclAllReduce(buffer.data, buffer.data,
                                              buffer.count, *type,
                                              ToNcclRedOp(op), comm, stream);
                       });
}

std::unique_ptr<Work> NcclCommunicator::Broadcast(const Buffer& buffer,
                                                  int root) {
  std::string what =
      Describe(*state_, absl::StrCat("broadcast(root ", root, ")"), buffer);
  absl::StatusOr<ncclDataType_t> type =
      CheckedType(what, buffer, buffer, buffer.count, "buffer");
  if (!type.ok()) return CompletedWork(type.status());
  if (root < 0 || root >= size()) {
    return CompletedWork(absl::InvalidArgumentError(
        absl::StrCat(what, ": root outside [0, ", size(), ")")));
  }
  return state_->Issue(NcclCommState::StreamKind::kParam, std::move(what),
                       [&](ncclComm_t comm, cudaStream_t stream) {
                         return ncclBroadcast(buffer.data, buffer.data,
                                              buffer.count, *type, root, comm,
                                              stream);
                       });
}

std::unique_ptr<Work> NcclCommunicator::Barrier() {
  // A one-element all-reduce on a private scratch value: orders the compute
  // stream after every rank reached this point. Use Synchronize() after Wait()
  // for a CPU-side barrier.
  Buffer scratch{state_->barrier_scratch(), 1, DataType::kFloat32};
  std::string what = Describe(*state_, "barrier", scratch);
  return state_->Issue(NcclCommState::StreamKind::kGrad, std::move(what),
                       [&](ncclComm_t comm, cudaStream_t stream) {
                         return ncclAllReduce(scratch.data, scratch.data, 1,
                                              ncclFloat32, ncclSum, comm,
                                              stream);
                       });
}

CommunicatorFactory NcclCommunicatorFactory(Store& store,
                                            NcclOptions base_options) {
  return [&store, base_options](const GroupSpec& group)
             -> absl::StatusOr<std::unique_ptr<Communicator>> {
    NcclOptions options = base_options;
    options.name = absl::StrCat(base_options.name, ":", group.kind);
    absl::StatusOr<std::unique_ptr<NcclCommunicator>> comm =
        NcclCommunicator::Create(store,
                                 absl::StrCat(group.prefix, "/nccl_unique_id"),
                                 group.rank, group.size, std::move(options));
    if (!comm.ok()) return comm.status();
    return std::unique_ptr<Communicator>(std::move(*comm));
  };
}

}  // namespace hsdp::comm
