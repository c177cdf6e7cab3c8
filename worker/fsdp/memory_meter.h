// Measured memory of a rank: what the worker reports as its step's peak and
// its activations (StepReport.peak_memory_bytes / activation_bytes), which the
// memory-budget planner corrects its model with.
//
// CUDA: the caching allocator's own statistics (allocated bytes, current and
// peak since the last reset), compiled in with HSDP_WITH_CUDA.
//
// CPU: a counting allocator, not the engine's accounting. The engine can only
// add up what it owns (shards, unsharded parameters and gradients, its
// communication buffers); the optimizer's state, the activations autograd
// saves, the temporaries of backward and the input batch are invisible to it,
// so a peak built from its accounting is a model, not a measurement, and a
// planner corrected by it would learn nothing about its blind spots. The
// counting allocator replaces LibTorch's CPU allocator (same aligned
// allocation, c10::alloc_cpu) and counts every byte any tensor of this process
// holds, at the cost of a 64-byte header per allocation. It drops the default
// allocator's profiler reports (LibTorch's memory profiler sees no CPU
// allocations while it is installed). Limits: it counts only allocations made
// after it was installed (install it before the model is built), and not memory
// outside LibTorch's allocator (Gloo's and the shared-memory transport's own
// buffers, which are fixed per communicator). Where it is not installed the
// engine's accounting (EngineStats::peak_memory) stands in.
//
// Counts are per process — one rank per process in production. Ranks run as
// threads (tests, benchmarks) count apart with a ScopedMemoryTally per rank
// thread: an allocation is charged to the tally of the thread that made it,
// and its release to the same tally whatever thread frees it.
//
// Thread-safety: everything here is thread-safe.
#ifndef HSDP_WORKER_FSDP_MEMORY_METER_H_
#define HSDP_WORKER_FSDP_MEMORY_METER_H_

#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <optional>

#include "hsdp/fully_shard.h"

namespace hsdp::fsdp {

// Replaces LibTorch's CPU allocator by the counting one (idempotent). Call
// once, early: before the model's tensors are created. Also makes glibc's
// malloc keep freed memory in the process (no trim, blocks up to 32 MiB from
// the heap rather than mmap), so each step reuses the previous step's pages
// instead of faulting them in again; RSS stays at its peak.
void InstallCountingCpuAllocator();
bool CountingCpuAllocatorInstalled();

class MemoryTally;

// While alive, CPU allocations of the constructing thread are counted in a
// tally of their own (one per rank thread). Not movable; destroy it on the
// thread that made it.
class ScopedMemoryTally {
 public:
  ScopedMemoryTally();
  ~ScopedMemoryTally();
  ScopedMemoryTally(const ScopedMemoryTally&) = delete;
  ScopedMemoryTally& operator=(const ScopedMemoryTally&) = delete;

 private:
  std::shared_ptr<MemoryTally> previous_;
};

// Bytes allocated on `device` now, and the peak since the last
// ResetMeterPeak(device), as the calling thread's meter sees them (CPU: its
// tally; CUDA: the device). nullopt where nothing measures (CPU without the
// counting allocator, CUDA without HSDP_WITH_CUDA).
std::optional<int64_t> MeterCurrentBytes(const c10::Device& device);
std::optional<int64_t> MeterPeakBytes(const c10::Device& device);
void ResetMeterPeak(const c10::Device& device);

// What the worker reports as its step's peak: the meter's peak since
// Engine::ResetStats (EngineStats::measured_peak_bytes) where there is one,
// else the engine's accounting (EngineStats::peak_memory.Total()).
int64_t MeasuredPeakBytes(const EngineStats& stats);

}  // namespace hsdp::fsdp

#endif  // HSDP_WORKER_FSDP_MEMORY_METER_H_
