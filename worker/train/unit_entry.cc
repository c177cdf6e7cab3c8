#include "worker/train/unit_entry.h"

#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace hsdp::train {

EngineShardContext::EngineShardContext(fsdp::Engine& engine,
                                       std::vector<bool> recompute)
    : engine_(engine), recompute_(std::move(recompute)) {}

int EngineShardContext::num_units() const { return engine_.num_units() - 1; }

fsdp::UnitHandle& EngineShardContext::Handle(int unit) {
  TORCH_CHECK(unit >= 0 && unit < num_units(), "ShardContext::Forward: unit ",
              unit, " is not in [0, ", num_units(), ")");
  return engine_.Unit(unit + 1);
}

at::Tensor EngineShardContext::Forward(int unit, const at::Tensor& input,
                                       const UnitFn& fn) {
  fsdp::UnitHandle& handle = Handle(unit);
  if (recompute_.at(static_cast<size_t>(unit)) && input.requires_grad()) {
    return fsdp::Recompute(
        engine_,
        [&handle, fn](const at::Tensor& x) { return handle.Forward(x, fn); },
        input);
  }
  return handle.Forward(input, fn);
}

std::vector<at::Tensor> EngineShardContext::Forward(
    int unit, const std::vector<at::Tensor>& inputs, const UnitTensorsFn& fn) {
  return Handle(unit).Forward(inputs, fn);
}

DirectShardContext::DirectShardContext(int num_units)
    : entered_(static_cast<size_t>(std::max(num_units, 0))) {
  for (int i = 0; i < num_units; ++i)
    names_.push_back(absl::StrCat("unit ", i));
}

DirectShardContext::DirectShardContext(const std::vector<UnitSpec>& units)
    : entered_(units.size()) {
  for (size_t i = 0; i < units.size(); ++i) {
    names_.push_back(units[i].name);
    for (const auto& module : units[i].modules) {
      if (module == nullptr) continue;
      for (const at::Tensor& p : module->parameters(/*recurse=*/true))
        owner_.emplace(p.unsafeGetTensorImpl(), static_cast<int>(i));
    }
  }
}

void DirectShardContext::BeginForward() {
  std::fill(entered_.begin(), entered_.end(), false);
  last_entered_ = -1;
}

void DirectShardContext::Enter(int unit) {
  TORCH_CHECK(unit >= 0 && unit < num_units(), "ShardContext::Forward: unit ",
              unit, " is not in [0, ", num_units(), ")");
  if (!entered_[unit] && unit < last_entered_) {
    // The words of the engine's refusal (a sharded run of the same task).
    misuse_ = absl::FailedPreconditionError(absl::StrCat(
        "unit ", names_[unit], " was entered after unit ",
        names_[last_entered_],
        ": a forward enters units in the order they were declared (a unit "
        "may be skipped, or entered again after it ran)"));
    TORCH_CHECK(false, misuse_.message());
  }
  entered_[unit] = true;
  last_entered_ = std::max(last_entered_, unit);
}

at::Tensor DirectShardContext::Forward(int unit, const at::Tensor& input,
                                       const UnitFn& fn) {
  Enter(unit);
  return fn(input);
}

std::vector<at::Tensor> DirectShardContext::Forward(
    int unit, const std::vector<at::Tensor>& inputs, const UnitTensorsFn& fn) {
  Enter(unit);
  return fn(inputs);
}

absl::Status DirectShardContext::CheckEntered(
    const std::vector<GradLeaf>& leaves) const {
  for (const GradLeaf& leaf : leaves) {
    auto it = owner_.find(leaf.tensor.unsafeGetTensorImpl());
    if (it == owner_.end() || entered_[it->second]) continue;
    return absl::FailedPreconditionError(absl::StrCat(
        "unit ", names_[it->second],
        "'s parameters were used outside its forward (autograd reaches them "
        "through ",
        leaf.used_by,
        ", but the forward never entered the unit): its module was called "
        "directly. Call a unit's module through its hsdp::train::Unit<> "
        "wrapper or ShardContext::Forward"));
  }
  return absl::OkStatus();
}

void UnitBindings::Bind(std::vector<std::shared_ptr<UnitBinding>> bindings,
                        ShardContext* context) {
  Clear();
  bindings_ = std::move(bindings);
  for (size_t i = 0; i < bindings_.size(); ++i) {
    if (bindings_[i] == nullptr) continue;
    bindings_[i]->context = context;
    bindings_[i]->index = static_cast<int>(i);
  }
}

void UnitBindings::Clear() {
  for (const auto& binding : bindings_) {
    if (binding != nullptr) *binding = UnitBinding();
  }
  bindings_.clear();
}

}  // namespace hsdp::train
