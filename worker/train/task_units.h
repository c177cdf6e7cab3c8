// Building a Task's units: describing them before joining (what the worker
// reports) and sharding them one at a time through the engine.
#ifndef HSDP_WORKER_TRAIN_TASK_UNITS_H_
#define HSDP_WORKER_TRAIN_TASK_UNITS_H_

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "hsdp/fully_shard.h"
#include "hsdp/task.h"

namespace hsdp::train {

// The parameters of `module`, each tensor once (a tied parameter under its
// first name), in registration order.
std::vector<std::pair<std::string, at::Tensor>> UniqueNamedParameters(
    const torch::nn::Module& module);

// The job's unit list as the engine will build it: root first, then the
// task's units. Builds each unit, describes it (fsdp::DescribeUnit) and
// releases it, so only one unit's full parameters exist at a time.
absl::StatusOr<std::vector<fsdp::UnitLayout>> DescribeTaskUnits(
    Task& task, const fsdp::EngineOptions& options);

// Creates the engine over task.Model(), then builds, moves to `options.device`
// and shards each unit as soon as it exists, then the root. INTERNAL when the
// result differs from `described` (the task built different units the second
// time).
// `bindings` (optional) gets each unit's UnitSpec::binding (null where the
// task gave none), for UnitBindings::Bind.
absl::StatusOr<std::unique_ptr<fsdp::Engine>> ShardTask(
    Task& task, fsdp::MeshComms comms, const fsdp::EngineOptions& options,
    const std::vector<fsdp::UnitLayout>& described,
    std::vector<std::shared_ptr<UnitBinding>>* bindings = nullptr);

// Builds every unit (nothing sharded) and moves the model to `device`: the
// reference's model. `units` (optional) gets what BuildUnit returned.
absl::Status BuildAllUnits(Task& task, const c10::Device& device,
                           std::vector<UnitSpec>* units = nullptr);

}  // namespace hsdp::train

#endif  // HSDP_WORKER_TRAIN_TASK_UNITS_H_
