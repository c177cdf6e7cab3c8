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
#include "worker/comm/gloo/gloo_communicator.h"
#include "worker/comm/reduce_kernels.h"
#include "worker/comm/store/store.h"

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
    switch (dtype_) {
      case DataType::kFloat32:
        *static_cast<float*>(p) = static_cast<float>(value);
        return;
      case DataType::kFloat64:
        *static_cast<double*>(p) = value;
        return;
      case DataType::kBFloat16:
        *static_cast<uint16_t*>(p) = FloatToBFloat16(static_cast<float>(value));
        return;
      case DataType::kFloat16:
        *static_cast<uint16_t*>(p) = FloatToHalf(static_cast<float>(value));
        return;
      case DataType::kInt32:
        *static_cast<int32_t*>(p) = static_cast<int32_t>(value);
        return;
      case DataType::kInt64:
        *static_cast<int64_t*>(p) = static_cast<int64_t>(value);
        return;
      case DataType::kUInt8:
        *static_cast<uint8_t*>(p) = static_cast<uint8_t>(value);
        return;
    }
  }

  double Get(int64_t i) const {
    const void* p = bytes_.data() + i * ElementSize(dtype_);
    switch (dtype_) {
      case DataType::kFloat32:
        return *static_cast<const float*>(p);
      case DataType::kFloat64:
        return *static_cast<const double*>(p);
      case DataType::kBFloat16:
        return BFloat16ToFloat(*static_cast<const uint16_t*>(p));
      case DataType::kFloat16:
        return HalfToFloat(*static_cast<const uint16_t*>(p));
      case DataType::kInt32:
        return *static_cast<const int32_t*>(p);
      case DataType::kInt64:
        return static_cast<double>(*static_cast<const int64_t*>(p));
      case DataType::kUInt8:
        return *static_cast<const uint8_t*>(p);
    }
    return 0;
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
