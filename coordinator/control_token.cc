#include "coordinator/control_token.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace hsdp::coordinator {
namespace {

// Compares without an early exit, so the time taken does not reveal how much of
// a guessed token was right.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const size_t n = std::min(a.size(), b.size());
  for (size_t i = 0; i < n; ++i)
    diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace

ControlToken::ControlToken(const std::string& token)
    : expected_(token.empty() ? "" : absl::StrCat("Bearer ", token)) {}

absl::Status ControlToken::Check(
    std::optional<absl::string_view> authorization) const {
  if (expected_.empty()) return absl::OkStatus();
  if (!authorization.has_value()) {
    return absl::UnauthenticatedError(
        "no control token: send 'authorization: Bearer <token>'");
  }
  if (!ConstantTimeEquals(*authorization, expected_)) {
    return absl::UnauthenticatedError("invalid control token");
  }
  return absl::OkStatus();
}

}  // namespace hsdp::coordinator
