#include "common/status_util.h"

#include "absl/strings/str_cat.h"

namespace hsdp {

absl::Status AnnotateStatus(const absl::Status& status,
                            absl::string_view prefix) {
  if (status.ok()) return status;
  return absl::Status(status.code(),
                      absl::StrCat(prefix, ": ", status.message()));
}

}  // namespace hsdp
