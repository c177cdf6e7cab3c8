// Conversions between absl::Status (used inside the coordinator) and
// grpc::Status (on the wire). absl and gRPC share the canonical code numbering
// (OK=0 ... UNAUTHENTICATED=16), so the mapping is one-to-one; anything outside
// that range becomes UNKNOWN rather than an invalid wire code.
#ifndef HSDP_COORDINATOR_SERVICE_GRPC_STATUS_H_
#define HSDP_COORDINATOR_SERVICE_GRPC_STATUS_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace hsdp::coordinator {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace hsdp::coordinator

#endif  // HSDP_COORDINATOR_SERVICE_GRPC_STATUS_H_
