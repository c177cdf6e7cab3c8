#include "worker/fsdp/hooks.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>

#include <utility>

#include "worker/fsdp/engine_core.h"
#include "worker/fsdp/unit_group.h"

namespace hsdp::fsdp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Non-tensor state travels through saved_data as an int64 (the pointers outlive
// the graph: the Engine owns them and must outlive every backward over its
// units).
template <typename T>
int64_t PtrToInt(T* ptr) {
  return reinterpret_cast<int64_t>(ptr);
}
template <typename T>
T* IntToPtr(const c10::IValue& value) {
  return reinterpret_cast<T*>(value.toInt());
}

// An identity on `tensors` whose backward runs `Hook` on the unit first: the
// pre-backward (on a unit's outputs) and post-backward (on its inputs) hooks.
template <void (UnitGroup::*Hook)()>
struct UnitHookFunction
    : public torch::autograd::Function<UnitHookFunction<Hook>> {
  static variable_list forward(AutogradContext* ctx, UnitGroup* unit,
                               at::TensorList tensors) {
    ctx->saved_data["unit"] = PtrToInt(unit);
    return tensors.vec();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    (IntToPtr<UnitGroup>(ctx->saved_data["unit"])->*Hook)();
    variable_list out;
    out.reserve(grads.size() + 1);
    out.emplace_back();  // the UnitGroup* argument
    for (auto& g : grads) out.push_back(std::move(g));
    return out;
  }
};
using PreBackwardFunction = UnitHookFunction<&UnitGroup::PreBackward>;
using PostBackwardFunction = UnitHookFunction<&UnitGroup::PostBackward>;

// Activation recompute: runs its body without grad and reruns it in
// backward.
struct RecomputeFunction : public torch::autograd::Function<RecomputeFunction> {
  static variable_list forward(AutogradContext* ctx, EngineCore* core,
                               int64_t fn_id, const at::Tensor& input) {
    ctx->saved_data["core"] = PtrToInt(core);
    ctx->saved_data["fn"] = fn_id;
    ctx->save_for_backward({input});
    // Runs with grad disabled (custom Function forward): no activations are
    // kept.
    return {core->recompute_fns.at(fn_id)(input)};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    EngineCore* core = IntToPtr<EngineCore>(ctx->saved_data["core"]);
    const int64_t fn_id = ctx->saved_data["fn"].toInt();
    auto it = core->recompute_fns.find(fn_id);
    TORCH_CHECK(it != core->recompute_fns.end(),
                "recompute: backward ran twice");
    const TensorFn fn = std::move(it->second);
    core->recompute_fns.erase(it);
    const at::Tensor saved = ctx->get_saved_variables()[0];
    at::Tensor input = saved.detach();
    input.set_requires_grad(saved.requires_grad());
    at::Tensor output;
    {
      at::AutoGradMode enable_grad(true);
      ++core->recompute_depth;
      try {
        output = fn(input);
      } catch (...) {
        --core->recompute_depth;
        throw;
      }
      --core->recompute_depth;
    }
    // Reentrant backward: accumulates the parameters' grads and fires the
    // units' hooks.
    if (output.requires_grad()) torch::autograd::backward({output}, {grads[0]});
    return {at::Tensor(), at::Tensor(),
            input.requires_grad() ? input.grad() : at::Tensor()};
  }
};

// Applies `Fn` to the subset of `tensors` that requires grad.
template <typename Fn>
std::vector<at::Tensor> ApplyToGradTensors(UnitGroup* unit,
                                           std::vector<at::Tensor> tensors) {
  if (!at::GradMode::is_enabled()) return tensors;
  variable_list selected;
  std::vector<size_t> where;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].defined() && tensors[i].requires_grad()) {
      selected.push_back(tensors[i]);
      where.push_back(i);
    }
  }
  if (selected.empty()) return tensors;
  // TensorList (not std::vector) so the autograd Function sees them as inputs.
  variable_list wrapped = Fn::apply(unit, at::TensorList(selected));
  for (size_t k = 0; k < where.size(); ++k) tensors[where[k]] = wrapped[k];
  return tensors;
}

}  // namespace

std::vector<at::Tensor> AttachPreBackward(UnitGroup* unit,
                                          std::vector<at::Tensor> outputs) {
  return ApplyToGradTensors<PreBackwardFunction>(unit, std::move(outputs));
}

std::vector<at::Tensor> AttachPostBackward(UnitGroup* unit,
                                           std::vector<at::Tensor> inputs) {
  return ApplyToGradTensors<PostBackwardFunction>(unit, std::move(inputs));
}

void QueueEndOfBackwardCallback(EngineCore* core) {
  torch::autograd::Engine::get_default_engine().queue_callback(
      [core] { core->EndOfBackward(); });
}

at::Tensor RecomputeApply(EngineCore* core, const TensorFn& fn,
                          const at::Tensor& input) {
  if (!at::GradMode::is_enabled()) return fn(input);
  const int64_t id = core->next_recompute_id++;
  core->recompute_fns[id] = fn;
  return RecomputeFunction::apply(core, id, input)[0];
}

}  // namespace hsdp::fsdp
