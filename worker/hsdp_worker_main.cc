// hsdp-worker: joins a coordinator and trains one of the built-in models (see
// worker/README.md). A user's own model gets its own binary with the same
// flags through hsdp::train::WorkerMain.
#include "hsdp/models/builtin_tasks.h"
#include "hsdp/worker_main.h"

int main(int argc, char** argv) {
  return hsdp::train::WorkerMain(argc, argv, hsdp::models::MakeBuiltinTask);
}
