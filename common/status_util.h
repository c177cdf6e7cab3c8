// Status helpers shared by every hsdp module. Debian's Abseil (20220623) ships
// no ASSIGN_OR_RETURN-style macros, so they are defined once here.
#ifndef HSDP_COMMON_STATUS_UTIL_H_
#define HSDP_COMMON_STATUS_UTIL_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

// Returns from the enclosing function if `expr` (an absl::Status) is not OK.
#define HSDP_RETURN_IF_ERROR(expr)                  \
  do {                                              \
    ::absl::Status hsdp_status_macro_tmp_ = (expr); \
    if (!hsdp_status_macro_tmp_.ok()) {             \
      return hsdp_status_macro_tmp_;                \
    }                                               \
  } while (false)

#define HSDP_STATUS_MACROS_CONCAT_INNER_(x, y) x##y
#define HSDP_STATUS_MACROS_CONCAT_(x, y) HSDP_STATUS_MACROS_CONCAT_INNER_(x, y)

// `HSDP_ASSIGN_OR_RETURN(auto x, F());` or `HSDP_ASSIGN_OR_RETURN(x, F());`
// evaluates the absl::StatusOr<T> returned by F(); on error returns its status,
// else moves the value into x.
#define HSDP_ASSIGN_OR_RETURN(lhs, rexpr) \
  HSDP_ASSIGN_OR_RETURN_IMPL_(            \
      HSDP_STATUS_MACROS_CONCAT_(hsdp_statusor_tmp_, __LINE__), lhs, rexpr)

#define HSDP_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                \
  if (!statusor.ok()) {                                   \
    return std::move(statusor).status();                  \
  }                                                       \
  lhs = std::move(statusor).value()

namespace hsdp {

// Returns `status` with `prefix: ` prepended to its message (same code). OK
// stays OK.
absl::Status AnnotateStatus(const absl::Status& status,
                            absl::string_view prefix);

}  // namespace hsdp

#endif  // HSDP_COMMON_STATUS_UTIL_H_
