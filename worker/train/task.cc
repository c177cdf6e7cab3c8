#include "hsdp/task.h"

#include <torch/optim/optimizer.h>

namespace hsdp::train {

std::unique_ptr<torch::optim::Optimizer> Task::MakeOptimizer(
    const std::vector<at::Tensor>& /*params*/) {
  return nullptr;
}

}  // namespace hsdp::train
