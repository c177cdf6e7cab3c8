#include "worker/train/microbatch.h"

#include "absl/strings/str_cat.h"
#include "common/status_util.h"

namespace hsdp::train {

// Loss() of one microbatch, checked: a scalar that requires grad.
absl::StatusOr<at::Tensor> MicrobatchLoss(Task& task, const Batch& batch) {
  HSDP_ASSIGN_OR_RETURN(at::Tensor loss, task.Loss(batch));
  if (!loss.defined() || loss.numel() != 1 || !loss.requires_grad()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Task::Loss returned ",
        loss.defined()
            ? absl::StrCat(
                  "a tensor of shape ", c10::str(loss.sizes()),
                  loss.requires_grad() ? "" : " that does not require grad")
            : std::string("an undefined tensor"),
        "; it must return the microbatch's mean loss, a scalar that requires "
        "grad"));
  }
  return loss.reshape({});
}

absl::StatusOr<Batch> MicrobatchBatch(Task& task, const BatchRequest& request,
                                      const c10::Device& device) {
  HSDP_ASSIGN_OR_RETURN(Batch batch, task.GetBatch(request));
  if (!batch.input.defined()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Task::GetBatch(step ", request.step, ", samples ",
        request.first_sample, "..", request.first_sample + request.sample_count,
        ") returned no input"));
  }
  batch.input = batch.input.to(device);
  if (batch.target.defined()) batch.target = batch.target.to(device);
  return batch;
}

std::string NonFiniteLossMessage(int64_t step, double loss, int rank,
                                 int microbatch, int64_t count) {
  std::string message =
      absl::StrCat("step ", step, ": the loss is ", loss, " on rank ", rank,
                   ", microbatch ", microbatch);
  if (count > 1) {
    absl::StrAppend(&message, " (", count,
                    " non-finite microbatches in the step)");
  }
  return message;
}

std::string NonFiniteNormMessage(int64_t step, double norm, double max_norm) {
  return absl::StrCat("step ", step, ": the global gradient norm is ", norm,
                      " (clipping to ", max_norm,
                      "; every microbatch's loss is finite)");
}

std::string WithNonFiniteAction(const std::string& message,
                                NonFiniteAction action) {
  return action == NonFiniteAction::kSkipStep
             ? absl::StrCat(message,
                            "; the step is skipped (--on-nonfinite skip-step)")
             : absl::StrCat(message,
                            "; stopping (--on-nonfinite skip-step would skip "
                            "the step instead)");
}

}  // namespace hsdp::train
