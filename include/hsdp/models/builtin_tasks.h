// The tasks hsdp-worker knows by name: gpt-tiny, gpt-small, gpt-medium, gpt-1b,
// gpt-custom (--dims) and torchscript:PATH (a scripted model, see
// torchscript_task.h). NOT_FOUND naming the known models for anything else.
#ifndef HSDP_MODELS_BUILTIN_TASKS_H_
#define HSDP_MODELS_BUILTIN_TASKS_H_

#include <memory>

#include "absl/status/statusor.h"
#include "hsdp/task.h"

namespace hsdp::models {

// Default --model when none is given.
inline constexpr char kDefaultModel[] = "gpt-tiny";

absl::StatusOr<std::unique_ptr<train::Task>> MakeBuiltinTask(
    const train::TaskArgs& args);

}  // namespace hsdp::models

#endif  // HSDP_MODELS_BUILTIN_TASKS_H_
