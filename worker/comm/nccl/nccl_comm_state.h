// The shared state behind an NcclCommunicator and its Work handles: the NCCL
// communicator's lifetime (streams and events, non-blocking init, finalize or
// abort), issuing a collective on a comm stream, and the watchdog that aborts
// on an asynchronous NCCL error or a collective past its timeout. Internal to
// the NCCL backend; nccl_communicator.h is the interface.
//
// Thread-safety: stated on each type below.
#ifndef HSDP_WORKER_COMM_NCCL_NCCL_COMM_STATE_H_
#define HSDP_WORKER_COMM_NCCL_NCCL_COMM_STATE_H_

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "hsdp/communicator.h"
#include "worker/comm/nccl/nccl_options.h"

namespace hsdp::comm {

// Makes `device` current for the scope: events and streams belong to the device
// that was current when they were created or recorded, and the caller's thread
// may have another device current. A scope object of one thread.
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
  // Runs `call` on the comm stream of `kind`, ordered after what the compute
  // stream issued so far, and returns its Work (inside an NcclGroup, completed
  // at the group's end). A failure completes the Work with a Status naming
  // `what`; a fatal NCCL result aborts the communicator.
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

}  // namespace hsdp::comm

#endif  // HSDP_WORKER_COMM_NCCL_NCCL_COMM_STATE_H_
