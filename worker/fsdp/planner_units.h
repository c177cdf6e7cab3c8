// The engine's units as the planner (coordinator/planner.h) sees them: the
// hsdp::UnitList a worker reports on join, taken from a sharded Engine, so
// tests and benchmarks plan the schedules production plans for their model.
#ifndef HSDP_WORKER_FSDP_PLANNER_UNITS_H_
#define HSDP_WORKER_FSDP_PLANNER_UNITS_H_

#include "common/units.h"
#include "hsdp/fully_shard.h"

namespace hsdp::fsdp {

// One entry per unit in unit order (index 0 "root"): the name, the parameter
// element count, and the bytes of the parameters in their storage (master)
// dtype, as the trainer reports them on join. Call after FullyShardRoot().
hsdp::UnitList PlannerUnits(const Engine& engine);

}  // namespace hsdp::fsdp

#endif  // HSDP_WORKER_FSDP_PLANNER_UNITS_H_
