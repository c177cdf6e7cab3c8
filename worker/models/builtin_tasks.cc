#include "hsdp/models/builtin_tasks.h"

#include <utility>

#include "absl/strings/match.h"
#include "hsdp/models/gpt_task.h"
#include "worker/models/torchscript_task.h"

namespace hsdp::models {

absl::StatusOr<std::unique_ptr<train::Task>> MakeBuiltinTask(
    const train::TaskArgs& args) {
  train::TaskArgs resolved = args;
  if (resolved.model.empty()) resolved.model = kDefaultModel;
  if (absl::StartsWith(resolved.model, kTorchScriptModelPrefix)) {
    absl::StatusOr<std::unique_ptr<TorchScriptTask>> scripted =
        TorchScriptTask::Create(resolved);
    if (!scripted.ok()) return scripted.status();
    return std::unique_ptr<train::Task>(std::move(*scripted));
  }
  absl::StatusOr<std::unique_ptr<GptTask>> gpt = GptTask::Create(resolved);
  if (!gpt.ok()) return gpt.status();
  return std::unique_ptr<train::Task>(std::move(*gpt));
}

}  // namespace hsdp::models
