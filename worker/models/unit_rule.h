// Unit rules: which submodules of a model are sharding units, by name.
//
// A rule is one or more comma-separated globs over dotted submodule names
// ("layers.*", "encoder.blocks.*,decoder.blocks.*"). In a glob, '*' matches any
// run of characters within one name component (never a '.'); everything else
// matches itself. So "layers.*" matches "layers.0" and "layers.11" but not
// "layers.0.attn". Torch-free.
#ifndef HSDP_WORKER_MODELS_UNIT_RULE_H_
#define HSDP_WORKER_MODELS_UNIT_RULE_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace hsdp::models {

// Whether `name` matches the one glob `pattern`.
bool GlobMatchesModuleName(absl::string_view pattern, absl::string_view name);

// The names in `module_names` (in their order) that `rule` selects.
// INVALID_ARGUMENT naming the glob for an empty rule or glob, a glob that
// matches no submodule, and a selection in which one unit contains another
// (their parameters would belong to two units).
absl::StatusOr<std::vector<std::string>> MatchUnitRule(
    absl::string_view rule, const std::vector<std::string>& module_names);

}  // namespace hsdp::models

#endif  // HSDP_WORKER_MODELS_UNIT_RULE_H_
