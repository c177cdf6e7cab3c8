// Bearer tokens: the operator's control token (ControlService) and the job
// token every worker call carries (CoordinatorService). Reading them from
// files or the environment, comparing them without a timing side channel, and
// making fresh ones.
#ifndef HSDP_COMMON_TOKEN_H_
#define HSDP_COMMON_TOKEN_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace hsdp {

// The job token's environment variables: a file holding it, or the value
// itself. Launchers hand the token down this way (never on argv, where `ps`
// shows it).
inline constexpr char kJobTokenFileEnv[] = "HSDP_JOB_TOKEN_FILE";
inline constexpr char kJobTokenEnv[] = "HSDP_JOB_TOKEN";

// The metadata key both tokens travel in, as "Bearer <token>".
inline constexpr char kAuthorizationMetadata[] = "authorization";
inline constexpr char kBearerPrefix[] = "Bearer ";

// True when `got` equals `expected`. The time taken depends only on
// expected.size(), never on where `got` first differs, so a caller cannot
// learn a token byte by byte from response times.
bool ConstantTimeEquals(absl::string_view got, absl::string_view expected);

// The contents of `path` with surrounding whitespace stripped (a trailing
// newline from `echo` is not part of the token). NOT_FOUND when unreadable,
// INVALID_ARGUMENT when empty.
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

// The first that is set: the file `file_flag`, the file named by the
// environment variable `file_env`, the value of the environment variable
// `value_env`. Empty when none is set; errors of ReadTokenFile otherwise.
absl::StatusOr<std::string> ResolveToken(const std::string& file_flag,
                                         const char* file_env,
                                         const char* value_env);

// A fresh random token: 32 bytes from the kernel's CSPRNG, as 64 hex digits.
// INTERNAL if the kernel refuses (it does not block after early boot).
absl::StatusOr<std::string> RandomToken();

}  // namespace hsdp

#endif  // HSDP_COMMON_TOKEN_H_
