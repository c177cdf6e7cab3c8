// Multi-rank tests of GlooCommunicator: ranks as threads over loopback TCP.
#include "worker/comm/gloo/gloo_communicator.h"

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/worker/comm/comm_test_util.h"
#include "worker/comm/gloo/gloo_pairs.h"
#include "worker/comm/store/in_memory_store.h"

namespace hsdp::comm {
namespace {

using ::hsdp::comm::testing::MakeGloo;
using ::hsdp::comm::testing::MakeGroup;
using ::hsdp::comm::testing::RunOnRanks;
using ::hsdp::comm::testing::TypedBuffer;

constexpr absl::Duration kTimeout = absl::Seconds(20);
// Failure tests use a short timeout and check the error came within it (plus
// scheduling slack).
constexpr absl::Duration kShortTimeout = absl::Seconds(1);
constexpr absl::Duration kSlack = absl::Seconds(3);

// Small integers: exact in bf16, and so are their sums and averages over <= 4
// ranks.
double Value(int rank, int64_t i) {
  return static_cast<double>((rank * 3 + i) % 7 + 1);
}

// Rounds `value` through `dtype`, as a reference result stored in that dtype
// reads back.
double InDtype(DataType dtype, double value) {
  TypedBuffer one(dtype, 1);
  one.Set(0, value);
  return one.Get(0);
}

class CollectivesTest
    : public ::testing::TestWithParam<std::tuple<int, DataType>> {};

// Every collective at one world size and dtype, uneven element counts, sum and
// average.
TEST_P(CollectivesTest, AllCollectivesMatchReference) {
  // Not a structured binding: lambdas capture those only from C++20 (clang).
  const int world = std::get<0>(GetParam());
  const DataType dtype = std::get<1>(GetParam());
  InMemoryStore store;
  auto comms = MakeGroup(store, "collectives", world, kTimeout);
  ASSERT_EQ(comms.size(), static_cast<size_t>(world));
  constexpr int64_t kGatherCount = 7;   // odd, per rank
  constexpr int64_t kShardCount = 5;    // reduce-scatter output per rank
  constexpr int64_t kReduceCount = 13;  // all-reduce / broadcast

  RunOnRanks(world, [&](int rank) {
    GlooCommunicator& comm = *comms[rank];
    EXPECT_EQ(comm.rank(), rank);
    EXPECT_EQ(comm.size(), world);

    // AllGather.
    TypedBuffer in(dtype, kGatherCount), out(dtype, kGatherCount * world);
    for (int64_t i = 0; i < kGatherCount; ++i) in.Set(i, Value(rank, i));
    auto work = comm.AllGather(in.buffer(), out.buffer());
    ASSERT_TRUE(work->Wait().ok());
    EXPECT_TRUE(work->IsCompleted());
    for (int r = 0; r < world; ++r) {
      for (int64_t i = 0; i < kGatherCount; ++i) {
        ASSERT_EQ(out.Get(r * kGatherCount + i), Value(r, i))
            << "rank " << r << " elem " << i;
      }
    }

    // ReduceScatter, sum then avg.
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
      TypedBuffer rs_in(dtype, kShardCount * world), rs_out(dtype, kShardCount);
      for (int64_t i = 0; i < rs_in.count(); ++i) rs_in.Set(i, Value(rank, i));
      ASSERT_TRUE(
          comm.ReduceScatter(rs_in.buffer(), rs_out.buffer(), op)->Wait().ok());
      for (int64_t i = 0; i < kShardCount; ++i) {
        double sum = 0;
        for (int r = 0; r < world; ++r) sum += Value(r, rank * kShardCount + i);
        const double expected = op == ReduceOp::kAvg ? sum / world : sum;
        ASSERT_EQ(rs_out.Get(i), InDtype(dtype, expected)) << "elem " << i;
      }
    }

    // AllReduce, sum then avg.
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
      TypedBuffer ar(dtype, kReduceCount);
      for (int64_t i = 0; i < kReduceCount; ++i) ar.Set(i, Value(rank, i));
      ASSERT_TRUE(comm.AllReduce(ar.buffer(), op)->Wait().ok());
      for (int64_t i = 0; i < kReduceCount; ++i) {
        double sum = 0;
        for (int r = 0; r < world; ++r) sum += Value(r, i);
        const double expected = op == ReduceOp::kAvg ? sum / world : sum;
        ASSERT_EQ(ar.Get(i), InDtype(dtype, expected)) << "elem " << i;
      }
    }

    // Broadcast from the last rank.
    const int root = world - 1;
    TypedBuffer bc(dtype, kReduceCount);
    for (int64_t i = 0; i < kReduceCount; ++i) bc.Set(i, Value(rank, i));
    ASSERT_TRUE(comm.Broadcast(bc.buffer(), root)->Wait().ok());
    for (int64_t i = 0; i < kReduceCount; ++i)
      ASSERT_EQ(bc.Get(i), Value(root, i));

    auto barrier = comm.Barrier();
    ASSERT_TRUE(barrier->Wait().ok());
    EXPECT_GE(barrier->ElapsedSeconds(), 0.0);
  });
}

