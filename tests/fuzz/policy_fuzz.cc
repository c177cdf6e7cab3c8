// Fuzzes the policy parser (JSON and protobuf text format) and what
// `hsdp-coordinator --validate-policy` and the control service run on a parsed
// policy: validation with and without a model, defaults, printing.
//
// Invariants: whatever parses and validates survives a round trip through its
// JSON and text forms unchanged, and resolving defaults keeps it valid.
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/policy.h"
#include "common/units.h"
#include "google/protobuf/util/message_differencer.h"
#include "tests/fuzz/fuzz_check.h"

namespace {

const hsdp::UnitList& Units() {
  static const hsdp::UnitList* units = [] {
    auto* list = new hsdp::UnitList;
    for (const char* name : {"root", "layers.0", "layers.1", "layers.10"}) {
      hsdp::v1::UnitInfo unit;
      unit.set_name(name);
      unit.set_param_count(100);
      unit.set_param_bytes(400);
      list->push_back(unit);
    }
    return list;
  }();
  return *units;
}

bool Same(const hsdp::v1::Policy& a, const hsdp::v1::Policy& b) {
  return google::protobuf::util::MessageDifferencer::Equals(a, b);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<hsdp::v1::Policy> policy = hsdp::ParsePolicy(text);
  if (!policy.ok()) {
    FUZZ_CHECK(policy.status().code() == absl::StatusCode::kInvalidArgument);
    return 0;
  }
  // What --validate-policy runs: no model known yet.
  const absl::Status valid = hsdp::ValidatePolicy(*policy, {});
  (void)hsdp::ValidatePolicy(*policy, Units());
  (void)hsdp::PolicyToText(*policy);
  if (!valid.ok()) {
    FUZZ_CHECK(valid.code() == absl::StatusCode::kInvalidArgument);
    return 0;
  }
  (void)hsdp::DescribePolicy(*policy);
  for (const char* unit : {"root", "layers.1", "x"}) {
    (void)hsdp::ResolveUnitReshard(*policy, unit);
  }
  const hsdp::v1::Policy resolved = hsdp::ResolvePolicyDefaults(*policy);
  FUZZ_CHECK(hsdp::ValidatePolicy(resolved, {}).ok());

  absl::StatusOr<hsdp::v1::Policy> from_json =
      hsdp::ParsePolicy(hsdp::PolicyToJson(*policy));
  FUZZ_CHECK(from_json.ok());
  FUZZ_CHECK(Same(*from_json, *policy));
  absl::StatusOr<hsdp::v1::Policy> from_text =
      hsdp::ParsePolicy(hsdp::PolicyToText(*policy));
  FUZZ_CHECK(from_text.ok());
  FUZZ_CHECK(Same(*from_text, *policy));
  return 0;
}
