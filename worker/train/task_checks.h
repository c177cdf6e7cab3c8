// Checks the runner makes of a Task once per run, so that the likeliest
// mistakes of a new task are refused in one line naming what is wrong, in
// sharded and reference runs alike, rather than training to other numbers.
// Stateless functions; thread-compatible.
#ifndef HSDP_WORKER_TRAIN_TASK_CHECKS_H_
#define HSDP_WORKER_TRAIN_TASK_CHECKS_H_

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "hsdp/task.h"

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace hsdp::train {

// INVALID_ARGUMENT when a non-empty unit glob given as `flag` matches none of
// `unit_names` (the task's units, root excluded), listing them.
absl::Status CheckUnitGlob(absl::string_view flag, const std::string& glob,
                           const std::vector<std::string>& unit_names);

// FAILED_PRECONDITION when GetBatch(request) gives other samples the second
// time than `first`: batches must be a pure function of the request, or the
// ranks and the reference train on different data.
absl::Status CheckDeterministicBatch(Task& task, const BatchRequest& request,
                                     const Batch& first);

// A leaf tensor that requires grad, reached by autograd from a loss, and the
// nearest autograd node above it that computes rather than only reshapes
// ("AddmmBackward0" for a Linear's weight, not its transpose).
struct GradLeaf {
  at::Tensor tensor;
  std::string used_by;
};

// Every leaf that requires grad which autograd reaches from `loss` (each
// once), without running backward. Nothing when `loss` has no grad_fn.
std::vector<GradLeaf> GradLeaves(const at::Tensor& loss);

// FAILED_PRECONDITION when one of `leaves` is not a parameter of `model` (a
// submodule built but not registered, a tensor never passed to
// register_parameter): it would not be sharded, reduced or stepped, and its
// initial value would come from torch's global generator.
absl::Status CheckRegistered(const std::vector<GradLeaf>& leaves,
                             const torch::nn::Module& model);

// CheckRegistered(GradLeaves(loss), model). Call before backward.
absl::Status CheckLossGraph(const at::Tensor& loss,
                            const torch::nn::Module& model);

}  // namespace hsdp::train

#endif  // HSDP_WORKER_TRAIN_TASK_CHECKS_H_
