// Elastic membership scenarios on a fake clock, the worker side driven from
// threads: shrink on a failure report (no heartbeat wait) and on a heartbeat
// loss, eviction at a step boundary, commit/abort races, grow with a joiner
// (roles and heal plan), standby, too few replicas, no live copy, and a
// coordinator restart in the middle.
#include <gtest/gtest.h>

#include <future>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "tests/coordinator/membership_test_util.h"

namespace hsdp::coordinator {
namespace {

using hsdp::v1::AwaitOutcome;
using hsdp::v1::GenerationRole;
using testing::FreshDir;
using testing::kHeartbeatTimeout;
using testing::kJoinWait;
using testing::kPoll;
using testing::kReformWindow;

constexpr absl::Duration kShortPoll = absl::Milliseconds(100);

class ElasticTest : public testing::MembershipFixture {
 protected:
  // What a worker does after its generation ended: call again (confirming)
  // until the answer is not ENDED.
  static absl::StatusOr<AwaitResult> Confirm(Membership& m, int64_t id,
                                             int64_t known) {
    while (true) {
      absl::StatusOr<AwaitResult> r =
          m.AwaitGeneration(id, known, absl::Now() + kPoll);
      if (!r.ok() || r->outcome != hsdp::v1::AWAIT_OUTCOME_ENDED) return r;
    }
  }
  static std::future<absl::StatusOr<AwaitResult>> ConfirmAsync(Membership& m,
                                                               int64_t id,
                                                               int64_t known) {
    return std::async(std::launch::async,
                      [&m, id, known] { return Confirm(m, id, known); });
  }
  // Waits (real time) until `count` members confirmed the ending generation.
  static void WaitConfirmed(Membership& m, int count) {
    const absl::Time deadline = absl::Now() + kPoll;
    while (m.Status().confirmed < count && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    ASSERT_GE(m.Status().confirmed, count);
  }
  // Waits (real time) until the job is in `state`.
  static void WaitForState(Membership& m, hsdp::v1::JobState state) {
    const absl::Time deadline = absl::Now() + kPoll;
    while (m.job_state() != state && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    ASSERT_EQ(m.job_state(), state);
  }
  // Loses `lost` by heartbeat timeout while the others keep beating.
  void Lose(Membership& m, const std::vector<int64_t>& alive,
            const std::vector<int64_t>& lost) {
    clock_.Advance(kHeartbeatTimeout / 2 + absl::Seconds(1));
    Beat(m, alive);
    clock_.Advance(kHeartbeatTimeout / 2 + absl::Seconds(1));
    Beat(m, alive);
    EXPECT_EQ(m.Tick(), lost);
  }
  static std::vector<GenerationRole> Roles(const hsdp::v1::Generation& g) {
    std::vector<GenerationRole> roles;
    for (int r : g.roles()) roles.push_back(static_cast<GenerationRole>(r));
    return roles;
  }
};

// A member reports a failed collective: the generation ends at once, pending
// votes abort, and once the survivors confirmed and the short window passed
// (well inside the heartbeat timeout) the complete groups form the next one.
TEST_F(ElasticTest, ShrinkOnFailureReportWithoutHeartbeatWait) {
  auto m = Make({2, 2});
  const std::vector<int64_t> ids = JoinAll(*m);
  Commit(*m, 0);
  absl::StatusOr<bool> ended =
      m->ReportFailure(ids[2], 0, 1, "AllGather: lost peer rank 3");
  ASSERT_TRUE(ended.ok()) << ended.status();
  EXPECT_TRUE(*ended);
  EXPECT_EQ(m->job_state(), hsdp::v1::JOB_STATE_REFORMING);
  EXPECT_FALSE(*m->ReportFailure(ids[0], 0, 1, "again"));  // already ended
  // A voter arriving after the end: ABORTED, the step is not committed.
  absl::Status late =
      m->CommitStep(ids[0], 0, 1, absl::Now() + kShortPoll).status();
  EXPECT_EQ(late.code(), absl::StatusCode::kAborted) << late;
  EXPECT_TRUE(absl::StrContains(late.message(), "lost peer rank 3")) << late;

  auto c0 = ConfirmAsync(*m, ids[0], 0);
  auto c1 = ConfirmAsync(*m, ids[1], 0);
  auto c2 = ConfirmAsync(*m, ids[2], 0);
  WaitConfirmed(*m, 3);
  // Rank 3 is silent but not yet lost: the window bounds the wait for it.
  EXPECT_EQ(m->generation(), 0);
  clock_.Advance(kReformWindow);
  m->Tick();
  absl::StatusOr<AwaitResult> r0 = c0.get();
  absl::StatusOr<AwaitResult> r1 = c1.get();
  absl::StatusOr<AwaitResult> r2 = c2.get();
  ASSERT_TRUE(r0.ok() && r1.ok() && r2.ok());
  ASSERT_EQ(r0->outcome, hsdp::v1::AWAIT_OUTCOME_FORMED);
  EXPECT_EQ(r1->outcome, hsdp::v1::AWAIT_OUTCOME_FORMED);
  EXPECT_EQ(r2->outcome, hsdp::v1::AWAIT_OUTCOME_STANDBY);
  const hsdp::v1::Generation& g = r0->generation;
  EXPECT_EQ(g.generation(), 1);
  EXPECT_EQ(g.mesh().replicate(), 1);
  EXPECT_EQ(g.mesh().shard(), 2);
  EXPECT_EQ(g.start_step(), 1);  // the last committed step + 1
  EXPECT_EQ(Members(*m), (std::vector<int64_t>{ids[0], ids[1]}));
  EXPECT_EQ(Roles(g),
            (std::vector<GenerationRole>{hsdp::v1::GENERATION_ROLE_TRAIN,
                                         hsdp::v1::GENERATION_ROLE_TRAIN}));
  EXPECT_TRUE(g.heal_plans().empty());
  EXPECT_EQ(g.rendezvous_prefix(), "hsdp/job/gen-1/");
  EXPECT_EQ(StateOf(*m, ids[2]), hsdp::v1::WORKER_STATE_STANDBY);
  EXPECT_EQ(m->job_state(), hsdp::v1::JOB_STATE_DEGRADED);
  MembershipStatus status = m->Status();
  EXPECT_EQ(status.replicas, 1);
  EXPECT_EQ(status.failures, 1);
  ASSERT_TRUE(status.last_failure.has_value());
  EXPECT_EQ(status.last_failure->cause(), hsdp::v1::FAILURE_CAUSE_REPORTED);
  EXPECT_EQ(status.last_failure->worker_id(), ids[2]);
  EXPECT_GT(status.last_failure->formed_unix_ms(), 0);
  // The step that aborted is trained again in generation 1 and commits there.
  Commit(*m, 1);
  ASSERT_EQ(listener_.recovered.size(), 1u);
  EXPECT_GE(listener_.recovered[0].recovered_unix_ms(),
            listener_.recovered[0].formed_unix_ms());
  EXPECT_EQ(m->last_committed_step(), 1);
  // A vote of the old generation for that step stays aborted.
  EXPECT_EQ(m->CommitStep(ids[0], 0, 1, absl::Now()).status().code(),
            absl::StatusCode::kAborted);
  EXPECT_EQ(listener_.events,
            (std::vector<std::string>{"committed 0:0",
                                      "ended 0 FAILURE_CAUSE_REPORTED",
                                      "formed 1", "committed 1:1"}));
  // JoinAll puts every rank on a host of its own: each shard group spans
  // hosts, which is said for the first generation and for the one formed
  // after it.
  const std::string across = " (its all-gathers cross the host link)";
  EXPECT_EQ(
      listener_.topology,
      (std::vector<std::string>{
          "generation 0: shard group 0 spans hosts host-0, host-1" + across,
          "generation 0: shard group 1 spans hosts host-2, host-3" + across,
          "generation 1: shard group 0 spans hosts host-0, host-1" + across}));
  EXPECT_EQ(m->Status().topology_warnings,
            (std::vector<std::string>{
                "shard group 0 spans hosts host-0, host-1" + across}));
}

// The failed member's schedule stream broke from its side (its process
// died): once the other members confirmed, the next generation forms at once,
// without waiting out the window for it — whether the stream broke before the
// failure was reported or after.
TEST_F(ElasticTest, FormsWithoutTheWindowWhenTheSilentMembersStreamBroke) {
  for (const bool lost_first : {true, false}) {
    SCOPED_TRACE(lost_first ? "stream lost, then the failure report"
                            : "the failure report, then the stream lost");
    auto m = Make({2, 2});
    const std::vector<int64_t> ids = JoinAll(*m);
    Commit(*m, 0);
    // The dead worker's watcher call, begun while it was alive, goes on in
    // the coordinator: its wake-ups show nothing.
    auto dead_poll = AwaitAsync(*m, ids[3], 0);
    absl::SleepFor(absl::Milliseconds(300));  // it waits
    if (lost_first) m->ScheduleStreamLost(ids[3], 0);
    ASSERT_TRUE(*m->ReportFailure(ids[2], 0, 1, "AllGather: lost peer rank 3"));
    auto c0 = ConfirmAsync(*m, ids[0], 0);
    auto c1 = ConfirmAsync(*m, ids[1], 0);
    auto c2 = ConfirmAsync(*m, ids[2], 0);
    if (!lost_first) {
      WaitConfirmed(*m, 3);
      EXPECT_EQ(m->generation(), 0);  // rank 3 may still be slow
      m->ScheduleStreamLost(ids[3], 0);
    }
    // No clock advance and no Tick: the confirmations alone form it.
    absl::StatusOr<AwaitResult> r0 = c0.get();
    ASSERT_TRUE(r0.ok()) << r0.status();
    EXPECT_EQ(r0->outcome, hsdp::v1::AWAIT_OUTCOME_FORMED);
    EXPECT_EQ(c1.get()->outcome, hsdp::v1::AWAIT_OUTCOME_FORMED);
    EXPECT_EQ(c2.get()->outcome, hsdp::v1::AWAIT_OUTCOME_STANDBY);
    EXPECT_EQ(m->generation(), 1);
    EXPECT_EQ(Members(*m), (std::vector<int64_t>{ids[0], ids[1]}));
    // Woken by the end or by the formation: either way, not placed.
    absl::StatusOr<AwaitResult> dead = dead_poll.get();
    ASSERT_TRUE(dead.ok()) << dead.status();
    EXPECT_NE(dead->outcome, hsdp::v1::AWAIT_OUTCOME_FORMED);
    // Nor does its wake-up count as the worker being there: with the
    // standby rank 2 it would complete a replica group, and the job would
    // grow onto a dead worker at the next step boundary.
    for (const auto& r : VoteAll(*m, {ids[0], ids[1]}, 1, 1)) {
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_FALSE(r->reform_after);
    }
    EXPECT_EQ(m->job_state(), hsdp::v1::JOB_STATE_DEGRADED);
  }
}

// A member that is merely slow keeps the window's protection: a lost stream
// it follows with a heartbeat, and a stream of another generation, do not
// make the others form without it; it confirms late, inside the window, and
// the full mesh forms again.
TEST_F(ElasticTest, AHeartbeatAfterALostStreamKeepsTheWindowForTheMember) {
  auto m = Make({2, 2});
  const std::vector<int64_t> ids = JoinAll(*m);
  Commit(*m, 0);
  m->ScheduleStreamLost(ids[3], 0);
  Beat(*m, {ids[3]});                // it is there after all
  m->ScheduleStreamLost(ids[1], 7);  // not this generation: ignored
  m->ScheduleStreamLost(999, 0);     // not a worker: ignored
  ASSERT_TRUE(*m->ReportFailure(ids[2], 0, 1, "AllGather: timed out"));
  auto c0 = ConfirmAsync(*m, ids[0], 0);
  auto c1 = ConfirmAsync(*m, ids[1], 0);
  auto c2 = ConfirmAsync(*m, ids[2], 0);
  WaitConfirmed(*m, 3);
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(m->generation(), 0);
  EXPECT_EQ(m->job_state(), hsdp::v1::JOB_STATE_REFORMING);
  auto c3 = ConfirmAsync(*m, ids[3], 0);
  for (auto* c : {&c0, &c1, &c2, &c3}) {
    absl::StatusOr<AwaitResult> r = c->get();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->outcome, hsdp::v1::AWAIT_OUTCOME_FORMED);
  }
  EXPECT_EQ(m->generation(), 1);
  EXPECT_EQ(m->current_generation().mesh().replicate(), 2);
}

// A member that is merely slow is not dropped within the window: every other
// member reported in, but its connection is up (its stream broke once, and
// the vote it cast since shows it is there), so the generation waits for it
// until just before the window ends; it confirms then, and the full mesh
// forms again with nobody standing by.
TEST_F(ElasticTest, ASlowMemberIsNotDroppedWithinTheWindow) {
  auto m = Make({2, 2});
  const std::vector<int64_t> ids = JoinAll(*m);
  m->ScheduleStreamLost(ids[3], 0);
  Commit(*m, 0);  // rank 3 votes: it is there
  ASSERT_TRUE(*m->ReportFailure(ids[2], 0, 1, "AllReduce: timed out"));
  auto c0 = ConfirmAsync(*m, ids[0], 0);
  auto c1 = ConfirmAsync(*m, ids[1], 0);
  WaitConfirmed(*m, 3);  // the reporter and ranks 0 and 1
  clock_.Advance(kReformWindow - absl::Milliseconds(1));
  m->Tick();
  EXPECT_EQ(m->generation(), 0);
  EXPECT_EQ(m->job_state(), hsdp::v1::JOB_STATE_REFORMING);
  auto c2 = ConfirmAsync(*m, ids[2], 0);
  auto c3 = ConfirmAsync(*m, ids[3], 0);
  for (auto* c : {&c0, &c1, &c2, &c3}) {
    absl::StatusOr<AwaitResult> r = c->get();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->outcome, hsdp::v1::AWAIT_OUTCOME_FORMED);
  }
  EXPECT_EQ(m->generation(), 1);
  EXPECT_EQ(Members(*m), ids);
  EXPECT_EQ(m->job_state(), hsdp::v1::JOB_STATE_RUNNING);
}

// The failure report is the reporter's confirmation: with the dead member's
// stream broken, the other two confirming forms the next generation at once,
// although the reporter never called AwaitGeneration.
TEST_F(ElasticTest, AFailureReportCountsAsReportingIn) {
  auto m = Make({2, 2});
  const std::vector<int64_t> ids = JoinAll(*m);
  Commit(*m, 0);
  m->ScheduleStreamLost(ids[3], 0);
  ASSERT_TRUE(*m->ReportFailure(ids[1], 0, 1, "AllGather: lost peer rank 3"));
  EXPECT_EQ(m->Status().confirmed, 1);
  auto c0 = ConfirmAsync(*m, ids[0], 0);
  auto c2 = ConfirmAsync(*m, ids[2], 0);
  absl::StatusOr<AwaitResult> r0 = c0.get();
  ASSERT_TRUE(r0.ok()) << r0.status();
  EXPECT_EQ(r0->outcome, hsdp::v1::AWAIT_OUTCOME_FORMED);
  EXPECT_EQ(c2.get()->outcome, hsdp::v1::AWAIT_OUTCOME_STANDBY);
  EXPECT_EQ(Members(*m), (std::vector<int64_t>{ids[0], ids[1]}));
  // A second report of the ended generation changes nothing.
  EXPECT_FALSE(*m->ReportFailure(ids[0], 0, 1, "again"));
  EXPECT_EQ(m->generation(), 1);
}

// A silent worker is lost by its heartbeats; every live member confirms and
// the next generation forms at once (no window wait: nobody else is missing).
TEST_F(ElasticTest, ShrinkOnHeartbeatLossFormsOnceEverySurvivorConfirmed) {
  auto m = Make({2, 2});
  const std::vector<int64_t> ids = JoinAll(*m);
  Commit(*m, 0);
  // The survivors' watchers wait in AwaitGeneration while the job runs.
  auto w0 = ConfirmAsync(*m, ids[0], 0);
  auto w1 = ConfirmAsync(*m, ids[1], 0);
  auto w2 = ConfirmAsync(*m, ids[2], 0);
  Lose(*m, {ids[0], ids[1], ids[2]}, {ids[3]});
  absl::StatusOr<AwaitResult> r0 = w0.get();
  absl::StatusOr<AwaitResult> r1 = w1.get();
  absl::StatusOr<AwaitResult> r2 = w2.get();
  ASSERT_TRUE(r0.ok() && r1.ok() && r2.ok());
  EXPECT_EQ(r0->outcome, hsdp::v1::AWAIT_OUTCOME_FORMED);
  EXPECT_EQ(r1->outcome, hsdp::v1::AWAIT_OUTCOME_FORMED);
  EXPECT_EQ(r2->outcome, hsdp::v1::AWAIT_OUTCOME_STANDBY);
  EXPECT_EQ(m->generation(), 1);
  EXPECT_EQ(Members(*m), (std::vector<int64_t>{ids[0], ids[1]}));
  EXPECT_EQ(StateOf(*m, ids[3]), hsdp::v1::WORKER_STATE_LOST);
  const MembershipStatus status = m->Status();
  ASSERT_TRUE(status.last_failure.has_value());
  EXPECT_EQ(status.last_failure->cause(), hsdp::v1::FAILURE_CAUSE_LOST);
  // Failed at the lost worker's last heartbeat, noticed at the timeout.
  EXPECT_LT(status.last_failure->failed_unix_ms(),
            status.last_failure->ended_unix_ms());
  // The lost worker must come back as a new worker.
  EXPECT_EQ(m->AwaitGeneration(ids[3], 0, absl::Now()).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

// An evicted member trains to the next step boundary; then its generation
// ends, it is told to exit, and the next one forms without it (ranks move).
TEST_F(ElasticTest, EvictLeavesAtTheNextStepBoundary) {
  auto m = Make({2, 2});
  const std::vector<int64_t> ids = JoinAll(*m);
  Commit(*m, 0);
  absl::StatusOr<EvictResult> evicted = m->Evict(1, std::nullopt);
  ASSERT_TRUE(evicted.ok()) << evicted.status();
  EXPECT_EQ(evicted->worker_id, ids[1]);
  EXPECT_EQ(evicted->generation, 0);
  EXPECT_EQ(m->job_state(), hsdp::v1::JOB_STATE_RUNNING);
  EXPECT_EQ(StateOf(*m, ids[1]), hsdp::v1::WORKER_STATE_EVICTED);
  EXPECT_EQ(m->Evict(std::nullopt, ids[1]).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(m->Evict(9, std::nullopt).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(m->Evict(std::nullopt, std::nullopt).status().code(),
            absl::StatusCode::kInvalidArgument);
  // The next commit is the boundary: everyone applies it, then re-forms.
  for (const auto& r : VoteAll(*m, ids, 0, 1)) {
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(r->reform_after);
  }
  EXPECT_EQ(m->job_state(), hsdp::v1::JOB_STATE_REFORMING);
  absl::StatusOr<AwaitResult> out = Confirm(*m, ids[1], 0);
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(out->outcome, hsdp::v1::AWAIT_OUTCOME_EXIT);
  auto c0 = ConfirmAsync(*m, ids[0], 0);
  auto c2 = ConfirmAsync(*m, ids[2], 0);
  auto c3 = ConfirmAsync(*m, ids[3], 0);
  ASSERT_EQ(c2.get()->outcome, hsdp::v1::AWAIT_OUTCOME_FORMED);
  ASSERT_EQ(c3.get()->outcome, hsdp::v1::AWAIT_OUTCOME_FORMED);
  ASSERT_EQ(c0.get()->outcome, hsdp::v1::AWAIT_OUTCOME_STANDBY);
  // The whole group {2, 3} survives; its workers are ranks 0 and 1 now.
  EXPECT_EQ(Members(*m), (std::vector<int64_t>{ids[2], ids[3]}));
  EXPECT_EQ(m->current_generation().start_step(), 2);
  EXPECT_EQ(m->Status().last_failure->cause(), hsdp::v1::FAILURE_CAUSE_EVICTED);
}

// Without a step boundary (no worker commits), an eviction ends the
// generation after the join wait.
TEST_F(ElasticTest, EvictWithoutAStepBoundaryEndsAfterTheJoinWait) {
  auto m = Make({2, 2});
  const std::vector<int64_t> ids = JoinAll(*m);
  ASSERT_TRUE(m->Evict(std::nullopt, ids[0]).ok());
  clock_.Advance(kJoinWait / 2);
  Beat(*m, ids);
  m->Tick();
  EXPECT_EQ(m->job_state(), hsdp::v1::JOB_STATE_RUNNING);
  clock_.Advance(kJoinWait / 2);
  Beat(*m, ids);
  m->Tick();
  EXPECT_EQ(m->job_state(), hsdp::v1::JOB_STATE_REFORMING);
}

// A job resumed from a checkpoint first votes for the step after it: the
// first commit of the job takes the step of its first vote; a vote for another
// step meanwhile is out of range, and later steps follow one by one.
TEST_F(ElasticTest, FirstCommitOfAResumedJobIsTheStepAfterItsCheckpoint) {
  auto m = Make({1, 2});
  const std::vector<int64_t> ids = JoinAll(*m);
  Membership& membership = *m;
  const int64_t first = ids[0];
  std::future<absl::StatusOr<CommitResult>> vote =
      std::async(std::launch::async, [&membership, first] {
        return membership.CommitStep(first, 0, 7, absl::Now() + kPoll);
      });
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(m->CommitStep(ids[1], 0, 6, absl::Now()).status().code(),
            absl::StatusCode::kOutOfRange);
  ASSERT_TRUE(m->CommitStep(ids[1], 0, 7, absl::Now() + kPoll).ok());
  ASSERT_TRUE(vote.get().ok());
  EXPECT_EQ(m->last_committed_step(), 7);
  EXPECT_EQ(m->CommitStep(ids[0], 0, 9, absl::Now()).status().code(),
            absl::StatusCode::kOutOfRange);
}

// Votes and the end of a generation racing: a failure between votes aborts
// the waiting voters; a committed step answers the same to a retried vote,
// also after the generation ended; wrong steps and missing votes are named.
TEST_F(ElasticTest, CommitAbortRaces) {
  auto m = Make({2, 1});
  const std::vector<int64_t> ids = JoinAll(*m);
  absl::Status partial =
      m->CommitStep(ids[0], 0, 0, absl::Now() + kShortPoll).status();
  EXPECT_EQ(partial.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(absl::StrContains(partial.message(), "rank(s) 1")) << partial;
  EXPECT_EQ(m->CommitStep(ids[0], 0, 5, absl::Now()).status().code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(m->CommitStep(ids[0], 3, 0, absl::Now()).status().code(),
            absl::StatusCode::kFailedPrecondition);  // an unknown generation

  // Rank 0 votes and waits; rank 1 fails instead of voting.
  Membership& membership = *m;
  const int64_t voter = ids[0];
  std::future<absl::StatusOr<CommitResult>> vote =
      std::async(std::launch::async, [&membership, voter] {
        return membership.CommitStep(voter, 0, 0, absl::Now() + kPoll);
      });
  // Give the vote time to arrive; the outcome is ABORTED either way (a vote
  // arriving after the end is aborted too).
  absl::SleepFor(absl::Milliseconds(50));
  ASSERT_TRUE(*m->ReportFailure(ids[1], 0, 0, "collective failed"));
  EXPECT_EQ(vote.get().status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(m->CommitStep(ids[1], 0, 0, absl::Now()).status().code(),
            absl::StatusCode::kAborted);
  EXPECT_EQ(m->last_committed_step(), -1);

  auto c0 = ConfirmAsync(*m, ids[0], 0);
  auto c1 = ConfirmAsync(*m, ids[1], 0);
  ASSERT_EQ(c0.get()->outcome, hsdp::v1::AWAIT_OUTCOME_FORMED);
  ASSERT_EQ(c1.get()->outcome, hsdp::v1::AWAIT_OUTCOME_FORMED);
  EXPECT_EQ(m->current_generation().start_step(), 0);  // step 0 again
  Commit(*m, 0);
  absl::StatusOr<CommitResult> retry = m->CommitStep(ids[0], 1, 0, absl::Now());
  ASSERT_TRUE(retry.ok()) << retry.status();
  EXPECT_FALSE(retry->reform_after);
  ASSERT_TRUE(*m->ReportFailure(ids[0], 1, 1, "later failure"));
  retry = m->CommitStep(ids[1], 1, 0, absl::Now());
  ASSERT_TRUE(retry.ok()) << retry.status();  // committed before the end
  EXPECT_TRUE(retry->reform_after);
  // Step 0 committed in generation 1, never in generation 0.
  EXPECT_EQ(m->CommitStep(ids[0], 0, 0, absl::Now()).status().code(),
            absl::StatusCode::kAborted);
}

// A vote that does not wait (one arriving on a report stream) is counted once
// and answered as CommitStep answers it; the listener hears each commit's
// answer after its step boundary, so a commit that ends the generation says
// reform_after.
TEST_F(ElasticTest, AVoteWithoutWaitingCountsOnceAndItsCommitIsAnnounced) {
  auto m = Make({2, 1});
  const std::vector<int64_t> ids = JoinAll(*m);
  for (int repeat = 0; repeat < 2; ++repeat) {
    absl::StatusOr<std::optional<CommitResult>> pending = m->Vote(ids[0], 0, 0);
    ASSERT_TRUE(pending.ok()) << pending.status();
    EXPECT_FALSE(pending->has_value());
  }
  EXPECT_EQ(m->last_committed_step(), -1);
  EXPECT_TRUE(listener_.answers.empty());
  EXPECT_EQ(m->Vote(ids[0], 0, 3).status().code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(m->Vote(ids[0], 5, 0).status().code(),
            absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<std::optional<CommitResult>> last = m->Vote(ids[1], 0, 0);
  ASSERT_TRUE(last.ok()) << last.status();
  ASSERT_TRUE(last->has_value());
  EXPECT_EQ((*last)->step, 0);
  EXPECT_FALSE((*last)->reform_after);
  EXPECT_EQ(m->last_committed_step(), 0);
  EXPECT_EQ(listener_.answers, std::vector<std::string>{"0:0"});
  // The long poll answers a vote of the committed step at once, the same.
  absl::StatusOr<CommitResult> again = m->CommitStep(ids[0], 0, 0, absl::Now());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->step, 0);
  EXPECT_FALSE(again->reform_after);

  // An eviction waits for the next commit: its answer ends the generation.
  ASSERT_TRUE(m->Evict(1, std::nullopt).ok());
  ASSERT_TRUE(m->Vote(ids[0], 0, 1).ok());
  last = m->Vote(ids[1], 0, 1);
  ASSERT_TRUE(last.ok()) << last.status();
  ASSERT_TRUE(last->has_value());
  EXPECT_TRUE((*last)->reform_after);
  EXPECT_EQ(listener_.answers, (std::vector<std::string>{"0:0", "0:1 reform"}));
  EXPECT_EQ(m->Vote(ids[0], 0, 2).status().code(), absl::StatusCode::kAborted);
}

// While the first generation still takes its ranks, a vote that does not wait
// is refused UNAVAILABLE and not counted (CommitStep waits for the formation).
TEST_F(ElasticTest, AVoteWithoutWaitingBeforeEveryRankJoinedIsNotCounted) {
  auto m = Make({2, 1});
  absl::StatusOr<JoinResult> first = m->Join(Args(0, "host-0"));
  ASSERT_TRUE(first.ok()) << first.status();
  absl::Status early = m->Vote(first->worker_id, 0, 0).status();
  EXPECT_EQ(early.code(), absl::StatusCode::kUnavailable) << early;
  EXPECT_TRUE(absl::StrContains(early.message(), "not formed yet")) << early;
  absl::StatusOr<JoinResult> second = m->Join(Args(1, "host-1"));
  ASSERT_TRUE(second.ok()) << second.status();
  // Formed: rank 0's earlier vote did not count, so rank 1's does not commit.
  absl::StatusOr<std::optional<CommitResult>> pending =
      m->Vote(second->worker_id, 0, 0);
  ASSERT_TRUE(pending.ok()) << pending.status();
  EXPECT_FALSE(pending->has_value());
  pending = m->Vote(first->worker_id, 0, 0);
  ASSERT_TRUE(pending.ok()) << pending.status();
  EXPECT_TRUE(pending->has_value());
}

// 3x2 loses a worker (2x2 + a standby), trains on; a joiner makes a third
// group possible: at the next step boundary the job grows back, the standby
// survivor first, both healed from every holder of their shard index.
TEST_F(ElasticTest, GrowHealsFromSeveralSourcesStandbyFirst) {
  auto m = Make({3, 2});
  const std::vector<int64_t> ids = JoinAll(*m);
  Commit(*m, 0);
  std::vector<std::future<absl::StatusOr<AwaitResult>>> watchers;
  for (int r = 0; r < 5; ++r) watchers.push_back(ConfirmAsync(*m, ids[r], 0));
  Lose(*m, {ids[0], ids[1], ids[2], ids[3], ids[4]}, {ids[5]});
  for (auto& w : watchers) ASSERT_TRUE(w.get().ok());
  EXPECT_EQ(Members(*m),
            (std::vector<int64_t>{ids[0], ids[1], ids[2], ids[3]}));
  EXPECT_EQ(StateOf(*m, ids[4]), hsdp::v1::WORKER_STATE_STANDBY);
  Commit(*m, 1);  // the standby's state is stale from here on

  const int64_t joiner = JoinLate(*m, "replacement");
  EXPECT_EQ(StateOf(*m, joiner), hsdp::v1::WORKER_STATE_JOINING);
  EXPECT_EQ(m->job_state(), hsdp::v1::JOB_STATE_DEGRADED);
  // The joiner learns it stands by in generation 1; both wait for the next
  // generation, which comes at the next commit (the step boundary).
  absl::StatusOr<AwaitResult> first =
      m->AwaitGeneration(joiner, -1, absl::Now() + kPoll);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->outcome, hsdp::v1::AWAIT_OUTCOME_STANDBY);
  EXPECT_EQ(first->generation.generation(), 1);
  auto standby = AwaitAsync(*m, ids[4], 1);
  auto joining = AwaitAsync(*m, joiner, 1);
  for (const auto& r : VoteAll(*m, Members(*m), 1, 2)) {
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(r->reform_after);
  }
  std::vector<std::future<absl::StatusOr<AwaitResult>>> confirms;
  for (int r = 0; r < 4; ++r) confirms.push_back(ConfirmAsync(*m, ids[r], 1));
  for (auto& c : confirms) {
    absl::StatusOr<AwaitResult> r = c.get();
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->outcome, hsdp::v1::AWAIT_OUTCOME_FORMED);
  }
  absl::StatusOr<AwaitResult> s = standby.get();
  absl::StatusOr<AwaitResult> j = joining.get();
  ASSERT_TRUE(s.ok() && j.ok());
  ASSERT_EQ(s->outcome, hsdp::v1::AWAIT_OUTCOME_FORMED);
  ASSERT_EQ(j->outcome, hsdp::v1::AWAIT_OUTCOME_FORMED);
  const hsdp::v1::Generation& g = j->generation;
  EXPECT_EQ(g.generation(), 2);
  EXPECT_EQ(g.mesh().replicate(), 3);
  EXPECT_EQ(g.start_step(), 3);
  EXPECT_EQ(Members(*m), (std::vector<int64_t>{ids[0], ids[1], ids[2], ids[3],
                                               ids[4], joiner}));
  using R = GenerationRole;
  EXPECT_EQ(Roles(g), (std::vector<R>{hsdp::v1::GENERATION_ROLE_HEAL_SOURCE,
                                      hsdp::v1::GENERATION_ROLE_HEAL_SOURCE,
                                      hsdp::v1::GENERATION_ROLE_HEAL_SOURCE,
                                      hsdp::v1::GENERATION_ROLE_HEAL_SOURCE,
                                      hsdp::v1::GENERATION_ROLE_HEAL_TARGET,
                                      hsdp::v1::GENERATION_ROLE_HEAL_TARGET}));
  ASSERT_EQ(g.heal_plans_size(), 2);
  EXPECT_EQ(g.heal_plans(0).shard_index(), 0);
  EXPECT_EQ(std::vector<int>(g.heal_plans(0).source_ranks().begin(),
                             g.heal_plans(0).source_ranks().end()),
            (std::vector<int>{0, 2}));
  EXPECT_EQ(std::vector<int>(g.heal_plans(0).target_ranks().begin(),
                             g.heal_plans(0).target_ranks().end()),
            (std::vector<int>{4}));
  EXPECT_EQ(std::vector<int>(g.heal_plans(1).source_ranks().begin(),
                             g.heal_plans(1).source_ranks().end()),
            (std::vector<int>{1, 3}));
  EXPECT_EQ(std::vector<int>(g.heal_plans(1).target_ranks().begin(),
                             g.heal_plans(1).target_ranks().end()),
            (std::vector<int>{5}));
  EXPECT_EQ(m->job_state(), hsdp::v1::JOB_STATE_RUNNING);
  // The first commit of the healed generation marks the targets healed.
  Commit(*m, 3);
  for (const WorkerSnapshot& w : m->Workers()) {
    if (w.worker_id != joiner) continue;
    ASSERT_FALSE(w.history.empty());
    EXPECT_EQ(w.history.back().kind(), hsdp::v1::WORKER_EVENT_KIND_HEALED);
  }
}

// When no step boundary comes (nothing commits), a joiner that completes a
// group is taken in after the join wait.
TEST_F(ElasticTest, GrowWithoutAStepBoundaryAfterTheJoinWait) {
  auto m = Make({2, 1});
  const std::vector<int64_t> ids = JoinAll(*m);
  Commit(*m, 0);
  auto w0 = ConfirmAsync(*m, ids[0], 0);
  Lose(*m, {ids[0]}, {ids[1]});
  ASSERT_EQ(w0.get()->outcome, hsdp::v1::AWAIT_OUTCOME_FORMED);
  EXPECT_EQ(Members(*m), (std::vector<int64_t>{ids[0]}));
  const int64_t joiner = JoinLate(*m, "new");
  clock_.Advance(kJoinWait);
  Beat(*m, {ids[0], joiner});
  auto watch = ConfirmAsync(*m, ids[0], 1);
  m->Tick();
  ASSERT_EQ(watch.get()->outcome, hsdp::v1::AWAIT_OUTCOME_FORMED);
  const hsdp::v1::Generation g = m->current_generation();
  EXPECT_EQ(g.generation(), 2);
  EXPECT_EQ(Members(*m), (std::vector<int64_t>{ids[0], joiner}));
  EXPECT_EQ(Roles(g)[1], hsdp::v1::GENERATION_ROLE_HEAL_TARGET);
}

// Every replica of a shard index is gone: the job stops with a clear error,
// and everyone asking is told to exit.
TEST_F(ElasticTest, NoLiveCopyOfAShardStopsTheJob) {
  auto m = Make({2, 2});
  const std::vector<int64_t> ids = JoinAll(*m);
  Commit(*m, 0);
  auto w0 = ConfirmAsync(*m, ids[0], 0);
  auto w2 = ConfirmAsync(*m, ids[2], 0);
  Lose(*m, {ids[0], ids[2]}, {ids[1], ids[3]});
  absl::StatusOr<AwaitResult> r0 = w0.get();
  ASSERT_TRUE(r0.ok()) << r0.status();
  EXPECT_EQ(r0->outcome, hsdp::v1::AWAIT_OUTCOME_EXIT);
  EXPECT_TRUE(absl::StrContains(r0->message, "shard 1")) << r0->message;
  EXPECT_EQ(w2.get()->outcome, hsdp::v1::AWAIT_OUTCOME_EXIT);
  EXPECT_EQ(m->job_state(), hsdp::v1::JOB_STATE_FAILED);
  EXPECT_TRUE(absl::StrContains(m->Status().message,
                                "no live worker holds the state of shard 1"))
      << m->Status().message;
  EXPECT_EQ(m->Join(Args(std::nullopt, "late")).status().code(),
            absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<HeartbeatResult> beat = m->Heartbeat(ids[0], -1, 1);
  ASSERT_TRUE(beat.ok());
  EXPECT_EQ(beat->job_state, hsdp::v1::JOB_STATE_FAILED);
  EXPECT_FALSE(beat->message.empty());
}

// A worker reports an error no generation would get past (a non-finite loss):
// the job fails at once with that reason, nothing re-forms, a vote waiting
// for the step aborts, and only the first reason is kept.
TEST_F(ElasticTest, FatalReportFailsTheJobWithItsReason) {
  auto m = Make({2, 2});
  const std::vector<int64_t> ids = JoinAll(*m);
  Commit(*m, 0);
  auto vote = std::async(std::launch::async, [&] {
    return m->CommitStep(ids[0], 0, 1, absl::Now() + kPoll);
  });
  const std::string reason =
      "step 1: the loss is nan on rank 2, microbatch 0 (--on-nonfinite stop)";
  absl::StatusOr<bool> failed = m->FailJob(ids[2], 1, reason);
  ASSERT_TRUE(failed.ok()) << failed.status();
  EXPECT_TRUE(*failed);
  EXPECT_EQ(vote.get().status().code(), absl::StatusCode::kAborted);
  EXPECT_FALSE(*m->FailJob(ids[1], 1, "a later reason"));
  EXPECT_EQ(m->job_state(), hsdp::v1::JOB_STATE_FAILED);
  EXPECT_EQ(m->Status().message, reason);
  absl::StatusOr<AwaitResult> exit = Confirm(*m, ids[0], 0);
  ASSERT_TRUE(exit.ok()) << exit.status();
  EXPECT_EQ(exit->outcome, hsdp::v1::AWAIT_OUTCOME_EXIT);
  EXPECT_EQ(exit->message, absl::StrCat("the job failed: ", reason));
  m->Tick();
  EXPECT_EQ(m->current_generation().generation(), 0);
  EXPECT_EQ(m->FailJob(424242, 1, "unknown worker").status().code(),
            absl::StatusCode::kNotFound);
}

// Every replica of a shard index is gone, but every shard was checkpointed:
// the live workers form a generation that loads the checkpoint (on the mesh
// they make) and trains again from the step after it.
TEST_F(ElasticTest, NoLiveCopyWithACheckpointRestartsFromIt) {
  auto m = Make({2, 2});
  const std::vector<int64_t> ids = JoinAll(*m);
  for (int step = 0; step < 4; ++step) Commit(*m, step);
  listener_.last_checkpoint_step = 1;
  auto w0 = ConfirmAsync(*m, ids[0], 0);
  auto w2 = ConfirmAsync(*m, ids[2], 0);
  Lose(*m, {ids[0], ids[2]}, {ids[1], ids[3]});
  absl::StatusOr<AwaitResult> r0 = w0.get();
  absl::StatusOr<AwaitResult> r2 = w2.get();
  ASSERT_TRUE(r0.ok() && r2.ok());
  ASSERT_EQ(r0->outcome, hsdp::v1::AWAIT_OUTCOME_FORMED) << r0->message;
  EXPECT_EQ(r2->outcome, hsdp::v1::AWAIT_OUTCOME_FORMED);
  const hsdp::v1::Generation& g = r0->generation;
  EXPECT_TRUE(g.restore_from_checkpoint());
  EXPECT_EQ(g.start_step(), 2);
  EXPECT_EQ(g.mesh().replicate(), 1);
  EXPECT_EQ(g.mesh().shard(), 2);
  EXPECT_EQ(Roles(g),
            (std::vector<GenerationRole>{hsdp::v1::GENERATION_ROLE_TRAIN,
                                         hsdp::v1::GENERATION_ROLE_TRAIN}));
  EXPECT_TRUE(g.heal_plans().empty());
  EXPECT_EQ(m->last_committed_step(), 1);
  EXPECT_NE(m->job_state(), hsdp::v1::JOB_STATE_FAILED);
  Commit(*m, 2);  // step 2 is trained again and commits in generation 1
  EXPECT_EQ(m->last_committed_step(), 2);
}

// Every worker is lost at once (a partition, or a coordinator that could not
// hear them), with a checkpoint of every shard: the job waits for workers
// instead of failing, and the ones that come back restore the checkpoint.
TEST_F(ElasticTest, EveryWorkerLostWithACheckpointWaitsThenRestores) {
  auto m = Make({2, 2});
  const std::vector<int64_t> ids = JoinAll(*m);
  for (int step = 0; step < 4; ++step) Commit(*m, step);
  listener_.last_checkpoint_step = 1;
  Lose(*m, {}, ids);
  WaitForState(*m, hsdp::v1::JOB_STATE_WAITING);
  const int64_t a = JoinLate(*m, "back-0");
  const int64_t b = JoinLate(*m, "back-1");
  auto wa = ConfirmAsync(*m, a, -1);
  auto wb = ConfirmAsync(*m, b, -1);
  absl::StatusOr<AwaitResult> ra = wa.get();
  absl::StatusOr<AwaitResult> rb = wb.get();
  ASSERT_TRUE(ra.ok()) << ra.status();
  ASSERT_TRUE(rb.ok()) << rb.status();
  ASSERT_EQ(ra->outcome, hsdp::v1::AWAIT_OUTCOME_FORMED) << ra->message;
  EXPECT_EQ(rb->outcome, hsdp::v1::AWAIT_OUTCOME_FORMED);
  const hsdp::v1::Generation& g = ra->generation;
  EXPECT_TRUE(g.restore_from_checkpoint());
  EXPECT_EQ(g.start_step(), 2);
  EXPECT_EQ(g.mesh().replicate(), 1);
  EXPECT_NE(m->job_state(), hsdp::v1::JOB_STATE_FAILED);
}

// The coordinator did not run for longer than the heartbeat timeout (SIGSTOP,
// a paused VM): nobody could have been heard meanwhile, so nobody is lost for
// it; a worker silent for a whole timeout after it is.
TEST_F(ElasticTest, APausedCoordinatorDoesNotHoldThePauseAgainstWorkers) {
  Settings settings;
  settings.pause_threshold = kHeartbeatTimeout / 2;
  auto m = Make({2, 2}, nullptr, settings);
  const std::vector<int64_t> ids = JoinAll(*m);
  Commit(*m, 0);
  Beat(*m, ids);
  clock_.Advance(kHeartbeatTimeout * 3);  // the pause
  EXPECT_TRUE(m->Tick().empty());
  EXPECT_EQ(m->current_generation().generation(), 0);
  // After it, the usual rule: three beat, one does not.
  for (int i = 0; i < 4; ++i) {
    clock_.Advance(kHeartbeatTimeout / 4);
    Beat(*m, {ids[0], ids[1], ids[2]});
    m->Tick();
  }
  clock_.Advance(kHeartbeatTimeout / 4);
  Beat(*m, {ids[0], ids[1], ids[2]});
  EXPECT_EQ(m->Tick(), std::vector<int64_t>{ids[3]});
}

// Without pause detection (the fake-clock tests' default), the same gap loses
// every worker: what the detection prevents.
TEST_F(ElasticTest, WithoutPauseDetectionTheGapLosesEveryWorker) {
  auto m = Make({2, 2});
  const std::vector<int64_t> ids = JoinAll(*m);
  Commit(*m, 0);
  Beat(*m, ids);
  clock_.Advance(kHeartbeatTimeout * 3);
  EXPECT_EQ(m->Tick().size(), ids.size());
}

// R = 1: losing a worker loses its shard.
TEST_F(ElasticTest, OneReplicaLosingAWorkerStopsTheJob) {
  auto m = Make({1, 2});
  const std::vector<int64_t> ids = JoinAll(*m);
  Commit(*m, 0);
  ASSERT_TRUE(*m->ReportFailure(ids[0], 0, 1, "peer died"));
  auto c0 = ConfirmAsync(*m, ids[0], 0);
  WaitConfirmed(*m, 1);
  clock_.Advance(kReformWindow);
  m->Tick();
  absl::StatusOr<AwaitResult> r = c0.get();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->outcome, hsdp::v1::AWAIT_OUTCOME_EXIT);
  EXPECT_EQ(m->job_state(), hsdp::v1::JOB_STATE_FAILED);
}

// Fewer complete groups than min_replicas: the job waits (the holders keep
// the state) until a joiner completes a group.
TEST_F(ElasticTest, TooFewReplicasWaitsForAJoiner) {
  Settings settings;
  settings.min_replicas = 2;
  auto m = Make({2, 2}, nullptr, settings);
  const std::vector<int64_t> ids = JoinAll(*m);
  Commit(*m, 0);
  std::vector<std::future<absl::StatusOr<AwaitResult>>> waiting;
  for (int r = 0; r < 3; ++r) waiting.push_back(ConfirmAsync(*m, ids[r], 0));
  Lose(*m, {ids[0], ids[1], ids[2]}, {ids[3]});
  WaitForState(*m, hsdp::v1::JOB_STATE_WAITING);
  EXPECT_TRUE(absl::StrContains(m->Status().message, "at least 2"))
      << m->Status().message;
  const int64_t joiner = JoinLate(*m, "new");
  for (auto& w : waiting) {
    absl::StatusOr<AwaitResult> r = w.get();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->outcome, hsdp::v1::AWAIT_OUTCOME_FORMED);
  }
  const hsdp::v1::Generation g = m->current_generation();
  EXPECT_EQ(g.mesh().replicate(), 2);
  EXPECT_EQ(Members(*m),
            (std::vector<int64_t>{ids[0], ids[1], ids[2], joiner}));
  ASSERT_EQ(g.heal_plans_size(), 1);
  EXPECT_EQ(g.heal_plans(0).shard_index(), 1);
  EXPECT_EQ(g.heal_plans(0).source_ranks(0), 1);
  EXPECT_EQ(g.heal_plans(0).target_ranks(0), 3);
}

// Before any step committed nothing needs healing: whoever is alive trains.
TEST_F(ElasticTest, BeforeTheFirstCommitNobodyHeals) {
  auto m = Make({2, 2});
  const std::vector<int64_t> ids = JoinAll(*m);
  std::vector<std::future<absl::StatusOr<AwaitResult>>> w;
  for (int r : {0, 2, 3}) w.push_back(ConfirmAsync(*m, ids[r], 0));
  Lose(*m, {ids[0], ids[2], ids[3]}, {ids[1]});
  for (auto& f : w) ASSERT_TRUE(f.get().ok());
  const hsdp::v1::Generation g = m->current_generation();
  EXPECT_EQ(g.mesh().replicate(), 1);
  // Each at its last shard index (a worker's engine is cut for it): worker 0
  // keeps shard 0, worker 3 keeps shard 1; worker 2 (shard 0) stands by.
  EXPECT_EQ(Members(*m), (std::vector<int64_t>{ids[0], ids[3]}));
  EXPECT_EQ(g.start_step(), 0);
  EXPECT_TRUE(g.heal_plans().empty());
  for (int role : g.roles()) EXPECT_EQ(role, hsdp::v1::GENERATION_ROLE_TRAIN);
}

// The coordinator dies while a generation ends; the restarted one restores the
// generation, the workers and the last committed step, collects the
// confirmations again and forms the next generation consistently.
TEST_F(ElasticTest, CoordinatorRestartInTheMiddle) {
  const std::string dir = FreshDir("state");
  std::vector<int64_t> ids;
  {
    auto store = StateStore::Open(dir);
    ASSERT_TRUE(store.ok());
    auto m = Make({2, 2}, store->get());
    ids = JoinAll(*m);
    Commit(*m, 0);
    Commit(*m, 1);
    ASSERT_TRUE(*m->ReportFailure(ids[2], 0, 2, "lost peer rank 3"));
    std::vector<std::future<absl::StatusOr<AwaitResult>>> c;
    for (int r = 0; r < 3; ++r) c.push_back(ConfirmAsync(*m, ids[r], 0));
    WaitConfirmed(*m, 3);
    clock_.Advance(kReformWindow);
    m->Tick();
    for (auto& f : c) ASSERT_TRUE(f.get().ok());
    ASSERT_EQ(m->generation(), 1);
    Commit(*m, 2);
    ASSERT_TRUE(*m->ReportFailure(ids[1], 1, 3, "collective failed"));
    // The coordinator dies here, generation 1 ending.
  }
  auto store = StateStore::Open(dir);
  ASSERT_TRUE(store.ok()) << store.status();
  auto m = Make({2, 2}, store->get());
  EXPECT_EQ(m->generation(), 1);
  EXPECT_EQ(m->job_state(), hsdp::v1::JOB_STATE_REFORMING);
  EXPECT_EQ(m->last_committed_step(), 2);
  EXPECT_EQ(m->Status().failures, 2);
  EXPECT_EQ(StateOf(*m, ids[2]), hsdp::v1::WORKER_STATE_STANDBY);
  // A retried vote gets the decision made before the restart.
  absl::StatusOr<CommitResult> retry = m->CommitStep(ids[0], 1, 2, absl::Now());
  ASSERT_TRUE(retry.ok()) << retry.status();
  EXPECT_TRUE(retry->reform_after);
  EXPECT_EQ(m->CommitStep(ids[0], 0, 2, absl::Now()).status().code(),
            absl::StatusCode::kAborted);
  // The members confirm again and train on; the standby workers (restored,
  // not heard from yet) are not placed.
  auto c0 = ConfirmAsync(*m, ids[0], 1);
  auto c1 = ConfirmAsync(*m, ids[1], 1);
  ASSERT_EQ(c0.get()->outcome, hsdp::v1::AWAIT_OUTCOME_FORMED);
  ASSERT_EQ(c1.get()->outcome, hsdp::v1::AWAIT_OUTCOME_FORMED);
  hsdp::v1::Generation g = m->current_generation();
  EXPECT_EQ(g.generation(), 2);
  EXPECT_EQ(g.start_step(), 3);
  EXPECT_EQ(Members(*m), (std::vector<int64_t>{ids[0], ids[1]}));
  // Once both call in, they complete a second group at the next boundary.
  for (int r : {2, 3}) {
    absl::StatusOr<AwaitResult> standby =
        m->AwaitGeneration(ids[r], 1, absl::Now() + kPoll);
    ASSERT_TRUE(standby.ok()) << standby.status();
    EXPECT_EQ(standby->outcome, hsdp::v1::AWAIT_OUTCOME_STANDBY);
  }
  for (const auto& r : VoteAll(*m, Members(*m), 2, 3)) {
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(r->reform_after);
  }
  auto d0 = ConfirmAsync(*m, ids[0], 2);
  auto d1 = ConfirmAsync(*m, ids[1], 2);
  ASSERT_EQ(d0.get()->outcome, hsdp::v1::AWAIT_OUTCOME_FORMED);
  ASSERT_EQ(d1.get()->outcome, hsdp::v1::AWAIT_OUTCOME_FORMED);
  g = m->current_generation();
  EXPECT_EQ(g.generation(), 3);
  EXPECT_EQ(g.start_step(), 4);
  EXPECT_EQ(Members(*m),
            (std::vector<int64_t>{ids[0], ids[1], ids[2], ids[3]}));
  EXPECT_EQ(Roles(g)[2], hsdp::v1::GENERATION_ROLE_HEAL_TARGET);
  EXPECT_EQ(Roles(g)[3], hsdp::v1::GENERATION_ROLE_HEAL_TARGET);
  // And the worker history survived the restart.
  for (const WorkerSnapshot& w : m->Workers()) {
    if (w.worker_id != ids[2]) continue;
    bool stood_by = false;
    for (const auto& e : w.history) {
      stood_by |= e.kind() == hsdp::v1::WORKER_EVENT_KIND_STANDBY;
    }
    EXPECT_TRUE(stood_by);
  }
}

}  // namespace
}  // namespace hsdp::coordinator
