#include "coordinator/service/bearer_auth.h"

#include <grpcpp/server_context.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/token.h"

namespace hsdp::coordinator {

BearerAuth::BearerAuth(const std::string& token, std::string what)
    : expected_(token.empty() ? "" : absl::StrCat(kBearerPrefix, token)),
      what_(std::move(what)) {}

absl::Status BearerAuth::Check(const grpc::ServerContextBase& context) const {
  const auto& metadata = context.client_metadata();
  auto it = metadata.find(kAuthorizationMetadata);
  if (it == metadata.end()) return Check(std::nullopt);
  return Check(absl::string_view(it->second.data(), it->second.size()));
}

absl::Status BearerAuth::Check(
    std::optional<absl::string_view> authorization) const {
  if (expected_.empty()) return absl::OkStatus();
  if (!authorization.has_value()) {
    return absl::UnauthenticatedError(
        absl::StrCat("missing '", kAuthorizationMetadata, ": Bearer <", what_,
                     ">' metadata"));
  }
  if (!ConstantTimeEquals(*authorization, expected_)) {
    return absl::UnauthenticatedError(absl::StrCat("invalid ", what_));
  }
  return absl::OkStatus();
}

}  // namespace hsdp::coordinator
