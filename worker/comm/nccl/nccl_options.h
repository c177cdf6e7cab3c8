// The options of the NCCL backend (see nccl_communicator.h).
#ifndef HSDP_WORKER_COMM_NCCL_NCCL_OPTIONS_H_
#define HSDP_WORKER_COMM_NCCL_NCCL_OPTIONS_H_

#include <cuda_runtime_api.h>

#include <functional>
#include <string>

#include "absl/time/time.h"

namespace hsdp::comm {

// Returns the caller's current compute stream (the engine passes
// `[] { return at::cuda::getCurrentCUDAStream().stream(); }`).
using CudaStreamProvider = std::function<cudaStream_t()>;

struct NcclOptions {
  int device = 0;
  // Used in errors and logs, and as NCCL's commName; e.g. "nccl:shard".
  std::string name = "nccl";
  // Rendezvous: time to wait for rank 0's unique id in the Store, and for
  // ncclCommInitRankConfig.
  absl::Duration init_timeout = absl::Minutes(5);
  // A collective not finished this long after issue aborts the communicator.
  absl::Duration collective_timeout = absl::Minutes(10);
  // Watchdog polling period (async errors and timeouts).
  absl::Duration watchdog_interval = absl::Milliseconds(100);
  // Null: the legacy default stream, which is LibTorch's default compute
  // stream.
  CudaStreamProvider compute_stream;
  // Record timing events so Work::ElapsedSeconds() is valid (costs two events
  // per collective).
  bool enable_timing = true;
};

}  // namespace hsdp::comm

#endif  // HSDP_WORKER_COMM_NCCL_NCCL_OPTIONS_H_
