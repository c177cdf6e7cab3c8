// Membership basics: joins into the open first generation, refusals, later
// joiners, heartbeats, finishing, options, and restarts on a state directory.
// The elastic scenarios (shrink, grow, commits) are in elastic_test.cc.
#include "coordinator/core/membership.h"

#include <gtest/gtest.h>

#include <functional>

#include "tests/coordinator/membership_test_util.h"

namespace hsdp::coordinator {
namespace {

using testing::FreshDir;
using testing::kHeartbeatTimeout;
using testing::MakeUnits;

class MembershipTest : public testing::MembershipFixture {
 protected:
  // Joins ranks 0 ("a") and 1 ("b") of a 1xworld job persisted in `dir`, as a
  // coordinator that then dies; `before_exit` may change more.
  std::vector<int64_t> PersistTwoMembers(
      const std::string& dir, int world,
      const std::function<void(Membership&)>& before_exit = nullptr) {
    auto store = StateStore::Open(dir);
    EXPECT_TRUE(store.ok());
    auto m = Make({1, world}, store->get());
    std::vector<int64_t> ids = {m->Join(Args(0, "a"))->worker_id,
                                m->Join(Args(1, "b"))->worker_id};
    if (before_exit) before_exit(*m);
    return ids;
  }
};

TEST_F(MembershipTest, HintThenFirstComeAndCoordinates) {
  auto m = Make({2, 2});
  EXPECT_EQ(m->job_state(), hsdp::v1::JOB_STATE_WAITING);
  absl::StatusOr<JoinResult> a = m->Join(Args(3, "h3"));
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_TRUE(a->member);
  EXPECT_EQ(a->rank, 3);
  EXPECT_EQ(a->coord, (MeshCoord{1, 1}));
  EXPECT_TRUE(a->established_model);
  EXPECT_EQ(a->generation.generation(), 0);
  EXPECT_EQ(a->state, hsdp::v1::WORKER_STATE_ALIVE);
  absl::StatusOr<JoinResult> b = m->Join(Args(std::nullopt, "hb"));
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->rank, 0);
  EXPECT_FALSE(b->established_model);
  EXPECT_NE(b->worker_id, a->worker_id);
  EXPECT_EQ(m->Join(Args(-1, "hc"))->rank, 1);  // negative hint: no preference
  EXPECT_EQ(m->Join(Args(std::nullopt, "hd"))->rank, 2);
  EXPECT_EQ(m->job_state(), hsdp::v1::JOB_STATE_RUNNING);
  EXPECT_EQ(m->workers_alive(), 4);
  EXPECT_EQ(m->model(), "gpt-tiny");
  EXPECT_EQ(m->units().size(), 3u);
  // The first generation's description: every rank's worker id, in order.
  const hsdp::v1::Generation g = m->current_generation();
  EXPECT_EQ(g.worker_ids(3), a->worker_id);
  EXPECT_EQ(g.worker_ids(0), b->worker_id);
  EXPECT_EQ(g.mesh().replicate(), 2);
  EXPECT_EQ(g.start_step(), 0);
}

TEST_F(MembershipTest, RefusalsChangeNothing) {
  auto m = Make({1, 2});
  ASSERT_TRUE(m->Join(Args(1, "host-a")).ok());

  absl::StatusOr<JoinResult> dup = m->Join(Args(1, "host-b"));
  EXPECT_EQ(dup.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(dup.status().message(), "rank 1 is taken by host host-a");

  EXPECT_EQ(m->Join(Args(2, "h")).status().code(),
            absl::StatusCode::kInvalidArgument);

  UnitList other = MakeUnits(2);
  other[2].set_param_bytes(1);
  absl::StatusOr<JoinResult> mismatch = m->Join(Args(std::nullopt, "h", other));
  EXPECT_EQ(mismatch.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(mismatch.status().message().find("unit 2 differs: got layers.1"),
            std::string::npos)
      << mismatch.status();

  JoinArgs wrong_model = Args(std::nullopt, "h");
  wrong_model.model = "gpt-small";
  EXPECT_EQ(m->Join(wrong_model).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(m->Join(Args(std::nullopt, "h", {})).status().code(),
            absl::StatusCode::kInvalidArgument);
  JoinArgs unknown_id = Args(std::nullopt, "h");
  unknown_id.worker_id = 999;
  EXPECT_EQ(m->Join(unknown_id).status().code(), absl::StatusCode::kNotFound);

  EXPECT_EQ(m->Workers().size(), 1u);
  EXPECT_EQ(m->generation(), 0);
}

// Once the first generation is full, a joiner waits (JOINING) for a
// generation that includes it; spares are capped at the world size.
TEST_F(MembershipTest, LateJoinersWaitAndAreCapped) {
  auto m = Make({1, 2});
  JoinAll(*m);
  absl::StatusOr<JoinResult> late = m->Join(Args(std::nullopt, "late"));
  ASSERT_TRUE(late.ok()) << late.status();
  EXPECT_FALSE(late->member);
  EXPECT_EQ(late->rank, -1);
  EXPECT_EQ(late->state, hsdp::v1::WORKER_STATE_JOINING);
  // A hint means nothing once the first generation is full.
  absl::StatusOr<JoinResult> hinted = m->Join(Args(0, "hinted"));
  ASSERT_TRUE(hinted.ok());
  EXPECT_FALSE(hinted->member);
  absl::StatusOr<JoinResult> full = m->Join(Args(std::nullopt, "third"));
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(m->Workers().size(), 4u);
  EXPECT_EQ(m->Status().joining, 2);
  // A member-only call from a joiner says what to do.
  EXPECT_EQ(m->ResolveMember(late->worker_id, 0, std::nullopt).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

// While the first generation is open, a silent worker's rank is simply freed
// (nobody trained yet) and the next joiner takes it.
TEST_F(MembershipTest, OpenGenerationFreesTheRankOfALostWorker) {
  auto m = Make({1, 3});
  const int64_t a = m->Join(Args(0, "a"))->worker_id;
  const int64_t b = m->Join(Args(1, "b"))->worker_id;
  clock_.Advance(absl::Seconds(6));
  Beat(*m, {a});
  clock_.Advance(absl::Seconds(6));  // b silent for 12 s, a for 6 s
  EXPECT_EQ(m->Tick(), (std::vector<int64_t>{b}));
  EXPECT_EQ(m->generation(), 0);
  EXPECT_EQ(m->job_state(), hsdp::v1::JOB_STATE_WAITING);
  EXPECT_EQ(StateOf(*m, b), hsdp::v1::WORKER_STATE_LOST);
  EXPECT_EQ(m->Heartbeat(b, -1, 5).status().code(),
            absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<JoinResult> again = m->Join(Args(1, "b"));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->rank, 1);
  EXPECT_NE(again->worker_id, b);  // a new incarnation
  EXPECT_EQ(m->generation(), 0);
}

// Hostnames by rank in the current generation.
std::vector<std::string> HostsByRank(Membership& m) {
  std::vector<std::string> hosts(m.world_size());
  for (const WorkerSnapshot& w : m.Workers()) {
    if (w.rank >= 0) hosts[w.rank] = w.hostname;
  }
  return hosts;
}

// Without hints, joiners from two hosts arriving interleaved still make shard
// groups of one host each: HSDP's all-gathers stay on the host.
TEST_F(MembershipTest, HintlessJoinersFillShardGroupsByHost) {
  auto m = Make({2, 2});
  std::vector<int> ranks;
  for (const char* host : {"a", "b", "a", "b"}) {
    absl::StatusOr<JoinResult> j = m->Join(Args(std::nullopt, host));
    ASSERT_TRUE(j.ok()) << j.status();
    ranks.push_back(j->rank);
  }
  EXPECT_EQ(ranks, (std::vector<int>{0, 2, 1, 3}));
  EXPECT_EQ(m->job_state(), hsdp::v1::JOB_STATE_RUNNING);
  EXPECT_EQ(HostsByRank(*m), (std::vector<std::string>{"a", "a", "b", "b"}));
  EXPECT_TRUE(m->Status().topology_warnings.empty());
  EXPECT_TRUE(listener_.topology.empty());
}

// A shard group with a rank taken on another host is passed over, and a
// joiner that reports no host takes the lowest free rank.
TEST_F(MembershipTest, HostPlacementAroundHintsAndUnknownHosts) {
  auto m = Make({3, 2});
  EXPECT_EQ(m->Join(Args(2, "a"))->rank, 2);             // group 1: a
  EXPECT_EQ(m->Join(Args(std::nullopt, "b"))->rank, 0);  // empty group 0
  EXPECT_EQ(m->Join(Args(std::nullopt, "a"))->rank, 3);  // beside a
  EXPECT_EQ(m->Join(Args(std::nullopt, ""))->rank, 1);   // lowest free
  // Groups 0 (b + unknown) and 1 (a, a) are taken; group 2 is empty.
  EXPECT_EQ(m->Join(Args(std::nullopt, "c"))->rank, 4);
  // Nothing left on c's host or empty for d: the lowest free rank.
  EXPECT_EQ(m->Join(Args(std::nullopt, "d"))->rank, 5);
  EXPECT_EQ(m->Status().topology_warnings,
            (std::vector<std::string>{
                "shard group 2 spans hosts c, d (its all-gathers cross the "
                "host link)"}));
}

// Rank hints win over hosts; the layout they force is said, once when the
// generation forms and in Status while it runs.
TEST_F(MembershipTest, HintsWinAndACrossHostLayoutIsSaid) {
  auto m = Make({2, 2});
  const std::vector<std::string> hosts = {"a", "b", "a", "b"};
  for (int r = 0; r < 4; ++r) {
    absl::StatusOr<JoinResult> j = m->Join(Args(r, hosts[r]));
    ASSERT_TRUE(j.ok()) << j.status();
    EXPECT_EQ(j->rank, r);
    if (r < 3) {
      EXPECT_TRUE(listener_.topology.empty()) << "still open";
    }
  }
  EXPECT_EQ(HostsByRank(*m), hosts);
  const std::vector<std::string> warnings = {
      "shard group 0 spans hosts a, b (its all-gathers cross the host link)",
      "shard group 1 spans hosts a, b (its all-gathers cross the host link)"};
  EXPECT_EQ(m->Status().topology_warnings, warnings);
  EXPECT_EQ(listener_.topology,
            (std::vector<std::string>{"generation 0: " + warnings[0],
                                      "generation 0: " + warnings[1]}));
}

// Shard groups spanning hosts in equal runs: the generation carries the run
// length (workers build their host groups from it) and the listener hears it.
TEST_F(MembershipTest, ShardGroupsAcrossHostsInRunsGiveTheHostGroupSize) {
  auto m = Make({1, 4});
  const std::vector<std::string> hosts = {"a", "a", "b", "b"};
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(m->current_generation().host_group_size(), 0) << "still open";
    ASSERT_TRUE(m->Join(Args(r, hosts[r])).ok());
  }
  EXPECT_EQ(HostsByRank(*m), hosts);
  EXPECT_EQ(m->current_generation().host_group_size(), 2);
  EXPECT_EQ(listener_.host_group_sizes, (std::vector<int>{2}));
  // Within one host per shard group there is no host group.
  auto inside = Make({2, 2});
  for (const char* host : {"a", "a", "b", "b"}) {
    ASSERT_TRUE(inside->Join(Args(std::nullopt, host)).ok());
  }
  EXPECT_EQ(inside->current_generation().host_group_size(), 0);
}

TEST_F(MembershipTest, UnknownWorkersAndRanks) {
  auto m = Make({1, 2});
  EXPECT_EQ(m->Heartbeat(0, 0, 0).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(m->Heartbeat(0, 5, 0).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(m->Heartbeat(77, -1, 0).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(m->ResolveMember(0, -1, std::nullopt).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(m->MarkFinished(0, 1).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(m->AwaitGeneration(5, -1, absl::Now()).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(m->CheckJobId("job").ok());
  EXPECT_EQ(m->CheckJobId("other").code(), absl::StatusCode::kNotFound);
}

TEST_F(MembershipTest, FinishedAndDraining) {
  auto m = Make({1, 2});
  const std::vector<int64_t> ids = JoinAll(*m);
  m->SetDraining(true);
  EXPECT_EQ(m->job_state(), hsdp::v1::JOB_STATE_DRAINING);
  ASSERT_TRUE(m->MarkFinished(ids[0], 0).ok());
  // Finished workers are not lost by silence.
  clock_.Advance(kHeartbeatTimeout * 3);
  Beat(*m, {ids[1]});
  EXPECT_TRUE(m->Tick().empty());
  EXPECT_EQ(m->generation(), 0);
  ASSERT_TRUE(m->MarkFinished(0, 1).ok());  // by rank, as old clients do
  EXPECT_EQ(m->job_state(), hsdp::v1::JOB_STATE_FINISHED);
  EXPECT_EQ(StateOf(*m, ids[1]), hsdp::v1::WORKER_STATE_FINISHED);
  // A finished worker asking for its next generation is told to stop.
  absl::StatusOr<AwaitResult> r =
      m->AwaitGeneration(ids[0], 0, absl::Now() + absl::Seconds(1));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->outcome, hsdp::v1::AWAIT_OUTCOME_EXIT);
}

TEST_F(MembershipTest, RejectsBadOptions) {
  Membership::Options options;
  options.job_id = "job";
  options.world_size = 4;
  options.mesh = {3, 2};
  EXPECT_EQ(Membership::Create(options, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  options.mesh = {2, 2};
  options.heartbeat_timeout = absl::ZeroDuration();
  EXPECT_EQ(Membership::Create(options, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  options.heartbeat_timeout = absl::Seconds(1);
  options.min_replicas = 3;
  absl::Status s = Membership::Create(options, nullptr).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("min replicas 3"), std::string::npos) << s;
  options.min_replicas = 1;
  options.join_wait = absl::Seconds(-1);
  EXPECT_EQ(Membership::Create(options, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(MembershipTest, RestoresAfterCoordinatorRestart) {
  const std::string dir = FreshDir("state");
  const std::vector<int64_t> ids = PersistTwoMembers(dir, 3);
  auto store = StateStore::Open(dir);
  ASSERT_TRUE(store.ok());
  auto m = Make({1, 3}, store->get());
  EXPECT_EQ(m->generation(), 0);
  EXPECT_EQ(m->model(), "gpt-tiny");
  EXPECT_EQ(m->units().size(), 3u);
  ASSERT_EQ(m->Workers().size(), 2u);
  EXPECT_TRUE(m->Workers()[0].restored);
  EXPECT_EQ(m->Workers()[1].hostname, "b");
  EXPECT_EQ(m->workers_alive(), 2);
  // Workers simply continue: a heartbeat confirms a restored worker.
  ASSERT_TRUE(m->Heartbeat(ids[0], -1, 10).ok());
  EXPECT_FALSE(m->Workers()[0].restored);
  // Another host claiming a restored rank is a duplicate.
  EXPECT_EQ(m->Join(Args(1, "intruder")).status().code(),
            absl::StatusCode::kAlreadyExists);
  // Re-joining with its worker id takes the place back, same rank and
  // generation.
  JoinArgs back = Args(std::nullopt, "b");
  back.worker_id = ids[1];
  absl::StatusOr<JoinResult> r = m->Join(back);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->replaced);
  EXPECT_EQ(r->worker_id, ids[1]);
  EXPECT_EQ(r->rank, 1);
  EXPECT_EQ(r->generation.generation(), 0);
  // New ids never reuse old ones.
  absl::StatusOr<JoinResult> c = m->Join(Args(2, "c"));
  ASSERT_TRUE(c.ok());
  EXPECT_GT(c->worker_id, ids[1]);
  // The restored model still gates joins.
  EXPECT_EQ(m->Join(Args(std::nullopt, "d", MakeUnits(3))).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // A store of another job is refused.
  Membership::Options options;
  options.job_id = "other-job";
  options.world_size = 3;
  options.mesh = {1, 3};
  EXPECT_EQ(Membership::Create(options, store->get()).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

// Clients without worker ids take their restored place back by rank hint
// from the same host.
TEST_F(MembershipTest, RejoinByHintFromTheSameHostAfterRestart) {
  const std::string dir = FreshDir("state");
  const std::vector<int64_t> ids = PersistTwoMembers(dir, 2);
  auto store = StateStore::Open(dir);
  ASSERT_TRUE(store.ok());
  auto m = Make({1, 2}, store->get());
  absl::StatusOr<JoinResult> r = m->Join(Args(1, "b"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->replaced);
  EXPECT_EQ(r->worker_id, ids[1]);
  EXPECT_EQ(r->rank, 1);
}

TEST_F(MembershipTest, RestoredSilentWorkersGetLost) {
  const std::string dir = FreshDir("state");
  const std::vector<int64_t> ids = PersistTwoMembers(dir, 2);
  auto store = StateStore::Open(dir);
  ASSERT_TRUE(store.ok());
  auto m = Make({1, 2}, store->get());
  clock_.Advance(absl::Seconds(5));
  Beat(*m, {ids[0]});
  clock_.Advance(absl::Seconds(6));
  EXPECT_EQ(m->Tick(), (std::vector<int64_t>{ids[1]}));
  EXPECT_EQ(m->job_state(), hsdp::v1::JOB_STATE_REFORMING);
  // The loss is persisted (read back once the first store let go of the
  // directory's lock).
  m.reset();
  store->reset();
  auto reopened = StateStore::Open(dir);
  ASSERT_TRUE(reopened.ok());
  bool lost_persisted = false;
  const PersistedState state = (*reopened)->state();
  for (const auto& w : state.workers()) {
    lost_persisted |=
        w.worker_id() == ids[1] && w.state() == hsdp::v1::WORKER_STATE_LOST;
  }
  EXPECT_TRUE(lost_persisted);
}

}  // namespace
}  // namespace hsdp::coordinator
