// NcclCommunicator tests. The first group needs no GPU (type mapping, error
// translation, unique-id encoding, argument checks, linkage); the rest need a
// CUDA device and skip without one, saying why. HSDP_TEST_DEVICE=cuda:N selects
// the device (default cuda:0); "cpu" skips the device tests.
#include "worker/comm/nccl/nccl_communicator.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "hsdp/device_mesh.h"
#include "worker/comm/reduce_kernels.h"
#include "worker/comm/store/in_memory_store.h"

namespace hsdp::comm {
namespace {

using ::testing::HasSubstr;

// ---- Device-free ---------------------------------------------------------

TEST(NcclTypesTest, EveryDataTypeMapsToItsNcclType) {
  const std::vector<std::pair<DataType, ncclDataType_t>> expected = {
      {DataType::kFloat32, ncclFloat32},   {DataType::kFloat64, ncclFloat64},
      {DataType::kBFloat16, ncclBfloat16}, {DataType::kFloat16, ncclFloat16},
      {DataType::kInt32, ncclInt32},       {DataType::kInt64, ncclInt64},
      {DataType::kUInt8, ncclUint8}};
  for (const auto& [dtype, nccl] : expected) {
    absl::StatusOr<ncclDataType_t> mapped = ToNcclDataType(dtype);
    ASSERT_TRUE(mapped.ok()) << DataTypeName(dtype) << ": " << mapped.status();
    EXPECT_EQ(*mapped, nccl) << DataTypeName(dtype);
  }
  EXPECT_EQ(ToNcclDataType(static_cast<DataType>(99)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(NcclTypesTest, ReduceOpsMapToSumAndAvg) {
  EXPECT_EQ(ToNcclRedOp(ReduceOp::kSum), ncclSum);
  EXPECT_EQ(ToNcclRedOp(ReduceOp::kAvg), ncclAvg);
}

TEST(NcclErrorTest, ResultsTranslateToStatusCodesNamingTheOperation) {
  EXPECT_TRUE(NcclResultToStatus(ncclSuccess, "unused").ok());
  const std::vector<std::pair<ncclResult_t, absl::StatusCode>> expected = {
      {ncclInvalidArgument, absl::StatusCode::kInvalidArgument},
      {ncclInvalidUsage, absl::StatusCode::kFailedPrecondition},
      {ncclSystemError, absl::StatusCode::kUnavailable},
      {ncclRemoteError, absl::StatusCode::kUnavailable},
      {ncclInternalError, absl::StatusCode::kInternal},
      {ncclUnhandledCudaError, absl::StatusCode::kInternal}};
  for (const auto& [result, code] : expected) {
    absl::Status status = NcclResultToStatus(
        result, "all_gather #3 on nccl:shard (rank 1 of 2, cuda:1)");
    EXPECT_EQ(status.code(), code) << ncclGetErrorString(result);
    // The message names the collective and carries the library's own
    // description (proves the call into the real libnccl).
    EXPECT_THAT(std::string(status.message()),
                HasSubstr("all_gather #3 on nccl:shard (rank 1 of 2, cuda:1)"));
    EXPECT_THAT(std::string(status.message()),
                HasSubstr(ncclGetErrorString(result)));
    EXPECT_THAT(
        std::string(status.message()),
        HasSubstr(absl::StrCat("NCCL error ", static_cast<int>(result))));
  }
}

TEST(NcclErrorTest, CudaErrorsTranslateToStatusCodes) {
  EXPECT_TRUE(CudaErrorToStatus(cudaSuccess, "unused").ok());
  absl::Status oom =
      CudaErrorToStatus(cudaErrorMemoryAllocation, "cudaMalloc of 1 GiB");
  EXPECT_EQ(oom.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(oom.message()), HasSubstr("cudaMalloc of 1 GiB"));
  EXPECT_THAT(std::string(oom.message()),
              HasSubstr("cudaErrorMemoryAllocation"));
  EXPECT_EQ(CudaErrorToStatus(cudaErrorNoDevice, "x").code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(CudaErrorToStatus(cudaErrorInvalidDevice, "x").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CudaErrorToStatus(cudaErrorLaunchFailure, "x").code(),
            absl::StatusCode::kInternal);
}

TEST(NcclUniqueIdTest, RoundTripsThroughStoreEncodingAndRejectsWrongSizes) {
  ncclUniqueId id;
  for (size_t i = 0; i < sizeof(id.internal); ++i)
    id.internal[i] = static_cast<char>(i * 7 + 1);
  std::string encoded = EncodeUniqueId(id);
  ASSERT_EQ(encoded.size(), static_cast<size_t>(NCCL_UNIQUE_ID_BYTES));
  absl::StatusOr<ncclUniqueId> decoded = DecodeUniqueId(encoded);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(std::memcmp(decoded->internal, id.internal, sizeof(id.internal)),
            0);

  absl::StatusOr<ncclUniqueId> short_id = DecodeUniqueId(encoded.substr(1));
  EXPECT_EQ(short_id.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(short_id.status().message()),
              HasSubstr(absl::StrCat(NCCL_UNIQUE_ID_BYTES, " bytes, got ",
                                     NCCL_UNIQUE_ID_BYTES - 1)));
}

TEST(NcclLinkTest, LinkedLibraryMatchesTheHeader) {
  int version = 0;
  ASSERT_EQ(ncclGetVersion(&version), ncclSuccess);
  // The same major.minor as nccl.h: a mismatch means the build picked up
  // another libnccl.
  EXPECT_EQ(version / 100, NCCL_VERSION_CODE / 100)
      << "linked " << version << ", header " << NCCL_VERSION_CODE;
}

TEST(NcclCreateTest, RejectsBadRanksBeforeTouchingTheDeviceOrStore) {
  InMemoryStore store;
  NcclOptions options;
  options.name = "nccl:test";
  for (auto [rank, size] :
       std::vector<std::pair<int, int>>{{2, 2}, {-1, 2}, {0, 0}}) {
    auto comm = NcclCommunicator::Create(store, "k", rank, size, options);
    EXPECT_EQ(comm.status().code(), absl::StatusCode::kInvalidArgument)
        << rank << "/" << size;
    EXPECT_THAT(std::string(comm.status().message()), HasSubstr("nccl:test"));
  }
  EXPECT_EQ(store.size(), 0u);
}

TEST(NcclCreateTest, WithoutADeviceFailsUnavailableAndPublishesNothing) {
  if (CudaDeviceCount().ok()) GTEST_SKIP() << "this machine has a CUDA device";
  InMemoryStore store;
  CommunicatorFactory factory = NcclCommunicatorFactory(store, NcclOptions{});
  GroupSpec group;
  group.kind = "shard";
  group.prefix = "job/0/shard/0";
  absl::StatusOr<std::unique_ptr<Communicator>> comm = factory(group);
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(comm.status().message()), HasSubstr("nccl:shard"));
  EXPECT_THAT(std::string(comm.status().message()),
              HasSubstr("no CUDA device"));
  EXPECT_EQ(store.size(), 0u);  // no unique id left behind for peers to pick up
}

// ---- Device tests --------------------------------------------------------

constexpr absl::Duration kTestTimeout = absl::Seconds(60);

// The device the tests run on, or the reason to skip.
absl::StatusOr<int> TestDevice() {
  const char* env = std::getenv("HSDP_TEST_DEVICE");
  std::string spec = env != nullptr && env[0] != '\0' ? env : "cuda:0";
  if (spec == "cpu") return absl::UnavailableError("HSDP_TEST_DEVICE=cpu");
  int index = 0;
  if (!absl::StartsWith(spec, "cuda:") ||
      !absl::SimpleAtoi(spec.substr(5), &index)) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad HSDP_TEST_DEVICE '", spec, "'"));
  }
  absl::StatusOr<int> count = CudaDeviceCount();
  if (!count.ok()) return count.status();
  if (index >= *count) {
    return absl::UnavailableError(
        absl::StrCat("no CUDA device: ", spec, " of ", *count));
  }
  return index;
}

#define HSDP_REQUIRE_DEVICE(var)                                               \
  absl::StatusOr<int> var##_or = TestDevice();                                 \
  if (absl::IsInvalidArgument(var##_or.status())) FAIL() << var##_or.status(); \
  if (!var##_or.ok()) GTEST_SKIP() << var##_or.status().message();             \
  const int var = *var##_or

// cudaMalloc'd memory, freed on scope exit.
class DeviceBuffer {
 public:
  DeviceBuffer(DataType dtype, int64_t count) : dtype_(dtype), count_(count) {
    EXPECT_EQ(cudaMalloc(&data_, bytes()), cudaSuccess);
  }
  ~DeviceBuffer() { cudaFree(data_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  Buffer buffer() const { return Buffer{data_, count_, dtype_}; }
  size_t bytes() const {
    return static_cast<size_t>(count_) * ElementSize(dtype_);
  }

  // Host values <-> device, as floats (bf16 converted on the host). Uses the
  // default (compute) stream, so it is ordered after Work::Wait().
  void Upload(const std::vector<float>& values) {
    ASSERT_EQ(static_cast<int64_t>(values.size()), count_);
    std::vector<char> host(bytes());
    for (int64_t i = 0; i < count_; ++i) {
      if (dtype_ == DataType::kBFloat16) {
        reinterpret_cast<uint16_t*>(host.data())[i] =
            FloatToBFloat16(values[i]);
      } else {
        reinterpret_cast<float*>(host.data())[i] = values[i];
      }
    }
    ASSERT_EQ(cudaMemcpy(data_, host.data(), bytes(), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  std::vector<float> Download() const {
    std::vector<char> host(bytes());
    EXPECT_EQ(cudaMemcpy(host.data(), data_, bytes(), cudaMemcpyDeviceToHost),
              cudaSuccess);
    std::vector<float> values(count_);
    for (int64_t i = 0; i < count_; ++i) {
      values[i] = dtype_ == DataType::kBFloat16
                      ? BFloat16ToFloat(
                            reinterpret_cast<const uint16_t*>(host.data())[i])
                      : reinterpret_cast<const float*>(host.data())[i];
    }
    return values;
  }

 private:
  void* data_ = nullptr;
  DataType dtype_;
  int64_t count_;
};

std::unique_ptr<NcclCommunicator> MakeSingleRank(Store& store, int device,
                                                 const std::string& key) {
  NcclOptions options;
  options.device = device;
  options.name = "nccl:test";
  options.init_timeout = kTestTimeout;
  options.collective_timeout = kTestTimeout;
  auto comm = NcclCommunicator::Create(store, key, 0, 1, options);
  EXPECT_TRUE(comm.ok()) << comm.status();
  return comm.ok() ? *std::move(comm) : nullptr;
}

// What a small all-reduce on `comm` returns (after an abort: the error every
// later collective gets).
absl::Status AllReduceStatus(NcclCommunicator& comm) {
  DeviceBuffer buffer(DataType::kFloat32, 16);
  return comm.AllReduce(buffer.buffer(), ReduceOp::kSum)->Wait();
}

class NcclDeviceTest : public ::testing::TestWithParam<DataType> {};

// World size 1 (NCCL refuses two ranks on one GPU): every collective is an
// identity/copy, which still exercises rendezvous, streams, events, enqueue
// polling and the compute-stream ordering.
TEST_P(NcclDeviceTest, CollectivesAtWorldSizeOne) {
  HSDP_REQUIRE_DEVICE(device);
  ASSERT_EQ(cudaSetDevice(device), cudaSuccess);
  const DataType dtype = GetParam();
  InMemoryStore store;
  std::unique_ptr<NcclCommunicator> comm = MakeSingleRank(store, device, "w1");
  ASSERT_NE(comm, nullptr);
  EXPECT_EQ(store.size(), 1u);  // rank 0 published the unique id
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->size(), 1);
  EXPECT_NE(comm->param_stream(), comm->grad_stream());

  constexpr int64_t kCount = 1 << 16;
  std::vector<float> values(kCount);
  for (int64_t i = 0; i < kCount; ++i)
    values[i] = static_cast<float>(i % 251) - 125.0f;

  DeviceBuffer in(dtype, kCount), out(dtype, kCount);
  in.Upload(values);
  auto gather = comm->AllGather(in.buffer(), out.buffer());
  ASSERT_TRUE(gather->Wait().ok());
  EXPECT_EQ(out.Download(), values);

  DeviceBuffer scattered(dtype, kCount);
  auto scatter =
      comm->ReduceScatter(in.buffer(), scattered.buffer(), ReduceOp::kAvg);
  ASSERT_TRUE(scatter->Wait().ok());
  EXPECT_EQ(scattered.Download(), values);

  auto reduce = comm->AllReduce(in.buffer(), ReduceOp::kSum);
  ASSERT_TRUE(reduce->Wait().ok());
  auto broadcast = comm->Broadcast(in.buffer(), 0);
  ASSERT_TRUE(broadcast->Wait().ok());
  EXPECT_EQ(in.Download(), values);
  ASSERT_TRUE(comm->Barrier()->Wait().ok());

  ASSERT_TRUE(comm->Synchronize(kTestTimeout).ok());
  EXPECT_TRUE(gather->IsCompleted());
  EXPECT_GT(gather->ElapsedSeconds(), 0.0);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, NcclDeviceTest,
                         ::testing::Values(DataType::kFloat32,
                                           DataType::kBFloat16),
                         [](const auto& info) {
                           return std::string(DataTypeName(info.param));
                         });

TEST(NcclDeviceOnlyTest,
     ShapeMismatchIsInvalidArgumentAndKeepsTheCommunicatorUsable) {
  HSDP_REQUIRE_DEVICE(device);
  InMemoryStore store;
  std::unique_ptr<NcclCommunicator> comm =
      MakeSingleRank(store, device, "shape");
  ASSERT_NE(comm, nullptr);
  DeviceBuffer in(DataType::kFloat32, 8), out(DataType::kFloat32, 4);
  absl::Status status = comm->AllGather(in.buffer(), out.buffer())->Wait();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("all_gather"));
  EXPECT_THAT(std::string(status.message()), HasSubstr("nccl:test"));
  EXPECT_TRUE(comm->status().ok());
  EXPECT_TRUE(comm->AllReduce(in.buffer(), ReduceOp::kSum)->Wait().ok());
}

TEST(NcclDeviceOnlyTest, GroupedCallsCompleteAtGroupEnd) {
  HSDP_REQUIRE_DEVICE(device);
  ASSERT_EQ(cudaSetDevice(device), cudaSuccess);
  InMemoryStore store;
  std::unique_ptr<NcclCommunicator> comm =
      MakeSingleRank(store, device, "group");
  ASSERT_NE(comm, nullptr);
  DeviceBuffer a(DataType::kFloat32, 1024), b(DataType::kFloat32, 1024);
  DeviceBuffer a_out(DataType::kFloat32, 1024), b_out(DataType::kFloat32, 1024);
  a.Upload(std::vector<float>(1024, 1.5f));
  b.Upload(std::vector<float>(1024, -2.0f));
  std::unique_ptr<Work> first, second;
  {
    NcclGroup group;
    first = comm->AllGather(a.buffer(), a_out.buffer());
    second = comm->AllGather(b.buffer(), b_out.buffer());
    EXPECT_EQ(first->Wait().code(), absl::StatusCode::kFailedPrecondition);
    ASSERT_TRUE(group.End().ok());
  }
  ASSERT_TRUE(first->Wait().ok());
  ASSERT_TRUE(second->Wait().ok());
  EXPECT_EQ(a_out.Download(), std::vector<float>(1024, 1.5f));
  EXPECT_EQ(b_out.Download(), std::vector<float>(1024, -2.0f));
}

TEST(NcclDeviceOnlyTest, MissingPeerTimesOutWithAClearError) {
  HSDP_REQUIRE_DEVICE(device);
  InMemoryStore store;
  NcclOptions options;
  options.device = device;
  options.name = "nccl:shard";
  options.init_timeout = absl::Seconds(3);
  const absl::Time start = absl::Now();
  // Rank 1 of 2 never joins: the non-blocking init must give up, abort and say
  // so.
  auto comm = NcclCommunicator::Create(store, "lonely", 0, 2, options);
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kDeadlineExceeded)
      << comm.status();
  EXPECT_THAT(std::string(comm.status().message()),
              HasSubstr("nccl:shard (rank 0 of 2"));
  EXPECT_THAT(std::string(comm.status().message()), HasSubstr("never joined"));
}

TEST(NcclDeviceOnlyTest, AbortFailsLaterCollectivesNamingTheReason) {
  HSDP_REQUIRE_DEVICE(device);
  InMemoryStore store;
  std::unique_ptr<NcclCommunicator> comm =
      MakeSingleRank(store, device, "abort");
  ASSERT_NE(comm, nullptr);
  comm->Abort(absl::UnavailableError("peer 3 left the job"));
  const absl::Status status = AllReduceStatus(*comm);
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(status.message()), HasSubstr("all_reduce"));
  EXPECT_THAT(std::string(status.message()), HasSubstr("peer 3 left the job"));
}

TEST(NcclDeviceOnlyTest, InterfaceAbortFailsLaterCollectivesWithAborted) {
  HSDP_REQUIRE_DEVICE(device);
  InMemoryStore store;
  std::unique_ptr<NcclCommunicator> comm =
      MakeSingleRank(store, device, "interface-abort");
  ASSERT_NE(comm, nullptr);
  Communicator& generic = *comm;
  ASSERT_TRUE(generic.Abort("generation 3 ended").ok());
  // Idempotent.
  ASSERT_TRUE(generic.Abort("again").ok());
  const absl::Status status = AllReduceStatus(*comm);
  EXPECT_EQ(status.code(), absl::StatusCode::kAborted);
  EXPECT_THAT(std::string(status.message()), HasSubstr("generation 3 ended"));
}

TEST(NcclDeviceOnlyTest, MeshOfOneBuildsNamedCommunicators) {
  HSDP_REQUIRE_DEVICE(device);
  InMemoryStore store;
  NcclOptions options;
  options.device = device;
  options.init_timeout = kTestTimeout;
  auto mesh = DeviceMesh::Create(MeshShape{1, 1}, 0, "job/gen0",
                                 NcclCommunicatorFactory(store, options));
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  EXPECT_EQ((*mesh)->shard().name(), "nccl:shard");
  EXPECT_EQ((*mesh)->replicate().name(), "nccl:replicate");
}

// Rank 1 joins but never issues the all-gather rank 0 issued: rank 0's watchdog
// must abort after collective_timeout with an error naming the collective; rank
// 1 shuts down cleanly.
TEST(NcclDeviceOnlyTest, CollectiveWithoutItsPeerIsAbortedByTheWatchdog) {
  absl::StatusOr<int> count = CudaDeviceCount();
  if (!count.ok()) GTEST_SKIP() << count.status().message();
  if (*count < 2) GTEST_SKIP() << "needs 2 CUDA devices, found " << *count;
  InMemoryStore store;
  std::vector<std::unique_ptr<NcclCommunicator>> comms(2);
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < 2; ++rank) {
    ranks.emplace_back([&, rank] {
      NcclOptions options;
      options.device = rank;
      options.name = "nccl:shard";
      options.init_timeout = kTestTimeout;
      options.collective_timeout = absl::Seconds(1);
      options.watchdog_interval = absl::Milliseconds(20);
      auto comm = NcclCommunicator::Create(store, "hang", rank, 2, options);
      ASSERT_TRUE(comm.ok()) << comm.status();
      comms[rank] = *std::move(comm);
    });
  }
  for (std::thread& t : ranks) t.join();
  ASSERT_NE(comms[0], nullptr);
  ASSERT_NE(comms[1], nullptr);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  DeviceBuffer in(DataType::kFloat32, 64), out(DataType::kFloat32, 128);
  std::unique_ptr<Work> gather = comms[0]->AllGather(in.buffer(), out.buffer());
  EXPECT_FALSE(gather->IsCompleted());
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (comms[0]->status().ok() && absl::Now() < deadline)
    absl::SleepFor(absl::Milliseconds(20));
  const absl::Status status = comms[0]->status();
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("all_gather #1 on nccl:shard (rank 0 of 2"));
  EXPECT_EQ(gather->Wait().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(
      gather->IsCompleted());  // Wait() would not block: it reports the abort
  // Later calls fail at once, naming themselves and the cause.
  absl::Status later = comms[0]->AllReduce(in.buffer(), ReduceOp::kSum)->Wait();
  EXPECT_THAT(std::string(later.message()), HasSubstr("all_reduce #2"));
  EXPECT_THAT(std::string(later.message()),
              HasSubstr("did not complete within"));
  comms[1].reset();
  EXPECT_TRUE(comms[1] == nullptr);
}

// Two ranks as threads on two GPUs: sums and averages cross devices for real.
TEST(NcclDeviceOnlyTest, TwoRanksOnTwoDevicesReduceScatterAndAllGather) {
  absl::StatusOr<int> count = CudaDeviceCount();
  if (!count.ok()) GTEST_SKIP() << count.status().message();
  if (*count < 2) GTEST_SKIP() << "needs 2 CUDA devices, found " << *count;
  InMemoryStore store;
  constexpr int kWorld = 2;
  constexpr int64_t kShard = 4096;
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < kWorld; ++rank) {
    ranks.emplace_back([&, rank] {
      ASSERT_EQ(cudaSetDevice(rank), cudaSuccess);
      NcclOptions options;
      options.device = rank;
      options.name = "nccl:pair";
      options.init_timeout = kTestTimeout;
      auto comm =
          NcclCommunicator::Create(store, "pair", rank, kWorld, options);
      ASSERT_TRUE(comm.ok()) << comm.status();
      DeviceBuffer full(DataType::kFloat32, kShard * kWorld),
          shard(DataType::kFloat32, kShard);
      full.Upload(
          std::vector<float>(kShard * kWorld, static_cast<float>(rank + 1)));
      ASSERT_TRUE(
          (*comm)
              ->ReduceScatter(full.buffer(), shard.buffer(), ReduceOp::kAvg)
              ->Wait()
              .ok());
      EXPECT_EQ(shard.Download(),
                std::vector<float>(kShard, 1.5f));  // (1 + 2) / 2
      shard.Upload(std::vector<float>(kShard, static_cast<float>(10 * rank)));
      ASSERT_TRUE(
          (*comm)->AllGather(shard.buffer(), full.buffer())->Wait().ok());
      std::vector<float> gathered = full.Download();
      EXPECT_EQ(gathered.front(), 0.0f);
      EXPECT_EQ(gathered.back(), 10.0f);
    });
  }
  for (std::thread& t : ranks) t.join();
}

}  // namespace
}  // namespace hsdp::comm
