// Bearer-token authentication of one gRPC service's calls: the call must carry
// `authorization: Bearer <token>` metadata. ControlService checks the
// operator's control token with it, CoordinatorService the job token.
#ifndef HSDP_COORDINATOR_SERVICE_BEARER_AUTH_H_
#define HSDP_COORDINATOR_SERVICE_BEARER_AUTH_H_

#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace grpc {
class ServerContext;
}

namespace grpc {
class ServerContextBase;
}  // namespace grpc

namespace hsdp::coordinator {

// Immutable after construction, so thread-safe.
class BearerAuth {
 public:
  // An empty `token` turns authentication off (every call passes). `what`
  // names the token in errors, e.g. "job token".
  BearerAuth(const std::string& token, std::string what);
  BearerAuth(const BearerAuth&) = delete;
  BearerAuth& operator=(const BearerAuth&) = delete;

  bool enabled() const { return !expected_.empty(); }

  // OK, or UNAUTHENTICATED saying whether the metadata was missing or wrong
  // (never echoing what was sent). The comparison takes constant time.
  absl::Status Check(const grpc::ServerContextBase& context) const;
  // The same check on an HTTP Authorization header's value (nullopt when the
  // header is absent), for the dashboard.
  absl::Status Check(std::optional<absl::string_view> authorization) const;

 private:
  // "Bearer <token>", or empty.
  const std::string expected_;
  const std::string what_;
};

}  // namespace hsdp::coordinator

#endif  // HSDP_COORDINATOR_SERVICE_BEARER_AUTH_H_
