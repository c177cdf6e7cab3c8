#include "coordinator/membership.h"

#include <gtest/gtest.h>

#include <functional>

#include "tests/coordinator/core_test_util.h"

namespace hsdp::coordinator {
namespace {

using hsdp::v1::JobState;
using testing::FreshDir;
using testing::MakeUnits;

constexpr absl::Duration kTimeout = absl::Seconds(10);

class MembershipTest : public ::testing::Test {
 protected:
  std::unique_ptr<Membership> Make(int world, MeshShape mesh,
                                   StateStore* store = nullptr) {
    Membership::Options options;
    options.job_id = "job";
    options.world_size = world;
    options.mesh = mesh;
    options.heartbeat_timeout = kTimeout;
    options.clock = &clock_;
    auto m = Membership::Create(options, store);
    EXPECT_TRUE(m.ok()) << m.status();
    return m.ok() ? std::move(*m) : nullptr;
  }

  static JoinArgs Args(std::optional<int> hint, const std::string& host,
                       UnitList units = MakeUnits(2)) {
    JoinArgs args;
    args.rank_hint = hint;
    args.hostname = host;
    args.device = "cpu";
    args.model = "gpt-tiny";
    args.units = std::move(units);
    return args;
  }

  // Joins ranks 0 ("a") and 1 ("b") of a 1xworld job persisted in `dir`, as a
  // coordinator that then dies; `before_exit` may change more.
  void PersistTwoMembers(
      const std::string& dir, int world,
      const std::function<void(Membership&)>& before_exit = nullptr) {
    auto store = StateStore::Open(dir);
    ASSERT_TRUE(store.ok());
    auto m = Make(world, {1, world}, store->get());
    ASSERT_TRUE(m->Join(Args(0, "a")).ok());
    ASSERT_TRUE(m->Join(Args(1, "b")).ok());
    if (before_exit) before_exit(*m);
  }

  FakeClock clock_;
};

TEST_F(MembershipTest, HintThenFirstComeAndCoordinates) {
  auto m = Make(4, {2, 2});
  EXPECT_EQ(m->job_state(), hsdp::v1::JOB_STATE_WAITING);
  absl::StatusOr<JoinResult> a = m->Join(Args(3, "h3"));
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->rank, 3);
  EXPECT_EQ(a->coord, (MeshCoord{1, 1}));
  EXPECT_TRUE(a->established_model);
  EXPECT_EQ(a->generation, 0);
  absl::StatusOr<JoinResult> b = m->Join(Args(std::nullopt, "hb"));
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->rank, 0);
  EXPECT_FALSE(b->established_model);
  EXPECT_EQ(m->Join(Args(-1, "hc"))->rank, 1);  // negative hint: no preference
  EXPECT_EQ(m->Join(Args(std::nullopt, "hd"))->rank, 2);
  EXPECT_EQ(m->job_state(), hsdp::v1::JOB_STATE_RUNNING);
  EXPECT_EQ(m->workers_alive(), 4);
  EXPECT_EQ(m->model(), "gpt-tiny");
  EXPECT_EQ(m->units().size(), 3u);
}

TEST_F(MembershipTest, RefusalsChangeNothing) {
  auto m = Make(2, {1, 2});
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

  EXPECT_EQ(m->Workers().size(), 1u);
  EXPECT_EQ(m->generation(), 0);

  ASSERT_TRUE(m->Join(Args(std::nullopt, "h0")).ok());
  absl::StatusOr<JoinResult> full = m->Join(Args(std::nullopt, "late"));
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(m->Workers().size(), 2u);
}

TEST_F(MembershipTest, HeartbeatTimeoutLosesWorkerAndBumpsGeneration) {
  auto m = Make(2, {1, 2});
  ASSERT_TRUE(m->Join(Args(0, "a")).ok());
  ASSERT_TRUE(m->Join(Args(1, "b")).ok());
  clock_.Advance(absl::Seconds(6));
  ASSERT_TRUE(m->Heartbeat(0, 5).ok());
  clock_.Advance(absl::Seconds(6));  // rank 1 silent for 12 s, rank 0 for 6 s
  EXPECT_EQ(m->SweepHeartbeats(), (std::vector<int>{1}));
  EXPECT_EQ(m->job_state(), hsdp::v1::JOB_STATE_DEGRADED);
  EXPECT_EQ(m->generation(), 1);
  EXPECT_EQ(m->workers_alive(), 1);
  EXPECT_TRUE(m->SweepHeartbeats().empty());  // no second bump
  EXPECT_EQ(m->generation(), 1);

  EXPECT_EQ(m->Heartbeat(1, 5).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(m->CheckMember(1).code(), absl::StatusCode::kFailedPrecondition);
  const auto workers = m->Workers();
  EXPECT_EQ(workers[1].state, hsdp::v1::WORKER_STATE_LOST);
  EXPECT_EQ(workers[1].heartbeat_age, absl::Seconds(12));
  EXPECT_EQ(workers[0].step, 5);

  // A replacement without a hint takes the lost slot; the generation stays.
  absl::StatusOr<JoinResult> again = m->Join(Args(std::nullopt, "b2"));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->rank, 1);
  EXPECT_TRUE(again->replaced);
  EXPECT_EQ(again->generation, 1);
  EXPECT_EQ(m->job_state(), hsdp::v1::JOB_STATE_RUNNING);
}

