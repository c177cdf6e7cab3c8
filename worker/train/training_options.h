// TrainingOptions (runner.h) as the coordinator sees them, and their checks.
// Torch-free.
#ifndef HSDP_WORKER_TRAIN_TRAINING_OPTIONS_H_
#define HSDP_WORKER_TRAIN_TRAINING_OPTIONS_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "hsdp/runner.h"
#include "hsdp/v1/common.pb.h"

namespace hsdp::train {

// "stop" or "skip-step" (--on-nonfinite).
const char* NonFiniteActionName(NonFiniteAction action);
// INVALID_ARGUMENT naming --on-nonfinite for anything else.
absl::StatusOr<NonFiniteAction> ParseNonFiniteAction(absl::string_view name);

// INVALID_ARGUMENT naming the flag for values no job can run with (e.g.
// "--param-dtype: 'fp16' is not fp32 or bf16").
absl::Status ValidateTrainingOptions(const TrainingOptions& options);

// What the worker reports when joining: every rank of a job must report the
// same.
hsdp::v1::TrainingSpec ToProto(const TrainingOptions& options,
                               const TaskArgs& task_args,
                               const std::string& task_name, int task_version);

// What the single-process reference multiplies its gradient (of the global
// batch's mean loss) by to equal a sharded run's over `world_size` ranks:
// 1 for "avg", world_size for "sum", world_size / grad_divide_factor.
double ReferenceGradScale(const TrainingOptions& options, int64_t world_size);

}  // namespace hsdp::train

#endif  // HSDP_WORKER_TRAIN_TRAINING_OPTIONS_H_
