// Communicator::Abort and what follows it: a collective blocked on a peer
// that never comes is unblocked from another thread (ABORTED, promptly); a
// peer waiting on an aborted rank fails at once; a killed peer process fails
// the survivor fast; a smaller mesh forms again in the same process. Gloo TCP
// and shared memory; ranks as threads, the killed peer as a real process.
#include <signal.h>

#include <atomic>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "hsdp/device_mesh.h"
#include "tests/coordinator/subprocess.h"
#include "tests/worker/comm/comm_test_util.h"
#include "tests/worker/comm/kill_test_ops.h"
#include "worker/comm/store/file_store.h"
#include "worker/comm/store/in_memory_store.h"

namespace hsdp::comm {
namespace {

using ::hsdp::comm::testing::KillTestBuffers;
using ::hsdp::comm::testing::MakeBackendGroup;
using ::hsdp::comm::testing::RunKillTestOp;
using ::hsdp::comm::testing::RunOnRanks;

// Collectives would wait this long for a peer: anything that ends within
// seconds was ended by the abort or by noticing a dead peer.
constexpr absl::Duration kLongTimeout = absl::Seconds(60);
// "Promptly" on a loaded 2-core machine; typical figures are printed.
constexpr absl::Duration kPrompt = absl::Seconds(3);
// Time the blocked ranks get to really block before the abort.
constexpr absl::Duration kBlockFirst = absl::Milliseconds(300);

struct Case {
  std::string backend;  // "gloo" or "shm"
  std::string op;       // "allreduce" or "segments"
};

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  return absl::StrCat(info.param.backend, "_", info.param.op);
}

class AbortTest : public ::testing::TestWithParam<Case> {};

// Ranks 0 and 1 issue a collective that rank 2 never issues; a watcher thread
// aborts both: each Wait returns ABORTED with the reason, and later calls fail
// at once.
TEST_P(AbortTest, BlockedCollectiveReturnsAbortedPromptly) {
  constexpr int kWorld = 3;
  InMemoryStore store;
  auto comms = MakeBackendGroup(GetParam().backend, store, "abort", kWorld,
                                kLongTimeout);
  ASSERT_EQ(comms.size(), static_cast<size_t>(kWorld));
  absl::Notification aborted;
  absl::Time abort_time;
  std::vector<absl::Duration> unblocked(kWorld);
  std::thread watcher([&] {
    absl::SleepFor(kBlockFirst);
    abort_time = absl::Now();
    for (int r = 0; r < 2; ++r) {
      const absl::Status s = comms[r]->Abort("generation 1 ended");
      EXPECT_TRUE(s.ok()) << s;
    }
    aborted.Notify();
  });
  RunOnRanks(kWorld, [&](int rank) {
    if (rank == 2) return;  // never issues the collective
    KillTestBuffers buffers(kWorld);
    const absl::Status status =
        RunKillTestOp(*comms[rank], GetParam().op, buffers);
    aborted.WaitForNotification();
    unblocked[rank] = absl::Now() - abort_time;
    EXPECT_EQ(status.code(), absl::StatusCode::kAborted) << status;
    EXPECT_NE(status.message().find("generation 1 ended"), std::string::npos)
        << status;
    EXPECT_LT(unblocked[rank], kPrompt);
    // Later calls fail at once, without communicating.
    const absl::Time later = absl::Now();
    const absl::Status again =
        RunKillTestOp(*comms[rank], GetParam().op, buffers);
    EXPECT_EQ(again.code(), absl::StatusCode::kAborted) << again;
    EXPECT_LT(absl::Now() - later, absl::Seconds(1));
    // Idempotent.
    EXPECT_TRUE(comms[rank]->Abort("again").ok());
  });
  watcher.join();
  std::cout << GetParam().backend << " " << GetParam().op
            << ": abort -> ABORTED in " << absl::FormatDuration(unblocked[0])
            << " / " << absl::FormatDuration(unblocked[1]) << "\n";
  // Destroying aborted communicators (with a silent peer alive) is prompt.
  const absl::Time start = absl::Now();
  comms.clear();
  EXPECT_LT(absl::Now() - start, kPrompt);
}

// Rank 1 aborts while rank 0 waits on it: rank 0 fails at once (the
// connection closed / the rank is marked closed), without its own abort.
TEST_P(AbortTest, PeerWaitingOnAnAbortedRankFailsFast) {
  constexpr int kWorld = 2;
  InMemoryStore store;
  auto comms = MakeBackendGroup(GetParam().backend, store, "abort-peer", kWorld,
                                kLongTimeout);
  ASSERT_EQ(comms.size(), static_cast<size_t>(kWorld));
  absl::Time abort_time;
  absl::Notification aborted;
  std::thread watcher([&] {
    absl::SleepFor(kBlockFirst);
    abort_time = absl::Now();
    EXPECT_TRUE(comms[1]->Abort("evicted").ok());
    aborted.Notify();
  });
  KillTestBuffers buffers(kWorld);
  const absl::Status status = RunKillTestOp(*comms[0], GetParam().op, buffers);
  aborted.WaitForNotification();
  const absl::Duration took = absl::Now() - abort_time;
  watcher.join();
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_LT(took, kPrompt) << status;
  std::cout << GetParam().backend << " " << GetParam().op
            << ": peer of an aborted rank fails in "
            << absl::FormatDuration(took) << "\n";
}

// The peer is a real process, killed with SIGKILL while rank 0 waits on it
// in the next collective: rank 0 fails fast (UNAVAILABLE), long before its
// timeout.
TEST_P(AbortTest, KilledPeerProcessFailsTheSurvivorFast) {
  constexpr int kWorld = 2;
  // A fresh store per run: --gtest_repeat must not find the last run's keys.
  static int runs = 0;
  const std::string dir =
      absl::StrCat(::testing::TempDir(), "/hsdp_kill_", GetParam().backend, "_",
                   GetParam().op, "_", getpid(), "_", runs++);
  absl::StatusOr<FileStore> store = FileStore::Open(dir);
  ASSERT_TRUE(store.ok()) << store.status();
  hsdp::testing::Subprocess child({HSDP_COMM_PEER_PROCESS_BIN, dir, "kill", "1",
                                   std::to_string(kWorld), GetParam().backend,
                                   GetParam().op});
  absl::StatusOr<std::unique_ptr<Communicator>> comm =
      testing::MakeKillTestCommunicator(*store, "kill", 0, kWorld,
                                        GetParam().backend);
  ASSERT_TRUE(comm.ok()) << comm.status();
  if (GetParam().backend == "shm") {
    ASSERT_EQ((*comm)->name().rfind("shm+", 0), 0u) << (*comm)->name();
  }
  KillTestBuffers buffers(kWorld);
  ASSERT_TRUE(RunKillTestOp(**comm, GetParam().op, buffers).ok());
  ASSERT_EQ(child.WaitForLine("ready"), "ready") << child.err();
  absl::Time kill_time;
  std::thread killer([&] {
    absl::SleepFor(kBlockFirst);
    kill_time = absl::Now();
    child.Signal(SIGKILL);
  });
  const absl::Status status = RunKillTestOp(**comm, GetParam().op, buffers);
  killer.join();
  const absl::Duration took = absl::Now() - kill_time;
  child.Wait();
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_LT(took, kPrompt) << status;
  std::cout << GetParam().backend << " " << GetParam().op
            << ": SIGKILLed peer noticed in " << absl::FormatDuration(took)
            << "\n";
}

INSTANTIATE_TEST_SUITE_P(Backends, AbortTest,
                         ::testing::Values(Case{"gloo", "allreduce"},
                                           Case{"gloo", "segments"},
                                           Case{"shm", "segments"}),
                         CaseName);

// A 2x2 mesh of four threads: rank 3 goes silent, ranks 0..2 block in their
// collectives, a watcher aborts their meshes (as each survivor's agent does
// when the generation ends), and ranks 0 and 1 form a 1x2 mesh under the next
// generation's prefix in the same process and train on.
class ReformTest : public ::testing::TestWithParam<bool> {};

TEST_P(ReformTest, AbortedMeshIsReplacedByASmallerOneInTheSameProcess) {
  const bool shared_memory = GetParam();
  const MeshShape old_shape{2, 2}, new_shape{1, 2};
  InMemoryStore store;
  GlooDeviceOptions device;
  device.hostname = "127.0.0.1";
  std::vector<std::unique_ptr<DeviceMesh>> meshes(old_shape.world_size());
  RunOnRanks(old_shape.world_size(), [&](int rank) {
    auto mesh = DeviceMesh::CreateGloo(old_shape, rank, store, "job/gen-0",
                                       device, kLongTimeout, shared_memory);
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    meshes[rank] = *std::move(mesh);
  });
  absl::Notification all_aborted;
  absl::Time abort_time;
  std::thread watcher([&] {
    absl::SleepFor(kBlockFirst);
    abort_time = absl::Now();
    for (int r = 0; r < 3; ++r) {
      EXPECT_TRUE(meshes[r]->Abort("generation 0 ended: rank 3 lost").ok());
    }
    all_aborted.Notify();
  });
  std::vector<float> sums(2, 0);
  RunOnRanks(old_shape.world_size(), [&](int rank) {
    std::vector<float> value(1024, static_cast<float>(rank + 1));
    const Buffer buffer{value.data(), 1024, DataType::kFloat32};
    if (rank == 3) return;  // silent: never issues anything
    // Rank 1 blocks on rank 3 in the replicate group; ranks 0 and 2 finish
    // theirs, then block in the shard group (on rank 1 and rank 3).
    absl::Status status =
        meshes[rank]->replicate().AllReduce(buffer, ReduceOp::kSum)->Wait();
    if (status.ok()) {
      status = meshes[rank]->shard().AllReduce(buffer, ReduceOp::kSum)->Wait();
    }
    all_aborted.WaitForNotification();
    EXPECT_EQ(status.code(), absl::StatusCode::kAborted) << status;
    EXPECT_LT(absl::Now() - abort_time, kPrompt);
    meshes[rank].reset();
    if (rank == 2) return;  // stands by
    // The next generation: 1x2, the same ranks 0 and 1, a new prefix.
    auto mesh = DeviceMesh::CreateGloo(new_shape, rank, store, "job/gen-1",
                                       device, kLongTimeout, shared_memory);
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    EXPECT_EQ((*mesh)->world_size(), 2);
    std::vector<float> fresh(1024, static_cast<float>(rank + 1));
    ASSERT_TRUE((*mesh)
                    ->shard()
                    .AllReduce(Buffer{fresh.data(), 1024, DataType::kFloat32},
                               ReduceOp::kSum)
                    ->Wait()
                    .ok());
    sums[rank] = fresh[17];
    // The unit path (shared memory when enabled) works in the new mesh too.
    std::vector<float> mine(1024, static_cast<float>(rank + 1));
    std::vector<float> gathered(2 * 1024);
    std::vector<std::vector<Buffer>> outputs = {
        {Buffer{gathered.data(), 1024, DataType::kFloat32}},
        {Buffer{gathered.data() + 1024, 1024, DataType::kFloat32}}};
    ASSERT_TRUE(
        (*mesh)
            ->shard()
            .AllGatherSegments({Buffer{mine.data(), 1024, DataType::kFloat32}},
                               outputs)
            ->Wait()
            .ok());
    EXPECT_EQ(gathered[5], 1.0f);
    EXPECT_EQ(gathered[1024 + 5], 2.0f);
  });
  watcher.join();
  EXPECT_EQ(sums, (std::vector<float>{3.0f, 3.0f}));
  meshes.clear();
}

INSTANTIATE_TEST_SUITE_P(SharedMemory, ReformTest, ::testing::Bool());

}  // namespace
}  // namespace hsdp::comm
