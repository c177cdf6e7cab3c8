// A model's unit list (contract: index 0 is "root", then "layers.0",
// "layers.1", ... in forward order) and the checks the coordinator applies to
// the lists workers report.
#ifndef HSDP_COMMON_UNITS_H_
#define HSDP_COMMON_UNITS_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "google/protobuf/repeated_field.h"
#include "hsdp/v1/common.pb.h"

namespace hsdp {

using UnitList = std::vector<hsdp::v1::UnitInfo>;

UnitList UnitListFromProto(
    const google::protobuf::RepeatedPtrField<hsdp::v1::UnitInfo>& units);

std::vector<std::string> UnitNames(const UnitList& units);

// A unit list is well formed when it is non-empty, every name is non-empty and
// unique, and counts/bytes are non-negative. INVALID_ARGUMENT naming the
// offending unit otherwise.
absl::Status ValidateUnitList(const UnitList& units);

// OK when `got` equals `want` (names, param_count, param_bytes,
// replicated_bytes, same length).
// Otherwise FAILED_PRECONDITION naming the first differing unit, e.g. "unit 2
// differs: got layers.1 (params 10, bytes 40), the job has layers.1 (params 12,
// bytes 48)" or "unit count differs: got 3 units, the job has 5 (first missing:
// layers.3)".
absl::Status CompareUnitLists(const UnitList& got, const UnitList& want);

// Sum of param_bytes.
int64_t TotalParamBytes(const UnitList& units);

}  // namespace hsdp

#endif  // HSDP_COMMON_UNITS_H_
