// DeviceMesh: rank <-> (replicate, shard) arithmetic and real 2x2 groups over
// loopback.
#include "hsdp/device_mesh.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "tests/worker/comm/comm_test_util.h"
#include "worker/comm/forwarding_communicator.h"
#include "worker/comm/gloo/gloo_communicator.h"
#include "worker/comm/store/in_memory_store.h"

namespace hsdp::comm {
namespace {

using ::hsdp::comm::testing::RunOnRanks;

TEST(DeviceMeshTest, GroupArithmetic) {
  const MeshShape shape{
      2, 3};  // ranks 0..5; rank = replicate_index * 3 + shard_index
  GroupSpec shard = DeviceMesh::ShardGroup(shape, 4, "p");
  EXPECT_EQ(shard.prefix, "p/shard/1");
  EXPECT_EQ(shard.rank, 1);
  EXPECT_EQ(shard.size, 3);
  EXPECT_EQ(shard.global_ranks, (std::vector<int>{3, 4, 5}));
  GroupSpec replicate = DeviceMesh::ReplicateGroup(shape, 4, "p");
  EXPECT_EQ(replicate.prefix, "p/replicate/1");
  EXPECT_EQ(replicate.rank, 1);
  EXPECT_EQ(replicate.size, 2);
  EXPECT_EQ(replicate.global_ranks, (std::vector<int>{1, 4}));
  EXPECT_EQ(DeviceMesh::Create(shape, 6, "p", nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The host group: a run of consecutive ranks inside the shard group.
TEST(DeviceMeshTest, HostGroupArithmetic) {
  const MeshShape shape{2, 4};
  GroupSpec host = DeviceMesh::HostGroup(shape, 7, "p", 2);
  EXPECT_EQ(host.kind, "host");
  EXPECT_EQ(host.prefix, "p/host/3");
  EXPECT_EQ(host.rank, 1);
  EXPECT_EQ(host.size, 2);
  EXPECT_EQ(host.global_ranks, (std::vector<int>{6, 7}));
}

// 2x4 whose ranks report hosts a a b b | c c d d: each shard group finds
// host groups of two, whose communicator all-gathers exactly its run's
// world ranks, and aborting the mesh aborts it too. Hosts in runs of unequal
// length, or one host per shard group, give none.
TEST(DeviceMeshTest, HostGroupsFoundFromTheRanksHostIds) {
  const MeshShape shape{2, 4};
  InMemoryStore store;
  GlooDeviceOptions device;
  device.hostname = "127.0.0.1";
  const std::vector<std::string> hosts = {"a", "a", "b", "b",
                                          "c", "c", "d", "d"};
  RunOnRanks(shape.world_size(), [&](int rank) {
    absl::StatusOr<std::unique_ptr<DeviceMesh>> mesh = DeviceMesh::CreateGloo(
        shape, rank, store, "job/gen0", device, absl::Seconds(20),
        /*shared_memory=*/true, hosts[rank]);
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    Communicator* host = (*mesh)->host();
    ASSERT_NE(host, nullptr);
    EXPECT_EQ(host->name(), "shm+gloo:host");
    EXPECT_EQ(host->size(), 2);
    EXPECT_EQ(host->rank(), rank % 2);
    int32_t mine = rank;
    int32_t ranks[2] = {-1, -1};
    ASSERT_TRUE(host->AllGather(Buffer{&mine, 1, DataType::kInt32},
                                Buffer{ranks, 2, DataType::kInt32})
                    ->Wait()
                    .ok());
    EXPECT_EQ(std::vector<int>(ranks, ranks + 2),
              DeviceMesh::HostGroup(shape, rank, "", 2).global_ranks);
    ASSERT_TRUE((*mesh)->Abort("test").ok());
    EXPECT_EQ(host->AllGather(Buffer{&mine, 1, DataType::kInt32},
                              Buffer{ranks, 2, DataType::kInt32})
                  ->Wait()
                  .code(),
              absl::StatusCode::kAborted);
  });
  for (const std::vector<std::string>& layout :
       {std::vector<std::string>{"a", "a", "a", "b"},
        std::vector<std::string>{"a", "a", "a", "a"}}) {
    RunOnRanks(4, [&](int rank) {
      absl::StatusOr<std::unique_ptr<DeviceMesh>> mesh = DeviceMesh::CreateGloo(
          MeshShape{1, 4}, rank, store, absl::StrCat("job/", layout[3]), device,
          absl::Seconds(20), /*shared_memory=*/true, layout[rank]);
      ASSERT_TRUE(mesh.ok()) << mesh.status();
      EXPECT_EQ((*mesh)->host(), nullptr);
    });
  }
}

// A communicator whose Abort returns only once the other group's Abort has
// begun, as when a collective of one group waits on a peer that waits in the
// other group.
class AbortAfterTheOther : public ForwardingCommunicator {
 public:
  AbortAfterTheOther(std::unique_ptr<Communicator> inner,
                     absl::Notification* mine, absl::Notification* other)
      : ForwardingCommunicator(std::move(inner)), mine_(mine), other_(other) {}
  absl::Status Abort(absl::string_view reason) override {
    mine_->Notify();
    if (!other_->WaitForNotificationWithTimeout(absl::Seconds(10))) {
      return absl::DeadlineExceededError("the other group was never aborted");
    }
    return ForwardingCommunicator::Abort(reason);
  }

 private:
  absl::Notification* const mine_;
  absl::Notification* const other_;
};

TEST(DeviceMeshTest, AbortReachesBothGroupsBeforeWaitingOnEither) {
  InMemoryStore store;
  GlooDeviceOptions options;
  options.hostname = "127.0.0.1";
  absl::StatusOr<std::shared_ptr<gloo::transport::Device>> device =
      CreateGlooDevice(options);
  ASSERT_TRUE(device.ok()) << device.status();
  const CommunicatorFactory gloo =
      GlooCommunicatorFactory(store, *device, absl::Seconds(20),
                              /*shared_memory=*/false);
  absl::Notification shard_aborted, replicate_aborted;
  absl::StatusOr<std::unique_ptr<DeviceMesh>> mesh = DeviceMesh::Create(
      MeshShape{1, 1}, 0, "job/gen0",
      [&](const GroupSpec& group)
          -> absl::StatusOr<std::unique_ptr<Communicator>> {
        absl::StatusOr<std::unique_ptr<Communicator>> inner = gloo(group);
        if (!inner.ok()) return inner.status();
        const bool shard = group.kind == "shard";
        return std::make_unique<AbortAfterTheOther>(
            *std::move(inner), shard ? &shard_aborted : &replicate_aborted,
            shard ? &replicate_aborted : &shard_aborted);
      });
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  EXPECT_TRUE((*mesh)->Abort("test").ok());
  EXPECT_TRUE(shard_aborted.HasBeenNotified());
  EXPECT_TRUE(replicate_aborted.HasBeenNotified());
}

// 2x2 over Gloo, with and without shared memory for the segment collectives:
// each rank all-gathers its world rank in both groups and sees exactly its
// group's members, in group order.
class GlooMeshTest : public ::testing::TestWithParam<bool> {};

TEST_P(GlooMeshTest, TwoByTwoGroupsOverGloo) {
  const bool shared_memory = GetParam();
  const MeshShape shape{2, 2};
  InMemoryStore store;
  GlooDeviceOptions device;
  device.hostname = "127.0.0.1";
  RunOnRanks(shape.world_size(), [&](int rank) {
    absl::StatusOr<std::unique_ptr<DeviceMesh>> mesh =
        DeviceMesh::CreateGloo(shape, rank, store, "job/gen0", device,
                               absl::Seconds(20), shared_memory);
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    DeviceMesh& m = **mesh;
    EXPECT_EQ(m.replicate_index(), rank / 2);
    EXPECT_EQ(m.shard_index(), rank % 2);
    EXPECT_EQ(m.shard().size(), 2);
    EXPECT_EQ(m.shard().rank(), rank % 2);
    EXPECT_EQ(m.replicate().rank(), rank / 2);
    // Threads of one process can always share memory.
    EXPECT_EQ(m.shard().name(),
              shared_memory ? "shm+gloo:shard" : "gloo:shard");
    EXPECT_EQ(m.replicate().name(),
              shared_memory ? "shm+gloo:replicate" : "gloo:replicate");
    EXPECT_EQ(m.shard().SupportsSegments(), true);
    int32_t mine = rank;
    int32_t shard_ranks[2] = {-1, -1}, replicate_ranks[2] = {-1, -1};
    // Both groups in flight at once (they share the tcp device).
    auto w1 = m.shard().AllGather(Buffer{&mine, 1, DataType::kInt32},
                                  Buffer{shard_ranks, 2, DataType::kInt32});
    auto w2 =
        m.replicate().AllGather(Buffer{&mine, 1, DataType::kInt32},
                                Buffer{replicate_ranks, 2, DataType::kInt32});
    ASSERT_TRUE(w1->Wait().ok());
    ASSERT_TRUE(w2->Wait().ok());
    const GroupSpec shard = DeviceMesh::ShardGroup(shape, rank, "");
    const GroupSpec replicate = DeviceMesh::ReplicateGroup(shape, rank, "");
    EXPECT_EQ(std::vector<int>(shard_ranks, shard_ranks + 2),
              shard.global_ranks);
    EXPECT_EQ(std::vector<int>(replicate_ranks, replicate_ranks + 2),
              replicate.global_ranks);
    // HSDP-style gradient path: reduce-scatter in the shard group, all-reduce
    // across replicas.
    float grad[2] = {static_cast<float>(rank), static_cast<float>(rank)};
    float shard_grad = 0;
    ASSERT_TRUE(m.shard()
                    .ReduceScatter(Buffer{grad, 2, DataType::kFloat32},
                                   Buffer{&shard_grad, 1, DataType::kFloat32},
                                   ReduceOp::kSum)
                    ->Wait()
                    .ok());
    ASSERT_TRUE(m.replicate()
                    .AllReduce(Buffer{&shard_grad, 1, DataType::kFloat32},
                               ReduceOp::kAvg)
                    ->Wait()
                    .ok());
    EXPECT_EQ(shard_grad,
              (0 + 1 + 2 + 3) / 2.0f);  // sum over all 4 ranks / 2 replicas
  });
}

INSTANTIATE_TEST_SUITE_P(Transports, GlooMeshTest, ::testing::Bool(),
                         [](const auto& info) {
                           return info.param ? "SharedMemory" : "TcpOnly";
                         });

}  // namespace
}  // namespace hsdp::comm