INSTANTIATE_TEST_SUITE_P(
    WorldsAndDtypes, CollectivesTest,
    ::testing::Combine(::testing::Values(1, 2, 4),
                       ::testing::Values(DataType::kFloat32,
                                         DataType::kBFloat16)),
    [](const ::testing::TestParamInfo<CollectivesTest::ParamType>& info) {
      return absl::StrCat("world", std::get<0>(info.param), "_",
                          DataTypeName(std::get<1>(info.param)));
    });

// Reduce-scatter in the other dtypes, with a non-integer average and bf16/fp16
// rounding once.
TEST(GlooCommunicatorTest, ReduceScatterOtherDtypes) {
  constexpr int kWorld = 2;
  constexpr int64_t kShardCount = 3;
  InMemoryStore store;
  auto comms = MakeGroup(store, "dtypes", kWorld, kTimeout);
  RunOnRanks(kWorld, [&](int rank) {
    for (DataType dtype :
         {DataType::kFloat64, DataType::kFloat16, DataType::kInt32}) {
      TypedBuffer in(dtype, kShardCount * kWorld), out(dtype, kShardCount);
      for (int64_t i = 0; i < in.count(); ++i) in.Set(i, Value(rank, i));
      ASSERT_TRUE(comms[rank]
                      ->ReduceScatter(in.buffer(), out.buffer(), ReduceOp::kAvg)
                      ->Wait()
                      .ok());
      for (int64_t i = 0; i < kShardCount; ++i) {
        const double sum =
            Value(0, rank * kShardCount + i) + Value(1, rank * kShardCount + i);
        const double expected =
            dtype == DataType::kInt32 ? std::trunc(sum / kWorld) : sum / kWorld;
        EXPECT_EQ(out.Get(i), InDtype(dtype, expected))
            << DataTypeName(dtype) << " elem " << i;
      }
    }
  });
}

// bf16 reduce-scatter sums in float and rounds once: 256 + 1 + 1 is 258 (exact
// in bf16), where rounding after each addition would give 256 (256 + 1 rounds
// back to 256).
TEST(GlooCommunicatorTest, BFloat16ReduceScatterRoundsOnce) {
  constexpr int kWorld = 4;
  InMemoryStore store;
  auto comms = MakeGroup(store, "bf16round", kWorld, kTimeout);
  RunOnRanks(kWorld, [&](int rank) {
    TypedBuffer in(DataType::kBFloat16, kWorld), out(DataType::kBFloat16, 1);
    const double contribution = rank == 0 ? 256.0 : (rank <= 2 ? 1.0 : 0.0);
    for (int64_t i = 0; i < kWorld; ++i) in.Set(i, contribution);
    ASSERT_TRUE(comms[rank]
                    ->ReduceScatter(in.buffer(), out.buffer(), ReduceOp::kSum)
                    ->Wait()
                    .ok());
    EXPECT_EQ(out.Get(0), 258.0);
  });
}

