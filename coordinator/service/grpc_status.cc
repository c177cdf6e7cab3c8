#include "coordinator/service/grpc_status.h"

#include <string>

namespace hsdp::coordinator {
namespace {

// Highest canonical code shared by absl and gRPC (UNAUTHENTICATED).
constexpr int kMaxCanonicalCode = 16;

bool IsCanonical(int code) { return code >= 0 && code <= kMaxCanonicalCode; }

}  // namespace

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  const int code = static_cast<int>(status.code());
  if (!IsCanonical(code)) {
    return grpc::Status(grpc::StatusCode::UNKNOWN,
                        std::string(status.message()));
  }
  return grpc::Status(static_cast<grpc::StatusCode>(code),
                      std::string(status.message()));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  const int code = static_cast<int>(status.error_code());
  if (!IsCanonical(code)) return absl::UnknownError(status.error_message());
  return absl::Status(static_cast<absl::StatusCode>(code),
                      status.error_message());
}

}  // namespace hsdp::coordinator
