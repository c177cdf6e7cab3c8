#include "common/units.h"

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"

namespace hsdp {
namespace {

std::string DescribeUnit(const hsdp::v1::UnitInfo& unit) {
  return absl::StrCat(
      unit.name(), " (params ", unit.param_count(), ", bytes ",
      unit.param_bytes(),
      unit.replicated_bytes() == 0
          ? ""
          : absl::StrCat(", replicated bytes ", unit.replicated_bytes()),
      ")");
}

bool SameUnit(const hsdp::v1::UnitInfo& a, const hsdp::v1::UnitInfo& b) {
  return a.name() == b.name() && a.param_count() == b.param_count() &&
         a.param_bytes() == b.param_bytes() &&
         a.replicated_bytes() == b.replicated_bytes();
}

}  // namespace

UnitList UnitListFromProto(
    const google::protobuf::RepeatedPtrField<hsdp::v1::UnitInfo>& units) {
  return UnitList(units.begin(), units.end());
}

std::vector<std::string> UnitNames(const UnitList& units) {
  std::vector<std::string> names;
  names.reserve(units.size());
  for (const auto& unit : units) names.push_back(unit.name());
  return names;
}

absl::Status ValidateUnitList(const UnitList& units) {
  if (units.empty()) {
    return absl::InvalidArgumentError("unit list is empty");
  }
  absl::flat_hash_set<std::string> seen;
  for (size_t i = 0; i < units.size(); ++i) {
    const auto& unit = units[i];
    if (unit.name().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("unit ", i, ": empty name"));
    }
    if (!seen.insert(unit.name()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("unit ", i, ": duplicate name ", unit.name()));
    }
    if (unit.param_count() < 0 || unit.param_bytes() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("unit ", i, ": negative size in ", DescribeUnit(unit)));
    }
    if (unit.replicated_bytes() < 0 ||
        unit.replicated_bytes() > unit.param_bytes()) {
      return absl::InvalidArgumentError(
          absl::StrCat("unit ", i, ": replicated_bytes outside [0, ",
                       "param_bytes] in ", DescribeUnit(unit)));
    }
  }
  return absl::OkStatus();
}

absl::Status CompareUnitLists(const UnitList& got, const UnitList& want) {
  const size_t common = std::min(got.size(), want.size());
  for (size_t i = 0; i < common; ++i) {
    if (!SameUnit(got[i], want[i])) {
      return absl::FailedPreconditionError(
          absl::StrCat("unit ", i, " differs: got ", DescribeUnit(got[i]),
                       ", the job has ", DescribeUnit(want[i])));
    }
  }
  if (got.size() != want.size()) {
    const std::string first =
        got.size() < want.size()
            ? absl::StrCat("first missing: ", want[common].name())
            : absl::StrCat("first extra: ", got[common].name());
    return absl::FailedPreconditionError(
        absl::StrCat("unit count differs: got ", got.size(),
                     " units, the job has ", want.size(), " (", first, ")"));
  }
  return absl::OkStatus();
}

int64_t TotalParamBytes(const UnitList& units) {
  int64_t total = 0;
  for (const auto& unit : units) total += unit.param_bytes();
  return total;
}

}  // namespace hsdp
