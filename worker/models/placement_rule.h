// Placement rules: which parameters of a model are sharded on a dim other than
// 0 or replicated (fsdp placement.h), by name, for models configured from the
// command line (a TorchScript model's --task-option placement=RULE).
//
// A rule is comma-separated entries GLOB=WHERE, where GLOB matches dotted
// parameter names as in unit rules (unit_rule.h: '*' within one component)
// and WHERE is a dim ("1", "-1") or "replicated":
//   "layers.*.norm.*=replicated,layers.*.up.weight=1"
// Torch-light (the placement type only).
#ifndef HSDP_WORKER_MODELS_PLACEMENT_RULE_H_
#define HSDP_WORKER_MODELS_PLACEMENT_RULE_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "hsdp/placement.h"

namespace hsdp::models {

// The placement of every parameter in `param_names` that `rule` names.
// INVALID_ARGUMENT naming the entry for an entry that is not GLOB=WHERE, a
// WHERE that is neither an integer nor "replicated", a glob that matches no
// parameter, and a parameter two entries place.
absl::StatusOr<std::map<std::string, fsdp::ParamPlacement>> MatchPlacementRule(
    absl::string_view rule, const std::vector<std::string>& param_names);

}  // namespace hsdp::models

#endif  // HSDP_WORKER_MODELS_PLACEMENT_RULE_H_
