// moe-worker: an hsdp worker binary for the example mixture of experts. It
// takes every hsdp-worker flag (WorkerMain), so hsdp-launch runs it with
// --worker-binary, and --reference trains it unsharded in this process.
#include "hsdp/worker_main.h"
#include "moe_task.h"

int main(int argc, char** argv) {
  return hsdp::train::WorkerMain(
      argc, argv,
      [](const hsdp::train::TaskArgs& args)
          -> absl::StatusOr<std::unique_ptr<hsdp::train::Task>> {
        absl::StatusOr<std::unique_ptr<moe::MoeTask>> task =
            moe::MoeTask::Create(args);
        if (!task.ok()) return task.status();
        return std::unique_ptr<hsdp::train::Task>(std::move(*task));
      });
}
