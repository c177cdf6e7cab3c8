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
#include "worker/train/task.h"

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

// FAILED_PRECONDITION when autograd reaches, from `loss`, a leaf tensor that
// requires grad but is not a parameter of `model` (a submodule built but not
// registered, a tensor never passed to register_parameter): it would not be
// sharded, reduced or stepped. Call before backward.
absl::Status CheckLossGraph(const at::Tensor& loss,
                            const torch::nn::Module& model);

}  // namespace hsdp::train

#endif  // HSDP_WORKER_TRAIN_TASK_CHECKS_H_
