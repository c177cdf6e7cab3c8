// How the NCCL backend reports failure: CUDA and NCCL results as absl::Status,
// which NCCL results break a communicator for good, and whether this machine
// has a CUDA device at all. Device-free: no GPU needed, unit-tested on CPU
// machines. Stateless, so thread-safe.
#ifndef HSDP_WORKER_COMM_NCCL_NCCL_ERRORS_H_
#define HSDP_WORKER_COMM_NCCL_NCCL_ERRORS_H_

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace hsdp::comm {

// Number of visible CUDA devices. UNAVAILABLE with the CUDA error text when
// there is no driver or no device (cudaGetDeviceCount fails or returns 0),
// which is how tests decide to skip.
absl::StatusOr<int> CudaDeviceCount();

// OK for ncclSuccess; otherwise a Status whose code reflects the failure class
// and whose message is
// "<what>: <ncclGetErrorString>" plus NCCL's last-error detail when `comm` is
// given. ncclInProgress is not an error of its own and maps to UNAVAILABLE only
// when passed here explicitly.
absl::Status NcclResultToStatus(ncclResult_t result, absl::string_view what,
                                ncclComm_t comm = nullptr);
absl::Status CudaErrorToStatus(cudaError_t error, absl::string_view what);

// Invalid-argument style results leave the communicator usable; any other
// failure means NCCL's state (or a peer) is broken and the communicator must
// be aborted. False for ncclSuccess and ncclInProgress.
bool IsFatalNcclResult(ncclResult_t result);

}  // namespace hsdp::comm

#endif  // HSDP_WORKER_COMM_NCCL_NCCL_ERRORS_H_
