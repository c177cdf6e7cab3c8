#include "worker/comm/nccl/nccl_errors.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace hsdp::comm {

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

bool IsFatalNcclResult(ncclResult_t result) {
  return result != ncclSuccess && result != ncclInProgress &&
         result != ncclInvalidArgument && result != ncclInvalidUsage;
}

}  // namespace hsdp::comm
