#include "worker/train/optimizer.h"

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

void ApplyLearningRate(torch::optim::Optimizer& optimizer,
                       const TrainingOptions& options, int64_t step) {
  const double lr = options.lr_schedule.LearningRate(options.optimizer.lr, step,
                                                     options.steps);
  for (auto& group : optimizer.param_groups()) group.options().set_lr(lr);
}

}  // namespace hsdp::train
