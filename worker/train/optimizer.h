// The job's optimizer and learning-rate schedule over a list of parameters
// (this rank's shards, or the full parameters in the reference).
#ifndef HSDP_WORKER_TRAIN_OPTIMIZER_H_
#define HSDP_WORKER_TRAIN_OPTIMIZER_H_

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "hsdp/runner.h"
#include "hsdp/task.h"

namespace hsdp::train {

// AdamW or SGD (with momentum and weight decay) as `options` says.
std::unique_ptr<torch::optim::Optimizer> MakeJobOptimizer(
    const OptimizerOptions& options, const std::vector<at::Tensor>& params);

// The task's optimizer, else the job's.
std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(
    Task& task, const TrainingOptions& t,
    const std::vector<at::Tensor>& params);

// Bytes of `optimizer`'s per-parameter state tensors (AdamW's and Adam's
// moments, SGD's momentum buffers; 0 for an optimizer of another kind, and
// before its first step, which creates the state).
int64_t OptimizerStateBytes(const torch::optim::Optimizer& optimizer);

// Sets every parameter group's learning rate to the schedule's value for
// `step`.
void ApplyLearningRate(torch::optim::Optimizer& optimizer,
                       const TrainingOptions& options, int64_t step);

}  // namespace hsdp::train

#endif  // HSDP_WORKER_TRAIN_OPTIMIZER_H_