// In-place variants: all-gather from the rank's slot of the output;
// reduce-scatter into the rank's slot of the input.
TEST(GlooCommunicatorTest, InPlaceAllGatherAndReduceScatter) {
  constexpr int kWorld = 2;
  constexpr int64_t kCount = 9;
  InMemoryStore store;
  auto comms = MakeGroup(store, "inplace", kWorld, kTimeout);
  RunOnRanks(kWorld, [&](int rank) {
    TypedBuffer full(DataType::kFloat32, kCount * kWorld);
    for (int64_t i = 0; i < kCount; ++i)
      full.Set(rank * kCount + i, Value(rank, i));
    ASSERT_TRUE(
        comms[rank]
            ->AllGather(full.slice(rank * kCount, kCount), full.buffer())
            ->Wait()
            .ok());
    for (int r = 0; r < kWorld; ++r) {
      for (int64_t i = 0; i < kCount; ++i)
        ASSERT_EQ(full.Get(r * kCount + i), Value(r, i));
    }
    // full now holds identical data on both ranks: the sum is 2x, landing in
    // our own slot.
    ASSERT_TRUE(comms[rank]
                    ->ReduceScatter(full.buffer(),
                                    full.slice(rank * kCount, kCount),
                                    ReduceOp::kSum)
                    ->Wait()
                    .ok());
    for (int64_t i = 0; i < kCount; ++i)
      EXPECT_EQ(full.Get(rank * kCount + i), 2 * Value(rank, i));
  });
}

// Several collectives in flight at once (issued back to back, waited in reverse
// order), then collectives on two communicators of the same ranks from two
// threads at once.
TEST(GlooCommunicatorTest, OverlappingCollectives) {
  constexpr int kWorld = 4;
  constexpr int64_t kCount = 1 << 14;
  InMemoryStore store;
  auto first = MakeGroup(store, "overlap/a", kWorld, kTimeout);
  auto second = MakeGroup(store, "overlap/b", kWorld, kTimeout);
  RunOnRanks(kWorld, [&](int rank) {
    TypedBuffer gather_in(DataType::kFloat32, kCount),
        gather_out(DataType::kFloat32, kCount * kWorld);
    TypedBuffer rs_in(DataType::kFloat32, kCount * kWorld),
        rs_out(DataType::kFloat32, kCount);
    TypedBuffer ar(DataType::kFloat32, kCount);
    for (int64_t i = 0; i < kCount; ++i) {
      gather_in.Set(i, Value(rank, i));
      ar.Set(i, Value(rank, i));
    }
    for (int64_t i = 0; i < rs_in.count(); ++i) rs_in.Set(i, Value(rank, i));
    auto w1 = first[rank]->AllGather(gather_in.buffer(), gather_out.buffer());
    auto w2 = first[rank]->ReduceScatter(rs_in.buffer(), rs_out.buffer(),
                                         ReduceOp::kSum);
    auto w3 = first[rank]->AllReduce(ar.buffer(), ReduceOp::kSum);
    ASSERT_TRUE(w3->Wait().ok());
    ASSERT_TRUE(w2->Wait().ok());
    ASSERT_TRUE(w1->Wait().ok());
    for (int64_t i = 0; i < kCount; i += 97) {
      double ar_sum = 0, rs_sum = 0;
      for (int r = 0; r < kWorld; ++r) {
        ar_sum += Value(r, i);
        rs_sum += Value(r, rank * kCount + i);
        ASSERT_EQ(gather_out.Get(r * kCount + i), Value(r, i));
      }
      ASSERT_EQ(ar.Get(i), ar_sum);
      ASSERT_EQ(rs_out.Get(i), rs_sum);
    }

    // Two communicators driven from two threads of the same rank at the same
    // time.
    TypedBuffer a(DataType::kFloat32, kCount), b(DataType::kFloat32, kCount);
    std::thread other([&] {
      for (int64_t i = 0; i < kCount; ++i) b.Set(i, 2.0);
      EXPECT_TRUE(
          second[rank]->AllReduce(b.buffer(), ReduceOp::kSum)->Wait().ok());
    });
    for (int64_t i = 0; i < kCount; ++i) a.Set(i, 1.0);
    EXPECT_TRUE(
        first[rank]->AllReduce(a.buffer(), ReduceOp::kSum)->Wait().ok());
    other.join();
    EXPECT_EQ(a.Get(kCount - 1), kWorld * 1.0);
    EXPECT_EQ(b.Get(kCount - 1), kWorld * 2.0);
  });
}

