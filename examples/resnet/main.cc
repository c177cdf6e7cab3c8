// resnet-worker: an hsdp worker binary for the example ResNet. It takes the
// runner's flags (WorkerMain) and the task's typed options, so hsdp-launch runs
// it with --worker-binary, and --reference trains it unsharded in this process.
#include "hsdp/worker_main.h"
#include "resnet_task.h"

int main(int argc, char** argv) {
  return hsdp::train::WorkerMain(argc, argv, resnet::ResNetTask::Definition());
}
