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
// A task with typed options (task_options.h) passes its TaskDefinition
// instead: --help then describes the task and lists its options beside the
// runner's flags, without the built-in GPT's (--model, --dims, --vocab-size,
// --data, --units), and an unknown or mistyped --task-option is a bad command
// line naming it.
//
//   int main(int argc, char** argv) {
//     return hsdp::train::WorkerMain(argc, argv, MyTask::Definition());
//   }
//
// Exit status: 0 on success, 1 on a runtime error (one line "NAME: reason" on
// stderr), 2 on a bad command line. It sets SIGPIPE to ignored for the
// process: a write to a peer that went away is then an error the run
// recovers from, not the death of this worker.
#ifndef HSDP_WORKER_MAIN_H_
#define HSDP_WORKER_MAIN_H_

#include "hsdp/task.h"
#include "hsdp/task_options.h"

namespace hsdp::train {

int WorkerMain(int argc, char** argv, const TaskFactory& factory);
int WorkerMain(int argc, char** argv, const TaskDefinition& definition);

}  // namespace hsdp::train

#endif  // HSDP_WORKER_MAIN_H_
