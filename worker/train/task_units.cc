#include "worker/train/task_units.h"

#include <torch/nn/module.h>

#include <set>
#include <unordered_map>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "common/status_util.h"

namespace hsdp::train {
namespace {

constexpr char kRootUnitName[] = "root";

absl::Status CheckUnitSpec(const UnitSpec& spec, int index,
                           std::set<std::string>& names) {
  if (spec.name.empty() || spec.name == kRootUnitName) {
    return absl::InvalidArgumentError(
        absl::StrCat("Task::BuildUnit(", index, ") named its unit '", spec.name,
                     "'; a unit needs a name other than 'root'"));
  }
  if (!names.insert(spec.name).second) {
    return absl::InvalidArgumentError(absl::StrCat("Task::BuildUnit(", index,
                                                   "): unit name '", spec.name,
                                                   "' is used twice"));
  }
  if (spec.modules.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Task::BuildUnit(", index, "): unit '", spec.name, "' has no modules"));
  }
  for (const auto& m : spec.modules) {
    if (m == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("Task::BuildUnit(", index,
                                                     "): unit '", spec.name,
                                                     "' has a null module"));
    }
  }
  return absl::OkStatus();
}

// The unit's parameters with their names under `root`, in the order the
// engine shards them: module by module, each tensor once, named as
// root.named_parameters() first names it.
std::vector<std::pair<std::string, at::Tensor>> UnitParameters(
    const torch::nn::Module& root, const UnitSpec& spec) {
  std::unordered_map<const c10::TensorImpl*, std::string> names;
  for (const auto& [name, t] : UniqueNamedParameters(root))
    names.emplace(t.unsafeGetTensorImpl(), name);
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& m : spec.modules) {
    for (const at::Tensor& t : m->parameters(/*recurse=*/true)) {
      const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
      auto it = names.find(impl);
      if (it != names.end() && seen.insert(impl).second)
        out.emplace_back(it->second, t);
    }
  }
  return out;
}

bool SameUnit(const fsdp::UnitLayout& a, const fsdp::UnitLayout& b) {
  return a.name == b.name && a.numel == b.numel && a.bytes == b.bytes &&
         a.replicated_bytes == b.replicated_bytes &&
         a.param_names == b.param_names;
}

// Task::Placement as the engine asks for it.
fsdp::PlacementFn PlacementOf(const Task& task) {
  return [&task](const std::string& fqn, const at::Tensor& param) {
    return task.Placement(fqn, param);
  };
}

}  // namespace

std::vector<std::pair<std::string, at::Tensor>> UniqueNamedParameters(
    const torch::nn::Module& module) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    if (seen.insert(item.value().unsafeGetTensorImpl()).second)
      out.emplace_back(item.key(), item.value());
  }
  return out;
}

absl::StatusOr<std::vector<fsdp::UnitLayout>> DescribeTaskUnits(
    Task& task, const fsdp::EngineOptions& options) {
  std::shared_ptr<torch::nn::Module> root = task.Model();
  if (root == nullptr) {
    return absl::InvalidArgumentError("Task::Model() returned null");
  }
  std::vector<fsdp::UnitLayout> units;
  std::set<std::string> unit_names;
  std::set<std::string> claimed;
  for (int i = 0; i < task.NumUnits(); ++i) {
    HSDP_ASSIGN_OR_RETURN(UnitSpec spec, task.BuildUnit(i));
    HSDP_RETURN_IF_ERROR(CheckUnitSpec(spec, i, unit_names));
    std::vector<std::pair<std::string, at::Tensor>> params =
        UnitParameters(*root, spec);
    for (const auto& [name, t] : params) claimed.insert(name);
    units.push_back(fsdp::DescribeUnit(spec.name, params, options,
                                       /*shard_size=*/1, PlacementOf(task)));
    task.ReleaseUnit(i);
  }
  std::vector<std::pair<std::string, at::Tensor>> root_params;
  for (auto& [name, t] : UniqueNamedParameters(*root)) {
    if (!claimed.count(name)) root_params.emplace_back(name, t);
  }
  units.insert(units.begin(),
               fsdp::DescribeUnit(kRootUnitName, root_params, options,
                                  /*shard_size=*/1, PlacementOf(task)));
  return units;
}

absl::StatusOr<std::unique_ptr<fsdp::Engine>> ShardTask(
    Task& task, fsdp::MeshComms comms, const fsdp::EngineOptions& options,
    const std::vector<fsdp::UnitLayout>& described,
    std::vector<std::shared_ptr<UnitBinding>>* bindings) {
  if (bindings != nullptr) bindings->clear();
  std::shared_ptr<torch::nn::Module> root = task.Model();
  root->to(options.device);
  HSDP_ASSIGN_OR_RETURN(std::unique_ptr<fsdp::Engine> engine,
                        fsdp::Engine::Create(root, comms, options));
  std::set<std::string> unit_names;
  for (int i = 0; i < task.NumUnits(); ++i) {
    HSDP_ASSIGN_OR_RETURN(UnitSpec spec, task.BuildUnit(i));
    HSDP_RETURN_IF_ERROR(CheckUnitSpec(spec, i, unit_names));
    for (const auto& m : spec.modules) m->to(options.device);
    if (bindings != nullptr) bindings->push_back(spec.binding);
    fsdp::UnitOptions unit_options;
    unit_options.unshard_in_backward = spec.unshard_in_backward;
    unit_options.placement = PlacementOf(task);
    HSDP_RETURN_IF_ERROR(
        engine->FullyShard(spec.modules, spec.name, unit_options).status());
  }
  fsdp::UnitOptions root_options;
  root_options.placement = PlacementOf(task);
  HSDP_RETURN_IF_ERROR(engine->FullyShardRoot(root_options));
  const std::vector<fsdp::UnitLayout> built = engine->Units();
  bool same = built.size() == described.size();
  for (size_t i = 0; same && i < built.size(); ++i)
    same = SameUnit(built[i], described[i]);
  if (!same) {
    return absl::InternalError(
        "the task built different units when sharding than when describing "
        "them: BuildUnit(i) must give the same modules every time");
  }
  return engine;
}

absl::Status BuildAllUnits(Task& task, const c10::Device& device,
                           std::vector<UnitSpec>* units) {
  if (units != nullptr) units->clear();
  std::set<std::string> unit_names;
  for (int i = 0; i < task.NumUnits(); ++i) {
    HSDP_ASSIGN_OR_RETURN(UnitSpec spec, task.BuildUnit(i));
    HSDP_RETURN_IF_ERROR(CheckUnitSpec(spec, i, unit_names));
    if (units != nullptr) units->push_back(std::move(spec));
  }
  task.Model()->to(device);
  return absl::OkStatus();
}

}  // namespace hsdp::train
