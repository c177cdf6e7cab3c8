// A run's set-up from its options, shared by the sharded run (elastic_loop.h)
// and the single-process reference (runner.cc): the process's threads, the
// engine's options and which units recompute; and the runs' step timer.
//
// Thread-compatible: call on the training thread.
#ifndef HSDP_WORKER_TRAIN_RUN_SETUP_H_
#define HSDP_WORKER_TRAIN_RUN_SETUP_H_

#include <c10/core/Device.h>

#include <chrono>
#include <string>
#include <vector>

#include "hsdp/fully_shard.h"
#include "hsdp/runner.h"

namespace hsdp::train {

// Wall-clock seconds since `start`.
double SecondsSince(std::chrono::steady_clock::time_point start);

// Intra-op threads for LibTorch and OpenBLAS (0: leave the defaults).
void SetThreads(int threads);

fsdp::EngineOptions EngineOptionsFor(const TrainingOptions& t,
                                     const c10::Device& device);

// Per task unit (units[1..]): recompute on, from the --recompute-units glob.
std::vector<bool> RecomputeFlags(const std::string& glob,
                                 const std::vector<fsdp::UnitLayout>& units);

}  // namespace hsdp::train

#endif  // HSDP_WORKER_TRAIN_RUN_SETUP_H_
