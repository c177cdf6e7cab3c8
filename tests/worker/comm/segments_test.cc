// The segment-addressed collectives (what the engine uses to gather straight
// into parameter storage and reduce straight from gradients), on both CPU
// backends — Gloo and shared memory: results equal the flat collectives on the
// concatenated layout, bit for bit; bad arguments and silent peers fail with a
// clear error.
#include <cmath>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/worker/comm/comm_test_util.h"
#include "worker/comm/gloo/gloo_communicator.h"
#include "worker/comm/reduce_kernels.h"
#include "worker/comm/store/in_memory_store.h"

namespace hsdp::comm {
namespace {

using ::hsdp::comm::testing::MakeBackendGroup;
using ::hsdp::comm::testing::RunOnRanks;
using ::hsdp::comm::testing::TypedBuffer;

constexpr absl::Duration kTimeout = absl::Seconds(20);
constexpr absl::Duration kShortTimeout = absl::Seconds(1);
constexpr absl::Duration kSlack = absl::Seconds(3);

// Segment sizes of a unit-like layout: uneven, one empty (a parameter whose
// rows all fall in other ranks' padding), small ones (Gloo packs those into
// one message) around large ones (sent on their own, over several rounds or
// shared-memory slots).
const std::vector<int64_t> kSegmentCounts = {5, 0, 17, 70001, 1, 64, 40000};

// Rank r's count of segment k when every segment is "padded" like a dim-0
// shard: the last rank holds 2 elements fewer of the segments that have them.
int64_t RankCount(int64_t k, int rank, int world) {
  const int64_t n = kSegmentCounts[k];
  return rank == world - 1 && n > 2 ? n - 2 : n;
}

// Non-integer values, so sums round: the check is bit for bit.
double Value(int rank, int64_t k, int64_t i) {
  // splitmix64 of the position: cheap, deterministic, well mixed.
  uint64_t z = static_cast<uint64_t>(rank) * 0x9e3779b97f4a7c15ULL +
               static_cast<uint64_t>(k) * 0xbf58476d1ce4e5b9ULL +
               static_cast<uint64_t>(i) + 1;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  z ^= z >> 31;
  return -2.0 + 4.0 * static_cast<double>(z >> 11) / 9007199254740992.0;
}

// Parameters: backend (as MakeBackendGroup takes it), world size, dtype.
class SegmentsTest
    : public ::testing::TestWithParam<std::tuple<std::string, int, DataType>> {
 protected:
  int world() const { return std::get<1>(GetParam()); }
  DataType dtype() const { return std::get<2>(GetParam()); }
  // The group under test, its rendezvous under `prefix` in `store`.
  std::vector<std::unique_ptr<Communicator>> MakeComms(
      Store& store, const std::string& prefix) const {
    return MakeBackendGroup(std::get<0>(GetParam()), store, prefix, world(),
                            kTimeout);
  }
};

TEST_P(SegmentsTest, AllGatherMatchesFlatAllGather) {
  const int world = this->world();
  const DataType dtype = this->dtype();
  InMemoryStore store;
  auto comms = MakeComms(store, "ag-segments");
  ASSERT_EQ(comms.size(), static_cast<size_t>(world));
  RunOnRanks(world, [&](int rank) {
    Communicator& comm = *comms[rank];
    ASSERT_TRUE(comm.SupportsSegments());
    int64_t chunk = 0;
    for (int64_t n : kSegmentCounts) chunk += n;
    // Segments of this rank's chunk, and a separate region per (rank, segment)
    // to receive into; our own output segment 2 aliases our input (in place).
    TypedBuffer mine(dtype, chunk), flat_out(dtype, chunk * world);
    std::vector<TypedBuffer> regions;
    for (int r = 0; r < world; ++r) {
      for (int64_t n : kSegmentCounts) regions.emplace_back(dtype, n);
    }
    std::vector<Buffer> inputs;
    std::vector<std::vector<Buffer>> outputs(world);
    int64_t offset = 0;
    for (size_t k = 0; k < kSegmentCounts.size(); ++k) {
      for (int64_t i = 0; i < kSegmentCounts[k]; ++i)
        mine.Set(offset + i, Value(rank, k, i));
      inputs.push_back(mine.slice(offset, kSegmentCounts[k]));
      offset += kSegmentCounts[k];
    }
    for (int r = 0; r < world; ++r) {
      for (size_t k = 0; k < kSegmentCounts.size(); ++k) {
        outputs[r].push_back(regions[r * kSegmentCounts.size() + k].buffer());
      }
    }
    outputs[rank][2] = inputs[2];
    ASSERT_TRUE(comm.AllGatherSegments(inputs, outputs)->Wait().ok());
    ASSERT_TRUE(comm.AllGather(mine.buffer(), flat_out.buffer())->Wait().ok());
    for (int r = 0; r < world; ++r) {
      int64_t at = r * chunk;
      for (size_t k = 0; k < kSegmentCounts.size(); ++k) {
        const bool aliased = r == rank && k == 2;
        const TypedBuffer& got = regions[r * kSegmentCounts.size() + k];
        for (int64_t i = 0; i < kSegmentCounts[k]; ++i) {
          const double expected = flat_out.Get(at + i);
          ASSERT_EQ(aliased ? mine.Get(at - r * chunk + i) : got.Get(i),
                    expected)
              << "rank " << r << " segment " << k << " elem " << i;
        }
        at += kSegmentCounts[k];
      }
    }
  });
}

TEST_P(SegmentsTest, ReduceScatterMatchesRankOrderSum) {
  const int world = this->world();
  const DataType dtype = this->dtype();
  InMemoryStore store;
  auto comms = MakeComms(store, "rs-segments");
  ASSERT_EQ(comms.size(), static_cast<size_t>(world));
  RunOnRanks(world, [&](int rank) {
    Communicator& comm = *comms[rank];
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
      // inputs[r][k]: this rank's contribution to rank r's segment k.
      std::vector<TypedBuffer> contributions;
      std::vector<std::vector<Buffer>> inputs(world);
      for (int r = 0; r < world; ++r) {
        for (size_t k = 0; k < kSegmentCounts.size(); ++k) {
          TypedBuffer& t = contributions.emplace_back(
              dtype, RankCount(static_cast<int64_t>(k), r, world));
          for (int64_t i = 0; i < t.count(); ++i)
            t.Set(i, Value(rank, r * 100 + k, i));
        }
      }
      for (int r = 0; r < world; ++r) {
        for (size_t k = 0; k < kSegmentCounts.size(); ++k) {
          inputs[r].push_back(
              contributions[r * kSegmentCounts.size() + k].buffer());
        }
      }
      std::vector<TypedBuffer> results;
      std::vector<Buffer> outputs;
      int64_t total = 0;
      for (size_t k = 0; k < kSegmentCounts.size(); ++k) {
        results.emplace_back(dtype,
                             RankCount(static_cast<int64_t>(k), rank, world));
        total += results.back().count();
      }
      for (TypedBuffer& t : results) outputs.push_back(t.buffer());
      TypedBuffer scratch(dtype, comm.ReduceScatterScratchCount(total));
      ASSERT_TRUE(
          comm.ReduceScatterSegments(inputs, outputs, scratch.buffer(), op)
              ->Wait()
              .ok());
      // Reference: the kernel behind the flat ReduceScatter, over every
      // rank's contribution to us (recomputed here from Value) in rank order.
      for (size_t k = 0; k < kSegmentCounts.size(); ++k) {
        const int64_t n = results[k].count();
        TypedBuffer all(dtype, n * world), expected(dtype, n);
        for (int r = 0; r < world; ++r) {
          for (int64_t i = 0; i < n; ++i)
            all.Set(r * n + i, Value(r, rank * 100 + k, i));
        }
        ReduceChunks(all.buffer().data, world, n, dtype, op,
                     expected.buffer().data);
        for (int64_t i = 0; i < n; ++i) {
          ASSERT_EQ(results[k].Get(i), expected.Get(i))
              << "segment " << k << " elem " << i;
        }
      }
    }
  });
}

std::string SegmentsCaseName(
    const ::testing::TestParamInfo<SegmentsTest::ParamType>& info) {
  return absl::StrCat(std::get<0>(info.param), "_world",
                      std::get<1>(info.param), "_",
                      DataTypeName(std::get<2>(info.param)));
}

INSTANTIATE_TEST_SUITE_P(
    Worlds, SegmentsTest,
    ::testing::Combine(::testing::Values("gloo", "shm"),
                       ::testing::Values(1, 2, 3, 4),
                       ::testing::Values(DataType::kFloat32,
                                         DataType::kBFloat16)),
    SegmentsCaseName);

// Gloo's packing threshold at both ends: every segment on its own, and every
// segment packed into one message per peer (more than one round at world 3).
// The messages change, the results may not.
INSTANTIATE_TEST_SUITE_P(
    PackingKnob, SegmentsTest,
    ::testing::Combine(::testing::Values("gloo_unpacked", "gloo_packed"),
                       ::testing::Values(3),
                       ::testing::Values(DataType::kFloat32,
                                         DataType::kBFloat16)),
    SegmentsCaseName);

class SegmentsBackendTest : public ::testing::TestWithParam<std::string> {};

TEST_P(SegmentsBackendTest, BadArgumentsFailWithoutCommunicating) {
  constexpr int kWorld = 2;
  InMemoryStore store;
  auto comms =
      MakeBackendGroup(GetParam(), store, "segment-args", kWorld, kTimeout);
  RunOnRanks(kWorld, [&](int rank) {
    Communicator& comm = *comms[rank];
    TypedBuffer a(DataType::kFloat32, 4), b(DataType::kFloat32, 4),
        c(DataType::kFloat32, 3), h(DataType::kBFloat16, 4);
    // One list per rank is required.
    absl::Status status =
        comm.AllGatherSegments({a.buffer()}, {{b.buffer()}})->Wait();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_NE(status.message().find("AllGatherSegments"), std::string::npos)
        << status;
    // A receive segment of another size than the input names the segment.
    status = comm.AllGatherSegments({a.buffer()}, {{b.buffer()}, {c.buffer()}})
                 ->Wait();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_NE(status.message().find("segment 0 for rank 1"), std::string::npos)
        << status;
    // Mixed dtypes.
    status =
        comm.ReduceScatterSegments({{a.buffer()}, {h.buffer()}}, {b.buffer()},
                                   c.buffer(), ReduceOp::kSum)
            ->Wait();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    // Scratch too small for the peer's contributions (where one is needed;
    // shared memory sums straight out of its mailboxes).
    if (comm.ReduceScatterScratchCount(4) > 3) {
      status =
          comm.ReduceScatterSegments({{a.buffer()}, {b.buffer()}}, {b.buffer()},
                                     c.buffer(), ReduceOp::kSum)
              ->Wait();
      EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
      EXPECT_NE(status.message().find("scratch"), std::string::npos) << status;
    }
    // Nothing was sent: the communicator still works, in step on both ranks.
    EXPECT_TRUE(comm.Barrier()->Wait().ok());
  });
}

// A peer that never issues the segment collective: DEADLINE_EXCEEDED within the
// timeout, naming it; later calls fail fast.
TEST_P(SegmentsBackendTest, PeerThatNeverIssuesTimesOut) {
  constexpr int kWorld = 2;
  InMemoryStore store;
  auto comms = MakeBackendGroup(GetParam(), store, "segment-silent", kWorld,
                                kShortTimeout);
  TypedBuffer in(DataType::kFloat32, 4096), out(DataType::kFloat32, 4096);
  const absl::Time start = absl::Now();
  absl::Status status =
      comms[0]
          ->AllGatherSegments({in.buffer()}, {{in.buffer()}, {out.buffer()}})
          ->Wait();
  EXPECT_LT(absl::Now() - start, kShortTimeout + kSlack);
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_NE(status.message().find("AllGatherSegments"), std::string::npos)
      << status;
  status =
      comms[0]
          ->AllGatherSegments({in.buffer()}, {{in.buffer()}, {out.buffer()}})
          ->Wait();
  EXPECT_NE(status.message().find("failed earlier"), std::string::npos)
      << status;
}

INSTANTIATE_TEST_SUITE_P(Backends, SegmentsBackendTest,
                         ::testing::Values("gloo", "shm"));

// Found by UBSan (tests/sanitize.sh asan, shm_world2
// AllGatherMatchesFlatAllGather): an empty segment with null data inside the
// range reached memcpy(nullptr, .., 0), undefined behaviour. Empty segments are
// skipped; the others are visited exactly as before.
TEST(SegmentsTest, PiecesSkipEmptySegments) {
  float a[3], c[2];
  const std::vector<Buffer> segments = {
      Buffer{nullptr, 0, DataType::kFloat32}, Buffer{a, 3, DataType::kFloat32},
      Buffer{nullptr, 0, DataType::kFloat32}, Buffer{c, 2, DataType::kFloat32},
      Buffer{nullptr, 0, DataType::kFloat32}};
  std::vector<std::vector<size_t>> pieces;
  ForEachSegmentPiece(
      segments, 4, 12,
      [&](size_t k, size_t in_segment, size_t in_range, size_t len) {
        EXPECT_NE(segments[k].data, nullptr);
        pieces.push_back({k, in_segment, in_range, len});
      });
  // Bytes [4, 16): the last 8 bytes of a, then the first 4 of c.
  const std::vector<std::vector<size_t>> expected = {{1, 4, 0, 8},
                                                     {3, 0, 8, 4}};
  EXPECT_EQ(pieces, expected);
}

// The interface's defaults: a backend without segment support says so.
TEST(SegmentsTest, DefaultIsUnimplemented) {
  class Minimal final : public Communicator {
   public:
    int rank() const override { return 0; }
    int size() const override { return 1; }
    std::string name() const override { return "minimal"; }
    std::unique_ptr<Work> AllGather(const Buffer&, const Buffer&) override {
      return nullptr;
    }
    std::unique_ptr<Work> ReduceScatter(const Buffer&, const Buffer&,
                                        ReduceOp) override {
      return nullptr;
    }
    std::unique_ptr<Work> AllReduce(const Buffer&, ReduceOp) override {
      return nullptr;
    }
    std::unique_ptr<Work> Broadcast(const Buffer&, int) override {
      return nullptr;
    }
    std::unique_ptr<Work> Barrier() override { return nullptr; }
  } minimal;
  EXPECT_FALSE(minimal.SupportsSegments());
  absl::Status status = minimal.AllGatherSegments({}, {{}})->Wait();
  EXPECT_EQ(status.code(), absl::StatusCode::kUnimplemented) << status;
  EXPECT_NE(status.message().find("minimal"), std::string::npos) << status;
  status =
      minimal.ReduceScatterSegments({{}}, {}, Buffer{}, ReduceOp::kSum)->Wait();
  EXPECT_EQ(status.code(), absl::StatusCode::kUnimplemented) << status;
}

}  // namespace
}  // namespace hsdp::comm