TEST(GlooCommunicatorTest, BadArgumentsFailWithoutCommunicating) {
  InMemoryStore store;
  auto comms = MakeGroup(store, "args", 1, kTimeout);
  TypedBuffer in(DataType::kFloat32, 4), out(DataType::kFloat32, 3),
      bf(DataType::kBFloat16, 4);
  absl::Status status = comms[0]->AllGather(in.buffer(), out.buffer())->Wait();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("AllGather"), std::string::npos) << status;
  status =
      comms[0]->ReduceScatter(in.buffer(), bf.buffer(), ReduceOp::kSum)->Wait();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  status = comms[0]->Broadcast(in.buffer(), 1)->Wait();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  // The communicator still works after refused calls.
  EXPECT_TRUE(comms[0]->Barrier()->Wait().ok());
}

// A rank that never joins: the others' rendezvous ends within the timeout
// naming its key.
TEST(GlooCommunicatorTest, PeerThatNeverArrivesFailsRendezvous) {
  // Ranks 2 and 3 never come; the two present ranks fail once (not twice) the
  // timeout, naming both.
  constexpr int kWorld = 4;
  constexpr int kPresent = 2;
  InMemoryStore store;
  RunOnRanks(kPresent, [&](int rank) {
    const absl::Time start = absl::Now();
    auto comm = MakeGloo(store, "job/gen1/shard", rank, kWorld, kShortTimeout);
    const absl::Duration took = absl::Now() - start;
    ASSERT_FALSE(comm.ok());
    const std::string message(comm.status().message());
    EXPECT_EQ(comm.status().code(), absl::StatusCode::kDeadlineExceeded)
        << message;
    EXPECT_NE(message.find("rank(s) 2, 3 never arrived"), std::string::npos)
        << message;
    EXPECT_NE(message.find("job/gen1/shard/2"), std::string::npos) << message;
    EXPECT_LT(took, 2 * kShortTimeout - absl::Milliseconds(200)) << message;
  });
}

// A peer that joined but never issues the collective: DEADLINE_EXCEEDED naming
// the collective and communicator; the communicator then fails fast.
TEST(GlooCommunicatorTest, PeerThatNeverIssuesTimesOut) {
  constexpr int kWorld = 2;
  InMemoryStore store;
  auto comms = MakeGroup(store, "silent", kWorld, kShortTimeout);
  TypedBuffer buffer(DataType::kFloat32, 1024);
  const absl::Time start = absl::Now();
  absl::Status status =
      comms[0]->AllReduce(buffer.buffer(), ReduceOp::kSum)->Wait();
  EXPECT_LT(absl::Now() - start, kShortTimeout + kSlack);
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_NE(status.message().find("AllReduce"), std::string::npos) << status;
  EXPECT_NE(status.message().find("gloo:test"), std::string::npos) << status;

  const absl::Time again = absl::Now();
  status = comms[0]->Barrier()->Wait();
  EXPECT_LT(absl::Now() - again, absl::Seconds(0.5));
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_NE(status.message().find("failed earlier"), std::string::npos)
      << status;
}

