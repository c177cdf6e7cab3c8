// One microbatch of a run, sharded or reference: its batch and loss from the
// task, checked, and the words a step with a non-finite loss or gradient norm
// gets (the same in both, so a run and its reference stop alike).
//
// Stateless functions; call on the training thread.
#ifndef HSDP_WORKER_TRAIN_MICROBATCH_H_
#define HSDP_WORKER_TRAIN_MICROBATCH_H_

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "hsdp/runner.h"
#include "hsdp/task.h"

namespace hsdp::train {

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

}  // namespace hsdp::train

#endif  // HSDP_WORKER_TRAIN_MICROBATCH_H_