TEST_F(MembershipTest, RejoinWithHintAfterLoss) {
  auto m = Make(1, {1, 1});
  ASSERT_TRUE(m->Join(Args(0, "a")).ok());
  clock_.Advance(kTimeout + absl::Seconds(1));
  // The join itself sweeps: the timed-out holder no longer blocks its rank.
  absl::StatusOr<JoinResult> r = m->Join(Args(0, "a"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->replaced);
  EXPECT_EQ(r->generation, 1);
}

TEST_F(MembershipTest, UnknownRanks) {
  auto m = Make(2, {1, 2});
  EXPECT_EQ(m->Heartbeat(0, 0).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(m->Heartbeat(5, 0).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(m->CheckMember(-1).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(m->MarkFinished(1).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(m->CheckJobId("job").ok());
  EXPECT_EQ(m->CheckJobId("other").code(), absl::StatusCode::kNotFound);
}

TEST_F(MembershipTest, FinishedAndDraining) {
  auto m = Make(2, {1, 2});
  ASSERT_TRUE(m->Join(Args(0, "a")).ok());
  ASSERT_TRUE(m->Join(Args(1, "b")).ok());
  m->SetDraining(true);
  EXPECT_EQ(m->job_state(), hsdp::v1::JOB_STATE_DRAINING);
  ASSERT_TRUE(m->MarkFinished(0).ok());
  // Finished workers are not lost by silence, and their rank stays taken.
  clock_.Advance(kTimeout * 3);
  ASSERT_TRUE(m->Heartbeat(1, 0).code() == absl::StatusCode::kOk);
  EXPECT_TRUE(m->SweepHeartbeats().empty());
  EXPECT_EQ(m->Join(Args(0, "x")).status().code(),
            absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(m->MarkFinished(1).ok());
  EXPECT_EQ(m->job_state(), hsdp::v1::JOB_STATE_FINISHED);
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
}

TEST_F(MembershipTest, RestoresAfterCoordinatorRestart) {
  const std::string dir = FreshDir("state");
  PersistTwoMembers(dir, 3,
                    [](Membership& m) { EXPECT_EQ(m.BumpGeneration(), 1); });
  auto store = StateStore::Open(dir);
  ASSERT_TRUE(store.ok());
  auto m = Make(3, {1, 3}, store->get());
  EXPECT_EQ(m->generation(), 1);
  EXPECT_EQ(m->model(), "gpt-tiny");
  EXPECT_EQ(m->units().size(), 3u);
  ASSERT_EQ(m->Workers().size(), 2u);
  EXPECT_TRUE(m->Workers()[0].restored);
  EXPECT_EQ(m->Workers()[1].hostname, "b");
  EXPECT_EQ(m->workers_alive(), 2);
  // Workers simply continue: a heartbeat confirms a restored rank.
  ASSERT_TRUE(m->Heartbeat(0, 10).ok());
  EXPECT_FALSE(m->Workers()[0].restored);
  // Another host claiming a restored rank is a duplicate.
  EXPECT_EQ(m->Join(Args(1, "intruder")).status().code(),
            absl::StatusCode::kAlreadyExists);
  // Or re-join with their rank hint: allowed, without a new generation.
  absl::StatusOr<JoinResult> r = m->Join(Args(1, "b"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->replaced);
  EXPECT_EQ(r->generation, 1);
  // The restored model still gates joins.
  UnitList other = MakeUnits(3);
  EXPECT_EQ(m->Join(Args(2, "c", other)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // A store of another job is refused.
  Membership::Options options;
  options.job_id = "other-job";
  options.world_size = 3;
  options.mesh = {1, 3};
  EXPECT_EQ(Membership::Create(options, store->get()).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(MembershipTest, RestoredSilentWorkersGetLost) {
  const std::string dir = FreshDir("state");
  PersistTwoMembers(dir, 2);
  auto store = StateStore::Open(dir);
  ASSERT_TRUE(store.ok());
  auto m = Make(2, {1, 2}, store->get());
  clock_.Advance(absl::Seconds(5));
  ASSERT_TRUE(m->Heartbeat(0, 1).ok());
  clock_.Advance(absl::Seconds(6));
  EXPECT_EQ(m->SweepHeartbeats(), (std::vector<int>{1}));
  EXPECT_EQ(m->generation(), 1);
  // The bumped generation is persisted (read back once the first store let go
  // of the directory's lock).
  m.reset();
  store->reset();
  auto reopened = StateStore::Open(dir);
  ASSERT_TRUE(reopened.ok());
  EXPECT_EQ((*reopened)->state().generation(), 1);
}

}  // namespace
}  // namespace hsdp::coordinator
