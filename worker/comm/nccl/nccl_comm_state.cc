#include "worker/comm/nccl/nccl_comm_state.h"

#include <iostream>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "worker/comm/nccl/nccl_communicator.h"
#include "worker/comm/nccl/nccl_errors.h"

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

}  // namespace

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
      if (IsFatalNcclResult(result)) work->comm->Abort(status);
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
    if (IsFatalNcclResult(result)) Abort(status);
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

}  // namespace hsdp::comm
