#include "worker/models/builtin_tasks.h"

#include <utility>

#include "worker/models/gpt_task.h"

namespace hsdp::models {

absl::StatusOr<std::unique_ptr<train::Task>> MakeBuiltinTask(
    const train::TaskArgs& args) {
  train::TaskArgs resolved = args;
  if (resolved.model.empty()) resolved.model = kDefaultModel;
  absl::StatusOr<std::unique_ptr<GptTask>> gpt = GptTask::Create(resolved);
  if (!gpt.ok()) return gpt.status();
  return std::unique_ptr<train::Task>(std::move(*gpt));
}

}  // namespace hsdp::models
