// ShmCommunicator specifics: when it falls back to the wrapped communicator,
// what it delegates, how it names its failures, and a peer process that dies
// mid-collective. (Its collectives' results are pinned in segments_test.cc.)
#include "worker/comm/shm/shm_communicator.h"

#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/worker/comm/comm_test_util.h"
#include "worker/comm/store/file_store.h"
#include "worker/comm/store/in_memory_store.h"

namespace hsdp::comm {
namespace {

using ::hsdp::comm::testing::MakeBackendGroup;
using ::hsdp::comm::testing::MakeGloo;
using ::hsdp::comm::testing::MakeGroup;
using ::hsdp::comm::testing::RunOnRanks;
using ::hsdp::comm::testing::TypedBuffer;

constexpr absl::Duration kTimeout = absl::Seconds(20);

// A region larger than allowed: every rank keeps its Gloo communicator and is
// told why — the same decision on every rank, so they stay in step.
TEST(ShmCommunicatorTest, FallsBackEverywhereWhenTheRegionDoesNotFit) {
  constexpr int kWorld = 3;
  InMemoryStore store;
  auto gloo = MakeGroup(store, "too-big", kWorld, kTimeout);
  ASSERT_EQ(gloo.size(), static_cast<size_t>(kWorld));
  ShmOptions options;
  options.max_region_bytes = 1024;
  RunOnRanks(kWorld, [&](int rank) {
    std::string reason;
    auto comm = ShmCommunicator::Wrap(store, "too-big", std::move(gloo[rank]),
                                      options, &reason);
    ASSERT_TRUE(comm.ok()) << comm.status();
    EXPECT_EQ((*comm)->name(), "gloo:test");
    EXPECT_NE(reason.find("more than the 1024 allowed"), std::string::npos)
        << reason;
    // Still a working (Gloo) communicator.
    TypedBuffer in(DataType::kFloat32, 2), out(DataType::kFloat32, 2 * kWorld);
    in.Set(0, rank);
    in.Set(1, 1);
    ASSERT_TRUE((*comm)->AllGather(in.buffer(), out.buffer())->Wait().ok());
    for (int r = 0; r < kWorld; ++r) EXPECT_EQ(out.Get(2 * r), r);
  });
}

TEST(ShmCommunicatorTest, GroupOfOneIsReturnedAsIs) {
  InMemoryStore store;
  auto gloo = MakeGroup(store, "one", 1, kTimeout);
  std::string reason;
  auto comm =
      ShmCommunicator::Wrap(store, "one", std::move(gloo[0]), {}, &reason);
  ASSERT_TRUE(comm.ok()) << comm.status();
  EXPECT_EQ((*comm)->name(), "gloo:test");
  EXPECT_FALSE(reason.empty());
}

// Flat collectives go to the wrapped communicator and interleave freely with
// the shared-memory ones; the region leaves nothing behind in /dev/shm.
TEST(ShmCommunicatorTest, DelegatesFlatCollectivesAndCleansUp) {
  constexpr int kWorld = 4;
  auto count_regions = [] {
    int n = 0;
    for (const auto& e : std::filesystem::directory_iterator("/dev/shm")) {
      if (e.path().filename().string().rfind("hsdp-", 0) == 0) ++n;
    }
    return n;
  };
  const int before = count_regions();
  InMemoryStore store;
  auto comms = MakeBackendGroup("shm", store, "mixed", kWorld, kTimeout);
  ASSERT_EQ(comms.size(), static_cast<size_t>(kWorld));
  EXPECT_EQ(count_regions(), before);  // unlinked once everyone mapped it
  RunOnRanks(kWorld, [&](int rank) {
    Communicator& comm = *comms[rank];
    EXPECT_EQ(comm.name(), "shm+gloo:test");
    TypedBuffer sum(DataType::kFloat32, 5), seg(DataType::kFloat32, 3),
        gathered(DataType::kFloat32, 3 * kWorld);
    for (int64_t i = 0; i < 5; ++i) sum.Set(i, rank + 1);
    for (int64_t i = 0; i < 3; ++i) seg.Set(i, rank * 10 + i);
    std::vector<std::vector<Buffer>> outs(kWorld);
    for (int r = 0; r < kWorld; ++r) outs[r] = {gathered.slice(3 * r, 3)};
    // Issued back to back on both transports, waited in reverse order.
    auto a = comm.AllReduce(sum.buffer(), ReduceOp::kSum);
    auto b = comm.AllGatherSegments({seg.buffer()}, outs);
    auto c = comm.Barrier();
    ASSERT_TRUE(c->Wait().ok());
    ASSERT_TRUE(b->Wait().ok());
    ASSERT_TRUE(a->Wait().ok());
    EXPECT_EQ(sum.Get(4), 1 + 2 + 3 + 4);
    for (int r = 0; r < kWorld; ++r)
      EXPECT_EQ(gathered.Get(3 * r + 2), r * 10 + 2);
  });
}

// A large all-gather crosses many slot hand-overs (chunks) in both slots.
TEST(ShmCommunicatorTest, TransfersLargerThanASlotArriveIntact) {
  constexpr int kWorld = 2;
  InMemoryStore store;
  auto comms = MakeBackendGroup("shm", store, "large", kWorld, kTimeout);
  ASSERT_EQ(comms.size(), static_cast<size_t>(kWorld));
  const int64_t count = 3 * (256 << 10) / 4 + 17;  // > 3 slots of floats
  RunOnRanks(kWorld, [&](int rank) {
    TypedBuffer mine(DataType::kFloat32, count),
        all(DataType::kFloat32, count * kWorld);
    for (int64_t i = 0; i < count; ++i) mine.Set(i, (rank + 1) * 1e6 + i);
    std::vector<std::vector<Buffer>> outs(kWorld);
    for (int r = 0; r < kWorld; ++r) outs[r] = {all.slice(r * count, count)};
    for (int rep = 0; rep < 3; ++rep) {
      ASSERT_TRUE(
          comms[rank]->AllGatherSegments({mine.buffer()}, outs)->Wait().ok());
      for (int r = 0; r < kWorld; ++r) {
        ASSERT_EQ(all.Get(r * count), (r + 1) * 1e6);
        ASSERT_EQ(all.Get(r * count + count - 1), (r + 1) * 1e6 + count - 1);
      }
    }
  });
}

// A peer that destroys its communicator (a worker unwinding on an error): the
// others fail at once instead of waiting out the timeout, as with a TCP peer
// that closed its connections.
TEST(ShmCommunicatorTest, PeerThatClosesItsCommunicatorIsNamedQuickly) {
  constexpr int kWorld = 2;
  InMemoryStore store;
  auto comms =
      MakeBackendGroup("shm", store, "closing", kWorld, absl::Seconds(30));
  ASSERT_EQ(comms.size(), static_cast<size_t>(kWorld));
  comms[1].reset();
  TypedBuffer in(DataType::kFloat32, 8), out(DataType::kFloat32, 8);
  const absl::Time start = absl::Now();
  absl::Status status =
      comms[0]
          ->AllGatherSegments({in.buffer()}, {{in.buffer()}, {out.buffer()}})
          ->Wait();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_NE(status.message().find("lost peer rank 1 (it closed its "
                                  "communicator)"),
            std::string::npos)
      << status;
}

// A peer process that exits while the others wait for it: they fail with
// UNAVAILABLE naming its rank and pid long before the timeout.
TEST(ShmCommunicatorTest, PeerProcessThatExitsIsNamedQuickly) {
  constexpr int kWorld = 2;
  constexpr absl::Duration kLongTimeout = absl::Seconds(30);
  const std::string dir =
      ::testing::TempDir() + "/shm-peer-" + std::to_string(getpid());
  std::filesystem::create_directories(dir);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // Rank 1: joins, then exits without issuing anything.
    auto opened = FileStore::Open(dir);
    if (!opened.ok()) _exit(4);
    FileStore& store = *opened;
    auto gloo = MakeGloo(store, "peer", 1, kWorld, kLongTimeout);
    if (!gloo.ok()) _exit(2);
    ShmOptions options;
    options.timeout = kLongTimeout;
    auto comm = ShmCommunicator::Wrap(store, "peer", *std::move(gloo), options);
    _exit(comm.ok() && (*comm)->name().rfind("shm+", 0) == 0 ? 0 : 3);
  }
  auto opened = FileStore::Open(dir);
  ASSERT_TRUE(opened.ok()) << opened.status();
  FileStore& store = *opened;
  auto gloo = MakeGloo(store, "peer", 0, kWorld, kLongTimeout);
  ASSERT_TRUE(gloo.ok()) << gloo.status();
  ShmOptions options;
  options.timeout = kLongTimeout;
  auto comm = ShmCommunicator::Wrap(store, "peer", *std::move(gloo), options);
  ASSERT_TRUE(comm.ok()) << comm.status();
  int child_status = 0;
  ASSERT_EQ(waitpid(child, &child_status, 0), child);  // reaped: pid is gone
  ASSERT_TRUE(WIFEXITED(child_status) && WEXITSTATUS(child_status) == 0)
      << child_status;
  TypedBuffer in(DataType::kFloat32, 8), out(DataType::kFloat32, 8);
  const absl::Time start = absl::Now();
  absl::Status status =
      (*comm)
          ->AllGatherSegments({in.buffer()}, {{in.buffer()}, {out.buffer()}})
          ->Wait();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_NE(status.message().find(
                absl::StrCat("lost peer rank 1 (process ", child, " exited)")),
            std::string::npos)
      << status;
  EXPECT_NE(status.message().find("AllGatherSegments"), std::string::npos)
      << status;
  comm->reset();
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace hsdp::comm
