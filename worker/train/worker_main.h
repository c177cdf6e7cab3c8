// A ready-made main() for worker binaries: parses the hsdp-worker command line
// (worker/README.md lists the flags), builds the task with `factory` and runs
// it under the coordinator, or unsharded with --reference.
//
//   int main(int argc, char** argv) {
//     return hsdp::train::WorkerMain(argc, argv, [](const TaskArgs& args) {
//       return MyTask::Create(args);
//     });
//   }
//
// Exit status: 0 on success, 1 on a runtime error (one line "NAME: reason" on
// stderr), 2 on a bad command line.
#ifndef HSDP_WORKER_TRAIN_WORKER_MAIN_H_
#define HSDP_WORKER_TRAIN_WORKER_MAIN_H_

#include "worker/train/task.h"

namespace hsdp::train {

int WorkerMain(int argc, char** argv, const TaskFactory& factory);

}  // namespace hsdp::train

#endif  // HSDP_WORKER_TRAIN_WORKER_MAIN_H_
