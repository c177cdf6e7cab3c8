#include "common/token.h"

#include <sys/random.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "common/status_util.h"

namespace hsdp {
namespace {

constexpr size_t kRandomTokenBytes = 32;

}  // namespace

bool ConstantTimeEquals(absl::string_view got, absl::string_view expected) {
  // Walks `expected` whole whatever `got` holds; a length mismatch is folded
  // into the same accumulator instead of returning early.
  unsigned char diff = got.size() == expected.size() ? 0 : 1;
  for (size_t i = 0; i < expected.size(); ++i) {
    const unsigned char g =
        got.empty() ? 0 : static_cast<unsigned char>(got[i % got.size()]);
    diff |=
        static_cast<unsigned char>(g ^ static_cast<unsigned char>(expected[i]));
  }
  return diff == 0;
}

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  absl::StatusOr<std::string> contents = ReadFile(path);
  if (!contents.ok()) return AnnotateStatus(contents.status(), "token file");
  std::string token(absl::StripAsciiWhitespace(*contents));
  if (token.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("token file ", path, " is empty"));
  }
  return token;
}

absl::StatusOr<std::string> ResolveToken(const std::string& file_flag,
                                         const char* file_env,
                                         const char* value_env) {
  if (!file_flag.empty()) return ReadTokenFile(file_flag);
  const char* file = std::getenv(file_env);
  if (file != nullptr && *file != '\0') return ReadTokenFile(file);
  const char* value = std::getenv(value_env);
  if (value != nullptr && *value != '\0') {
    return std::string(absl::StripAsciiWhitespace(value));
  }
  return std::string();
}

absl::StatusOr<std::string> RandomToken() {
  char bytes[kRandomTokenBytes];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::InternalError(
          absl::StrCat("getrandom: ", std::strerror(errno)));
    }
    got += static_cast<size_t>(n);
  }
  return absl::BytesToHexString(absl::string_view(bytes, sizeof(bytes)));
}

}  // namespace hsdp
