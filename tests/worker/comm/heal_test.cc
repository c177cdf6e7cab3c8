// HealState: targets end bitwise equal to the sources, reading a part from
// each source, over Gloo TCP, shared memory (which delegates point-to-point to
// Gloo) and the broadcast fallback of backends without SendRecv.
#include "worker/comm/heal.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/worker/comm/comm_test_util.h"
#include "worker/comm/forwarding_communicator.h"
#include "worker/comm/store/in_memory_store.h"

namespace hsdp::comm {
namespace {

using ::hsdp::comm::testing::MakeBackendGroup;
using ::hsdp::comm::testing::RunOnRanks;

constexpr absl::Duration kTimeout = absl::Seconds(60);

TEST(HealPartTest, PartsCoverTheStateAlignedAndBalanced) {
  for (size_t total : {size_t{0}, size_t{1}, size_t{63}, size_t{64},
                       size_t{1000003}, size_t{64 * 7}}) {
    for (int n = 1; n <= 5; ++n) {
      size_t expect_begin = 0, smallest = total, largest = 0;
      for (int i = 0; i < n; ++i) {
        const ByteRange r = HealPart(total, n, i);
        EXPECT_EQ(r.begin, expect_begin) << total << " " << n << " " << i;
        EXPECT_LE(r.begin, r.end);
        if (r.end != total) {
          EXPECT_EQ(r.end % kHealPartAlign, 0u);
        }
        expect_begin = r.end;
        smallest = std::min(smallest, r.size());
        largest = std::max(largest, r.size());
      }
      EXPECT_EQ(expect_begin, total) << total << " " << n;
      EXPECT_LE(largest - smallest, kHealPartAlign) << total << " " << n;
    }
  }
}

// Forwards to a Gloo communicator but offers no SendRecv, so HealState takes
// its broadcast path (as on NCCL), and counts the broadcasts.
class NoSendRecv final : public ForwardingCommunicator {
 public:
  explicit NoSendRecv(std::unique_ptr<Communicator> inner)
      : ForwardingCommunicator(std::move(inner)) {}
  std::string name() const override { return "broadcast-only"; }
  bool SupportsSendRecv() const override { return false; }
  std::unique_ptr<Work> SendRecv(
      const std::vector<PeerTransfer>& sends,
      const std::vector<PeerTransfer>& recvs) override {
    return Communicator::SendRecv(sends, recvs);
  }
  std::unique_ptr<Work> Broadcast(const Buffer& b, int root) override {
    ++broadcasts;
    return ForwardingCommunicator::Broadcast(b, root);
  }
  int broadcasts = 0;
};

// splitmix64: cheap, distinct bytes everywhere.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// A shard's state of mixed dtypes and sizes (an empty tensor too, and an
// int64 step counter), as owned byte vectors.
struct State {
  State() {
    for (size_t bytes : {size_t{4} * 300007, size_t{2} * 777, size_t{8},
                         size_t{0}, size_t{65}, size_t{4} * 4096}) {
      storage.emplace_back(bytes);
    }
  }
  std::vector<Buffer> buffers() {
    std::vector<Buffer> out;
    for (auto& s : storage) {
      out.push_back(
          Buffer{s.data(), static_cast<int64_t>(s.size()), DataType::kUInt8});
    }
    return out;
  }
  void Fill(uint64_t seed) {
    for (auto& s : storage) {
      for (size_t i = 0; i < s.size(); ++i) {
        s[i] = static_cast<char>(Mix(seed + i) & 0xff);
      }
      seed += s.size();
    }
  }
  bool operator==(const State& o) const { return storage == o.storage; }
  std::vector<std::vector<char>> storage;
};

struct HealCase {
  std::string backend;  // "gloo", "shm", "broadcast"
  int world;
  std::vector<int> sources;
  std::vector<int> targets;
};

class HealTest : public ::testing::TestWithParam<HealCase> {};

TEST_P(HealTest, TargetsEndBitwiseEqualToTheSources) {
  const HealCase& c = GetParam();
  InMemoryStore store;
  std::vector<std::unique_ptr<Communicator>> comms = MakeBackendGroup(
      c.backend == "shm" ? "shm" : "gloo", store, "heal", c.world, kTimeout);
  ASSERT_EQ(comms.size(), static_cast<size_t>(c.world));
  std::vector<NoSendRecv*> wrapped;
  if (c.backend == "broadcast") {
    for (auto& comm : comms) {
      auto w = std::make_unique<NoSendRecv>(std::move(comm));
      wrapped.push_back(w.get());
      comm = std::move(w);
    }
  }
  std::vector<State> states(c.world);
  State expected;
  expected.Fill(42);
  for (int r : c.sources) states[r].Fill(42);
  for (int r : c.targets) {
    // Not memset: the empty buffer's data() is null (UBSan).
    for (auto& s : states[r].storage) std::fill(s.begin(), s.end(), '\xab');
  }
  HealRoles roles{c.sources, c.targets};
  RunOnRanks(c.world, [&](int rank) {
    const absl::Status s =
        HealState(*comms[rank], roles, states[rank].buffers());
    EXPECT_TRUE(s.ok()) << s;
  });
  for (int r = 0; r < c.world; ++r) {
    const bool involved =
        std::count(c.sources.begin(), c.sources.end(), r) +
            std::count(c.targets.begin(), c.targets.end(), r) >
        0;
    EXPECT_TRUE(states[r] == (involved ? expected : State())) << "rank " << r;
  }
  if (c.backend == "broadcast") {
    // One broadcast per piece: every part came from its own source.
    EXPECT_GE(wrapped[0]->broadcasts, static_cast<int>(c.sources.size()));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Plans, HealTest,
    ::testing::Values(HealCase{"gloo", 4, {0, 2}, {1, 3}},
                      HealCase{"gloo", 4, {3, 0, 1}, {2}},
                      HealCase{"gloo", 2, {0}, {1}},
                      HealCase{"shm", 4, {0, 2}, {1, 3}},
                      HealCase{"broadcast", 3, {2, 0}, {1}},
                      HealCase{"broadcast", 4, {2}, {0}},
                      // A rank in neither list takes part without data.
                      HealCase{"gloo", 3, {0}, {2}}),
    [](const ::testing::TestParamInfo<HealCase>& info) {
      std::string name = info.param.backend + "_" +
                         std::to_string(info.param.sources.size()) + "to" +
                         std::to_string(info.param.targets.size()) + "_of" +
                         std::to_string(info.param.world);
      return name;
    });

TEST(HealStateTest, NonsenseRolesAreInvalidWithoutCommunicating) {
  InMemoryStore store;
  auto comms = MakeBackendGroup("gloo", store, "heal-bad", 2, kTimeout);
  ASSERT_EQ(comms.size(), 2u);
  State state;
  for (const HealRoles& roles :
       {HealRoles{{0}, {0}}, HealRoles{{}, {1}}, HealRoles{{0, 0}, {1}},
        HealRoles{{2}, {1}}, HealRoles{{0}, {-1}}}) {
    const absl::Status s = HealState(*comms[0], roles, state.buffers());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  }
  // Nothing to heal: OK without communicating (the peer never calls).
  EXPECT_TRUE(
      HealState(*comms[0], HealRoles{{0, 1}, {}}, state.buffers()).ok());
}

}  // namespace
}  // namespace hsdp::comm
