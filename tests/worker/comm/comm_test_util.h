// Multi-rank test harness: ranks as threads in one process, talking Gloo over
// loopback TCP.
#ifndef HSDP_TESTS_WORKER_COMM_COMM_TEST_UTIL_H_
#define HSDP_TESTS_WORKER_COMM_COMM_TEST_UTIL_H_

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "hsdp/store.h"
#include "worker/comm/gloo/gloo_communicator.h"
#include "worker/comm/reduce_kernels.h"

namespace hsdp::comm::testing {

// A host buffer of `count` elements of `dtype`, read and written as doubles.
class TypedBuffer {
 public:
  TypedBuffer(DataType dtype, int64_t count)
      : dtype_(dtype),
        count_(count),
        bytes_(static_cast<size_t>(count) * ElementSize(dtype)) {}

  Buffer buffer() { return Buffer{bytes_.data(), count_, dtype_}; }
  Buffer slice(int64_t offset, int64_t count) {
    return Buffer{bytes_.data() + offset * ElementSize(dtype_), count, dtype_};
  }
  int64_t count() const { return count_; }

  void Set(int64_t i, double value) {
    void* p = bytes_.data() + i * ElementSize(dtype_);
    WithArithmetic(dtype_, [&](auto arithmetic) {
      using A = decltype(arithmetic);
      *static_cast<typename A::Storage*>(p) =
          A::Store(static_cast<typename A::Acc>(value));
    });
  }

  double Get(int64_t i) const {
    const void* p = bytes_.data() + i * ElementSize(dtype_);
    double value = 0;
    WithArithmetic(dtype_, [&](auto arithmetic) {
      using A = decltype(arithmetic);
      value = static_cast<double>(
          A::Load(*static_cast<const typename A::Storage*>(p)));
    });
    return value;
  }

 private:
  DataType dtype_;
  int64_t count_;
  std::vector<char> bytes_;
};

// Runs fn(rank) for every rank on its own thread and joins them all.
inline void RunOnRanks(int world, const std::function<void(int rank)>& fn) {
  std::vector<std::thread> threads;
  threads.reserve(world);
  for (int rank = 0; rank < world; ++rank) threads.emplace_back(fn, rank);
  for (std::thread& t : threads) t.join();
}

// Creates rank `rank`'s communicator on its own loopback device.
inline absl::StatusOr<std::unique_ptr<GlooCommunicator>> MakeGloo(
    Store& store, const std::string& prefix, int rank, int world,
    absl::Duration timeout, size_t pack_below_bytes = kGlooPackBelowBytes) {
  GlooDeviceOptions device_options;
  device_options.hostname = "127.0.0.1";
  absl::StatusOr<std::shared_ptr<gloo::transport::Device>> device =
      CreateGlooDevice(device_options);
  if (!device.ok()) return device.status();
  GlooCommunicatorOptions options;
  options.name = "gloo:test";
  options.timeout = timeout;
  options.pack_below_bytes = pack_below_bytes;
  return GlooCommunicator::Create(store, prefix, rank, world, *device, options);
}

// Creates a connected group of `world` communicators (rendezvous needs all
// ranks at once, so each is created on its own thread). Fails the calling test
// on error.
std::vector<std::unique_ptr<GlooCommunicator>> MakeGroup(
    Store& store, const std::string& prefix, int world, absl::Duration timeout,
    size_t pack_below_bytes = kGlooPackBelowBytes);

// The same group with `backend`:
//   "gloo"           GlooCommunicator as the mesh builds it;
//   "gloo_unpacked"  Gloo sending every segment on its own (pack_below_bytes
//                    0), "gloo_packed" packing every segment (SIZE_MAX): the
//                    two ends of the packing knob, reached with any sizes;
//   "shm"            Gloo wrapped in ShmCommunicator (fails the calling test
//                    if shared memory is not used).
std::vector<std::unique_ptr<Communicator>> MakeBackendGroup(
    const std::string& backend, Store& store, const std::string& prefix,
    int world, absl::Duration timeout);

}  // namespace hsdp::comm::testing

#endif  // HSDP_TESTS_WORKER_COMM_COMM_TEST_UTIL_H_
