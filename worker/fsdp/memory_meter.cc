#include "worker/fsdp/memory_meter.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <malloc.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <new>
#include <utility>

#ifdef HSDP_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace hsdp::fsdp {

// Current and peak bytes of one process or rank thread. Thread-safe.
class MemoryTally {
 public:
  void Add(int64_t bytes) {
    const int64_t now = current_.fetch_add(bytes) + bytes;
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
  }
  void Sub(int64_t bytes) { current_.fetch_sub(bytes); }
  void ResetPeak() { peak_.store(current_.load()); }
  int64_t current() const { return current_.load(); }
  int64_t peak() const { return peak_.load(); }

 private:
  std::atomic<int64_t> current_{0};
  std::atomic<int64_t> peak_{0};
};

namespace {

// glibc's malloc, left alone, hands the freed tail of its heaps back to the
// kernel (trim) and serves blocks above a threshold with mmap/munmap, so a
// training step's activations, gradients and gathered parameters, freed at
// the step's end, fault in again page by page in the next step: 17k page
// faults per rank per step on gpt-small (about a tenth of the rank's CPU
// time, measured with perf). Every step allocates the same sizes, so the
// process keeps what it freed instead: blocks up to kMmapThresholdBytes come
// from the heap (glibc's cap: half its 64 MiB per-thread heap), and the heap
// is never trimmed. Steady-state RSS then equals the peak, which the step
// reaches anyway.
constexpr int kMmapThresholdBytes = 32 << 20;
constexpr int kNeverTrim = -1;

// Above LibTorch's own registration (priority 0), so ours wins.
constexpr uint8_t kCountingAllocatorPriority = 100;
#ifdef HSDP_WITH_CUDA
// StatType::AGGREGATE, index 0 in every LibTorch version (the enum moved
// namespaces in 2.x, the index did not).
constexpr size_t kAggregatePool = 0;
#endif

const std::shared_ptr<MemoryTally>& ProcessTally() {
  static const auto* tally =
      new std::shared_ptr<MemoryTally>(std::make_shared<MemoryTally>());
  return *tally;
}

thread_local std::shared_ptr<MemoryTally> t_thread_tally;

std::shared_ptr<MemoryTally> CurrentTally() {
  return t_thread_tally != nullptr ? t_thread_tally : ProcessTally();
}

// Every counted allocation starts with this header, kHeaderBytes before the
// pointer handed out, so the pointer is its own context and LibTorch's raw
// allocate/deallocate interface (used by some kernels' workspaces) works.
struct AllocationHeader {
  std::shared_ptr<MemoryTally> tally;
  int64_t bytes = 0;
};
// alloc_cpu aligns to 64 bytes; a 64-byte header keeps the data aligned so.
constexpr size_t kHeaderBytes = 64;
static_assert(sizeof(AllocationHeader) <= kHeaderBytes);

void DeleteCounted(void* data) {
  if (data == nullptr) return;
  char* base = static_cast<char*>(data) - kHeaderBytes;
  auto* header = reinterpret_cast<AllocationHeader*>(base);
  header->tally->Sub(header->bytes);
  header->~AllocationHeader();
  c10::free_cpu(base);
}

// LibTorch's CPU allocation (c10::alloc_cpu) with a header that charges the
// bytes to the allocating thread's tally. `allocate` is declared both const
// (the LibTorch 1.x virtual) and non-const (2.x), and copy_data (pure in 2.x)
// is provided, so one class compiles against both; none is marked override
// for the same reason (clang's -Winconsistent-missing-override, on in its
// -Wall, is silenced for this class only).
#if defined(__clang__)
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Winconsistent-missing-override"
#endif
class CountingAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) const { return Allocate(n); }
  c10::DataPtr allocate(size_t n) { return Allocate(n); }
  c10::DeleterFnPtr raw_deleter() const override { return &DeleteCounted; }
  void copy_data(void* dest, const void* src, std::size_t count) const {
    std::memcpy(dest, src, count);
  }

 private:
  static c10::DataPtr Allocate(size_t n) {
    const c10::Device cpu(c10::kCPU);
    if (n == 0) return c10::DataPtr(nullptr, nullptr, &DeleteCounted, cpu);
    char* base = static_cast<char*>(c10::alloc_cpu(n + kHeaderBytes));
    std::shared_ptr<MemoryTally> tally = CurrentTally();
    tally->Add(static_cast<int64_t>(n));
    new (base) AllocationHeader{std::move(tally), static_cast<int64_t>(n)};
    void* data = base + kHeaderBytes;
    return c10::DataPtr(data, data, &DeleteCounted, cpu);
  }
};
#if defined(__clang__)
#pragma clang diagnostic pop
#endif

std::atomic<bool> g_installed{false};

#ifdef HSDP_WITH_CUDA
c10::DeviceIndex CudaIndex(const c10::Device& device) {
  return device.has_index() ? device.index() : c10::cuda::current_device();
}
#endif

}  // namespace

void InstallCountingCpuAllocator() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Never destroyed: allocations may outlive every static destructor.
    mallopt(M_MMAP_THRESHOLD, kMmapThresholdBytes);
    mallopt(M_TRIM_THRESHOLD, kNeverTrim);
    static auto* allocator = new CountingAllocator();
    c10::SetCPUAllocator(allocator, kCountingAllocatorPriority);
    g_installed.store(true);
  });
}

bool CountingCpuAllocatorInstalled() { return g_installed.load(); }

ScopedMemoryTally::ScopedMemoryTally()
    : previous_(
          std::exchange(t_thread_tally, std::make_shared<MemoryTally>())) {}

ScopedMemoryTally::~ScopedMemoryTally() {
  t_thread_tally = std::move(previous_);
}

namespace {

// The meter's current or peak bytes on `device` (see the header).
std::optional<int64_t> MeterReading(const c10::Device& device, bool peak) {
  if (device.is_cuda()) {
#ifdef HSDP_WITH_CUDA
    const auto stats =
        c10::cuda::CUDACachingAllocator::getDeviceStats(CudaIndex(device));
    const auto& bytes = stats.allocated_bytes[kAggregatePool];
    return peak ? bytes.peak : bytes.current;
#else
    return std::nullopt;
#endif
  }
  if (!device.is_cpu() || !CountingCpuAllocatorInstalled()) return std::nullopt;
  const std::shared_ptr<MemoryTally> tally = CurrentTally();
  return peak ? tally->peak() : tally->current();
}

}  // namespace

std::optional<int64_t> MeterCurrentBytes(const c10::Device& device) {
  return MeterReading(device, /*peak=*/false);
}

std::optional<int64_t> MeterPeakBytes(const c10::Device& device) {
  return MeterReading(device, /*peak=*/true);
}

void ResetMeterPeak(const c10::Device& device) {
  if (device.is_cuda()) {
#ifdef HSDP_WITH_CUDA
    c10::cuda::CUDACachingAllocator::resetPeakStats(CudaIndex(device));
#endif
    return;
  }
  if (device.is_cpu() && CountingCpuAllocatorInstalled()) {
    CurrentTally()->ResetPeak();
  }
}

int64_t MeasuredPeakBytes(const EngineStats& stats) {
  return stats.measured_peak_bytes >= 0 ? stats.measured_peak_bytes
                                        : stats.peak_memory.Total();
}

}  // namespace hsdp::fsdp
