#include "worker/train/shard_context.h"

#include <c10/util/Exception.h>

#include <utility>

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
    int unit, const std::vector<at::Tensor>& inputs, const UnitListFn& fn) {
  return Handle(unit).Forward(inputs, fn);
}

void DirectShardContext::Check(int unit) const {
  TORCH_CHECK(unit >= 0 && unit < num_units_, "ShardContext::Forward: unit ",
              unit, " is not in [0, ", num_units_, ")");
}

at::Tensor DirectShardContext::Forward(int unit, const at::Tensor& input,
                                       const UnitFn& fn) {
  Check(unit);
  return fn(input);
}

std::vector<at::Tensor> DirectShardContext::Forward(
    int unit, const std::vector<at::Tensor>& inputs, const UnitListFn& fn) {
  Check(unit);
  return fn(inputs);
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
