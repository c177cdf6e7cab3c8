// The control token: the bearer token that guards the operator's API, checked
// the same way for gRPC (`authorization` metadata) and for the dashboard's
// HTTP requests (the Authorization header).
#ifndef HSDP_COORDINATOR_CONTROL_TOKEN_H_
#define HSDP_COORDINATOR_CONTROL_TOKEN_H_

#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace hsdp::coordinator {

// Immutable, so thread-safe.
class ControlToken {
 public:
  // An empty token turns the check off (every call is allowed).
  explicit ControlToken(const std::string& token);

  bool required() const { return !expected_.empty(); }

  // `authorization` is the header's value, nullopt when the header is absent.
  // UNAUTHENTICATED when a token is required and the value is not exactly
  // "Bearer <token>". The comparison takes the same time however much of a
  // guess was right.
  absl::Status Check(std::optional<absl::string_view> authorization) const;

 private:
  std::string expected_;  // "Bearer <token>", or empty
};

}  // namespace hsdp::coordinator

#endif  // HSDP_COORDINATOR_CONTROL_TOKEN_H_
