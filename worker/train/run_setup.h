// Pieces the sharded run (elastic_loop.h) and the single-process reference
// (runner.cc) share: process set-up, the task's optimizer, one microbatch's
// batch and loss, and writing parameters.
//
// Thread-compatible: call on the training thread.
#ifndef HSDP_WORKER_TRAIN_RUN_SETUP_H_
#define HSDP_WORKER_TRAIN_RUN_SETUP_H_

#include <torch/optim/optimizer.h>

#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/fsdp/fully_shard.h"
#include "worker/train/runner.h"
#include "worker/train/task.h"

namespace hsdp::train {

double SecondsSince(std::chrono::steady_clock::time_point start);

// Intra-op threads for LibTorch and OpenBLAS (0: leave the defaults).
void SetThreads(int threads);

fsdp::EngineOptions EngineOptionsFor(const TrainingOptions& t,
                                     const c10::Device& device);

// Per task unit (units[1..]): recompute on, from the --recompute-units glob.
std::vector<bool> RecomputeFlags(const std::string& glob,
                                 const std::vector<fsdp::UnitInfo>& units);

// The task's optimizer, else the job's.
std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(
    Task& task, const TrainingOptions& t,
    const std::vector<at::Tensor>& params);

// Loss() of one microbatch, checked: a scalar that requires grad.
absl::StatusOr<at::Tensor> MicrobatchLoss(Task& task, const Batch& batch);

// GetBatch(request), checked, moved to `device`.
absl::StatusOr<Batch> MicrobatchBatch(Task& task, const BatchRequest& request,
                                      const c10::Device& device);

// The one line a step with a non-finite loss gets: the step, the loss, the
// first rank with such a microbatch and its first one (0-based within the
// step), and `count`, the step's non-finite microbatches over every rank.
std::string NonFiniteLossMessage(int64_t step, double loss, int rank,
                                 int microbatch, int64_t count);
// The same for a non-finite global gradient norm (clipping to `max_norm`)
// after finite losses.
std::string NonFiniteNormMessage(int64_t step, double norm, double max_norm);
// `message` and what the run does about it under `action`.
std::string WithNonFiniteAction(const std::string& message,
                                NonFiniteAction action);

// A LibTorch archive of named tensors (on the CPU).
absl::Status SaveParams(
    const std::vector<std::pair<std::string, at::Tensor>>& params,
    const std::string& path);

}  // namespace hsdp::train

#endif  // HSDP_WORKER_TRAIN_RUN_SETUP_H_
