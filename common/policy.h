// Parsing, validation, defaults and printing of hsdp.v1.Policy (the sharding
// policy).
//
// Field limits and defaults (the proto documents the same):
// - reshard_after_forward, reshard_after_backward: default true.
// - forward_prefetch_depth, backward_prefetch_depth: default 1, range
//   [0, kMaxPrefetchDepth].
// - microbatches: 0 means 1, range [0, kMaxMicrobatches].
// - grad_sync, all_reduce: UNSPECIFIED means LAST_MICROBATCH; values outside
//   the enum are rejected.
// - checkpoint_interval: >= 0 (0: never).
// - memory_budget_bytes: >= 0 (0: manual mode).
// - comm_fusion_bucket_bytes: >= 0 (0: no fusion).
// - overrides[i]: unit_glob non-empty and matching >= 1 unit; must set at
//   least one of the two flags.
// Every rejection is INVALID_ARGUMENT whose message starts with the field path,
// e.g. "policy.forward_prefetch_depth: -1 is negative".
#ifndef HSDP_COMMON_POLICY_H_
#define HSDP_COMMON_POLICY_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/units.h"
#include "hsdp/v1/policy.pb.h"

namespace hsdp {

inline constexpr int kDefaultPrefetchDepth = 1;
inline constexpr int kMaxPrefetchDepth = 16;
inline constexpr int kMaxMicrobatches = 1024;

// Parses a Policy from JSON (text starting with '{') or protobuf text format
// (anything else; empty text is an empty, valid Policy). Unknown fields and
// syntax errors are INVALID_ARGUMENT naming the field and, for text format,
// "line:column". Does not validate ranges: call ValidatePolicy.
absl::StatusOr<hsdp::v1::Policy> ParsePolicy(absl::string_view text);

// Reads `path` and parses it (NOT_FOUND if unreadable; parse errors are
// prefixed with path).
absl::StatusOr<hsdp::v1::Policy> ReadPolicyFile(const std::string& path);

// Checks every field against the limits above. When `units` is non-empty each
// override glob must match at least one unit name; with an empty list (model
// not known yet) only the glob's non-emptiness is checked.
absl::Status ValidatePolicy(const hsdp::v1::Policy& policy,
                            const UnitList& units);

// A copy with every optional field set to its effective value: both reshard
// flags, both prefetch depths, microbatches >= 1, grad_sync/all_reduce not
// UNSPECIFIED. Overrides and the other fields are kept. Precondition:
// ValidatePolicy passed (no clamping happens).
hsdp::v1::Policy ResolvePolicyDefaults(const hsdp::v1::Policy& policy);

// Effective (reshard_after_forward, reshard_after_backward) for a unit name:
// the policy defaults, then each matching override in order (later overrides
// win).
struct UnitReshard {
  bool after_forward = true;
  bool after_backward = true;
  // True when some override set after_forward explicitly (memory-budget mode
  // leaves it).
  bool forward_pinned = false;
};
UnitReshard ResolveUnitReshard(const hsdp::v1::Policy& policy,
                               absl::string_view unit_name);

// Glob match over the whole name: '*' matches any run (including '.' and
// empty), '?' matches exactly one character; everything else is literal.
bool GlobMatch(absl::string_view pattern, absl::string_view name);

// Protobuf text format of the policy as given (fields left unset stay unset).
std::string PolicyToText(const hsdp::v1::Policy& policy);
// Pretty JSON (proto3 JSON mapping, field names as in the .proto, snake_case);
// ParsePolicy reads it back.
std::string PolicyToJson(const hsdp::v1::Policy& policy);
// A human-readable multi-line summary of the effective values, marking
// defaults, e.g.
//   reshard_after_forward:   true (default)
//   forward_prefetch_depth:  2
//   override layers.*:       reshard_after_forward=false
std::string DescribePolicy(const hsdp::v1::Policy& policy);

}  // namespace hsdp

#endif  // HSDP_COMMON_POLICY_H_
