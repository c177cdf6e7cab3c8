#include "worker/train/optimizer.h"

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <tuple>

namespace hsdp::train {

std::unique_ptr<torch::optim::Optimizer> MakeJobOptimizer(
    const OptimizerOptions& o, const std::vector<at::Tensor>& params) {
  if (o.kind == OptimizerKind::kSgd) {
    return std::make_unique<torch::optim::SGD>(
        params, torch::optim::SGDOptions(o.lr)
                    .momentum(o.momentum)
                    .weight_decay(o.EffectiveWeightDecay()));
  }
  return std::make_unique<torch::optim::AdamW>(
      params, torch::optim::AdamWOptions(o.lr)
                  .betas(std::make_tuple(o.beta1, o.beta2))
                  .eps(o.eps)
                  .weight_decay(o.EffectiveWeightDecay()));
}

std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(
    Task& task, const TrainingOptions& t,
    const std::vector<at::Tensor>& params) {
  std::unique_ptr<torch::optim::Optimizer> opt = task.MakeOptimizer(params);
  if (opt == nullptr) opt = MakeJobOptimizer(t.optimizer, params);
  return opt;
}

int64_t OptimizerStateBytes(const torch::optim::Optimizer& optimizer) {
  auto bytes = [](const at::Tensor& t) {
    return t.defined() ? static_cast<int64_t>(t.nbytes()) : int64_t{0};
  };
  int64_t total = 0;
  for (const auto& [key, state] : optimizer.state()) {
    if (const auto* s =
            dynamic_cast<const torch::optim::AdamWParamState*>(state.get())) {
      total += bytes(s->exp_avg()) + bytes(s->exp_avg_sq()) +
               bytes(s->max_exp_avg_sq());
    } else if (const auto* s =
                   dynamic_cast<const torch::optim::AdamParamState*>(
                       state.get())) {
      total += bytes(s->exp_avg()) + bytes(s->exp_avg_sq()) +
               bytes(s->max_exp_avg_sq());
    } else if (const auto* s = dynamic_cast<const torch::optim::SGDParamState*>(
                   state.get())) {
      total += bytes(s->momentum_buffer());
    }
  }
  return total;
}

void ApplyLearningRate(torch::optim::Optimizer& optimizer,
                       const TrainingOptions& options, int64_t step) {
  const double lr = options.lr_schedule.LearningRate(options.optimizer.lr, step,
                                                     options.steps);
  for (auto& group : optimizer.param_groups()) group.options().set_lr(lr);
}

}  // namespace hsdp::train