// A peer that goes away (its communicator destroyed, as when its process dies)
// while the others are inside a collective with it: they fail promptly, long
// before the timeout.
TEST(GlooCommunicatorTest, PeerThatDiesMidCollectiveFailsOthers) {
  constexpr int kWorld = 3;
  constexpr int kDying = 1;
  constexpr absl::Duration kLongTimeout = absl::Seconds(30);
  InMemoryStore store;
  auto comms = MakeGroup(store, "dying", kWorld, kLongTimeout);
  RunOnRanks(kWorld, [&](int rank) {
    TypedBuffer in(DataType::kFloat32, 1 << 16),
        out(DataType::kFloat32, kWorld << 16);
    // One good collective first, so the dying rank dies between collectives of
    // a running job.
    ASSERT_TRUE(comms[rank]->AllGather(in.buffer(), out.buffer())->Wait().ok());
    if (rank == kDying) {
      absl::SleepFor(
          absl::Milliseconds(300));  // let the others block in the next one
      comms[rank].reset();
      return;
    }
    const absl::Time start = absl::Now();
    absl::Status status =
        comms[rank]->AllGather(in.buffer(), out.buffer())->Wait();
    const absl::Duration took = absl::Now() - start;
    EXPECT_FALSE(status.ok());
    EXPECT_TRUE(status.code() == absl::StatusCode::kUnavailable ||
                status.code() == absl::StatusCode::kDeadlineExceeded)
        << status;
    EXPECT_NE(status.message().find("AllGather"), std::string::npos) << status;
    if (status.code() == absl::StatusCode::kUnavailable) {
      // On loopback every rank shares one host, so the peer is named only when
      // its exact address is known (see FindPeerInGlooError); never wrongly.
      const bool named = status.message().find(absl::StrCat(
                             "lost peer rank ", kDying)) != std::string::npos;
      const bool unnamed =
          status.message().find("lost a peer") != std::string::npos;
      EXPECT_TRUE(named || unnamed) << status;
    }
    EXPECT_LT(took, absl::Seconds(10)) << status;
  });
}

TEST(GlooCommunicatorTest, FindPeerInGlooErrorNamesRankByAddressOrHost) {
  const std::vector<std::string> peers = {"[10.0.0.1]:4000", "",
                                          "[10.0.0.3]:5000", "[10.0.0.3]:5001"};
  const std::string prefix = "[pair.cc:598] Connection closed by peer ";
  EXPECT_EQ(FindPeerInGlooError(prefix + "[10.0.0.3]:5001", peers), 3);
  EXPECT_EQ(FindPeerInGlooError(prefix + "[10.0.0.1]:4000", peers), 0);
  // Ephemeral port of the peer's connecting socket: its host is unique.
  EXPECT_EQ(FindPeerInGlooError(prefix + "[10.0.0.1]:53211", peers), 0);
  // Two peers on that host: unknown rather than a guess.
  EXPECT_EQ(FindPeerInGlooError(prefix + "[10.0.0.3]:53211", peers), -1);
  EXPECT_EQ(FindPeerInGlooError("Timed out waiting 1000ms", peers), -1);
}

// Work dropped without Wait(): the destructor still drains the queue and joins
// cleanly.
TEST(GlooCommunicatorTest, DestructorDrainsUnwaitedWork) {
  constexpr int kWorld = 2;
  InMemoryStore store;
  auto comms = MakeGroup(store, "drain", kWorld, kTimeout);
  std::vector<TypedBuffer> buffers(kWorld, TypedBuffer(DataType::kFloat32, 64));
  RunOnRanks(kWorld, [&](int rank) {
    buffers[rank].Set(0, rank + 1);
    comms[rank]->AllReduce(buffers[rank].buffer(),
                           ReduceOp::kSum);  // Work dropped
    comms[rank]->Barrier();
    comms[rank].reset();  // must run both before returning
  });
  EXPECT_EQ(buffers[0].Get(0), 3.0);
  EXPECT_EQ(buffers[1].Get(0), 3.0);
}

}  // namespace
}  // namespace hsdp::comm
