// Units entered by calling them: a module holder whose call runs the module
// inside its sharding unit, as FSDP2's fully_shard hooks make calling a module
// entering it.
//
//   class MyTask : public hsdp::train::Task {
//     absl::Status Build(const BuildContext& ctx) override {
//       for (int i = 0; i < 4; ++i)
//         blocks_.push_back(model_->register_module(
//             absl::StrCat("blocks_", i), std::make_shared<BlockImpl>(...)));
//       ...
//     }
//     absl::StatusOr<UnitSpec> BuildUnit(int i) override {
//       return blocks_[i].Spec(absl::StrCat("blocks.", i));
//     }
//     absl::StatusOr<at::Tensor> Loss(const Batch& batch) override {
//       at::Tensor x = stem_(batch.input);
//       for (auto& block : blocks_) x = block(x);  // enters the unit
//       return loss(head_(x), batch.target);
//     }
//     std::vector<hsdp::train::Unit<BlockImpl>> blocks_;
//   };
//
// `block(x, extra...)` calls `block->forward(x, extra...)`: in a sharded run
// inside its unit (gather, prefetch, reshard, activation recompute as the
// job says), in the reference and before the runner bound it directly. Only
// `x` is the unit's input: the extra arguments are captured by value and are
// not differentiated through the unit's recompute. `block->forward(x)`
// bypasses the unit: in a sharded run its parameters are not there, and the
// runner stops naming the likely unit; the reference stops too, naming it,
// when the forward never entered that unit.
//
// The runner binds the wrapper to its unit through the UnitSpec that Spec()
// returns: the spec from the last BuildUnit(i) call is the one bound, so a
// task that builds unit i inside BuildUnit(i) keeps that call's Unit.
//
// Thread-compatible, like the Task that owns it.
#ifndef HSDP_UNIT_H_
#define HSDP_UNIT_H_

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <utility>

#include "hsdp/task.h"

namespace hsdp::train {

template <typename ModuleImpl>
class Unit {
 public:
  // An empty wrapper (like a holder of nullptr); assign a module before use.
  Unit() : binding_(std::make_shared<UnitBinding>()) {}
  explicit Unit(std::shared_ptr<ModuleImpl> module)
      : module_(std::move(module)), binding_(std::make_shared<UnitBinding>()) {}

  ModuleImpl* operator->() const { return module_.get(); }
  ModuleImpl& operator*() const { return *module_; }
  const std::shared_ptr<ModuleImpl>& ptr() const { return module_; }
  bool is_empty() const { return module_ == nullptr; }

  // The unit as BuildUnit returns it: this module, under `name`.
  UnitSpec Spec(std::string name) const {
    UnitSpec spec;
    spec.name = std::move(name);
    spec.modules = {module_};
    spec.binding = binding_;
    return spec;
  }

  // module->forward(x, extra...), entering the unit once the runner bound it.
  template <typename... Extra>
  at::Tensor operator()(const at::Tensor& x, Extra... extra) const {
    std::shared_ptr<ModuleImpl> module = module_;
    UnitFn fn = [module, extra...](const at::Tensor& in) {
      return module->forward(in, extra...);
    };
    if (binding_->context == nullptr) return fn(x);
    return binding_->context->Forward(binding_->index, x, fn);
  }

 private:
  std::shared_ptr<ModuleImpl> module_;
  std::shared_ptr<UnitBinding> binding_;
};

}  // namespace hsdp::train

#endif  // HSDP_UNIT_H_
