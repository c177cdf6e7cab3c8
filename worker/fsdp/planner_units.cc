#include "worker/fsdp/planner_units.h"

#include <map>
#include <string>

namespace hsdp::fsdp {

hsdp::UnitList PlannerUnits(const Engine& engine) {
  // The storage dtype's element size, from each parameter's local shard.
  std::map<std::string, int64_t> element_size;
  for (const auto& [name, shard] : engine.NamedParameters()) {
    element_size[name] = static_cast<int64_t>(shard.element_size());
  }
  hsdp::UnitList units;
  for (const UnitLayout& info : engine.Units()) {
    hsdp::v1::UnitInfo unit;
    unit.set_name(info.name);
    unit.set_param_count(info.numel);
    // A unit's parameters share one storage dtype in every model here; the
    // first one's size stands for all (4 bytes for a unit without any).
    int64_t size = 4;
    if (!info.param_names.empty()) size = element_size[info.param_names[0]];
    unit.set_param_bytes(info.numel * size);
    units.push_back(std::move(unit));
  }
  return units;
}

}  // namespace hsdp::fsdp
