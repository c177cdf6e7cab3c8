// The agent's elastic calls against a real coordinator in this process:
// commits (by call, and on the report and schedule streams), a failure report
// aborting a waiting vote, the generation watcher
// firing when a worker dies, re-forming smaller, a replacement joining and
// being healed, and a lost worker joining again as a new one.
#include <unistd.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/units.h"
#include "coordinator/core/membership.h"
#include "coordinator/core/metrics.h"
#include "coordinator/server.h"
#include "gtest/gtest.h"
#include "worker/agent/agent.h"
#include "worker/agent/coordinator_store.h"

namespace hsdp::agent {
namespace {

constexpr char kJob[] = "job-elastic";
constexpr absl::Duration kHeartbeatTimeout = absl::Seconds(1);
// Everything below happens within seconds; this only bounds a broken run.
constexpr absl::Duration kLong = absl::Seconds(20);

std::vector<hsdp::v1::UnitInfo> Units() {
  std::vector<hsdp::v1::UnitInfo> units(2);
  units[0].set_name("root");
  units[0].set_param_count(100);
  units[0].set_param_bytes(400);
  units[1].set_name("layers.0");
  units[1].set_param_count(50);
  units[1].set_param_bytes(200);
  return units;
}

// Records the watcher's calls.
struct WatchLog {
  void Add(const absl::Status& s) {
    absl::MutexLock lock(&mu);
    ends.push_back(s);
  }
  // Waits until `n` ends were seen; returns them.
  std::vector<absl::Status> WaitFor(size_t n) {
    absl::MutexLock lock(&mu);
    auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
      return ends.size() >= n;
    };
    mu.AwaitWithTimeout(absl::Condition(&enough), kLong);
    return ends;
  }
  absl::Mutex mu;
  std::vector<absl::Status> ends ABSL_GUARDED_BY(mu);
};

class AgentElasticTest : public ::testing::Test {
 protected:
  void StartServer(MeshShape mesh, const std::string& state_dir = "",
                   int port = 0,
                   absl::Duration heartbeat_timeout = kHeartbeatTimeout) {
    coordinator::JobConfig job;
    job.job_id = kJob;
    job.world_size = mesh.world_size();
    job.mesh = mesh;
    job.heartbeat_timeout = heartbeat_timeout;
    job.reform_window = absl::Seconds(1);
    job.join_wait = absl::Seconds(30);
    job.state_dir = state_dir;
    coordinator::ServerOptions options;
    options.listen = "127.0.0.1:" + std::to_string(port);
    options.sync_state = false;
    auto server = coordinator::CoordinatorServer::Start(job, options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }

  std::unique_ptr<Agent> MakeAgent(std::optional<int> rank_hint) {
    AgentOptions o;
    o.coordinator = server_->address();
    o.job_id = kJob;
    o.rank_hint = rank_hint;
    o.hostname = "host";
    o.model = "m";
    o.units = Units();
    o.retry_budget = absl::Seconds(5);
    o.initial_backoff = absl::Milliseconds(20);
    o.max_backoff = absl::Milliseconds(200);
    o.long_poll_timeout = absl::Seconds(5);
    return std::make_unique<Agent>(o);
  }

  // A 2x1 job whose second member never heartbeats: returns once the first
  // one is in the next generation (formed without the second, declared lost).
  void LoseTheSecondMember(std::unique_ptr<Agent>& a,
                           std::unique_ptr<Agent>& b) {
    StartServer({2, 1});
    a = MakeAgent(0);
    b = MakeAgent(1);
    ASSERT_TRUE(a->Join().ok());
    ASSERT_TRUE(b->Join().ok());
    a->StartHeartbeat();  // b never beats
    absl::StatusOr<hsdp::v1::AwaitGenerationResponse> na;
    for (;;) {
      na = a->AwaitGeneration(0, kLong);
      if (!na.ok() || na->outcome() != hsdp::v1::AWAIT_OUTCOME_ENDED) break;
    }
    ASSERT_TRUE(na.ok()) << na.status();
    ASSERT_EQ(na->outcome(), hsdp::v1::AWAIT_OUTCOME_FORMED);
  }

  std::unique_ptr<coordinator::CoordinatorServer> server_;
};

// Both members vote from their own threads: each vote returns once both did.
void CommitBoth(Agent& a, Agent& b, int64_t step, bool reform_after) {
  absl::StatusOr<hsdp::v1::CommitStepResponse> ra, rb;
  std::thread t([&] { rb = b.CommitStep(step); });
  ra = a.CommitStep(step);
  t.join();
  ASSERT_TRUE(ra.ok()) << ra.status();
  ASSERT_TRUE(rb.ok()) << rb.status();
  EXPECT_EQ(ra->reform_after(), reform_after);
}

TEST_F(AgentElasticTest, WatcherFiresWhenAPeerDiesThenTheJobShrinksAndGrows) {
  StartServer({2, 1});
  auto a = MakeAgent(0);
  auto b = MakeAgent(1);
  ASSERT_TRUE(a->Join().ok());
  ASSERT_TRUE(b->Join().ok());
  EXPECT_NE(a->worker_id(), b->worker_id());
  WatchLog watch;
  a->StartHeartbeat();
  b->StartHeartbeat();
  a->StartGenerationWatch(
      [&](int64_t, const absl::Status& s) { watch.Add(s); });
  CommitBoth(*a, *b, 0, false);
  CommitBoth(*a, *b, 1, false);

  // b dies (its heartbeats and calls stop); a's watcher hears of the end
  // without a's training thread doing anything.
  const absl::Time died = absl::Now();
  b.reset();
  std::vector<absl::Status> ends = watch.WaitFor(1);
  ASSERT_EQ(ends.size(), 1u);
  EXPECT_EQ(ends[0].code(), absl::StatusCode::kAborted) << ends[0];
  EXPECT_LT(absl::Now() - died, kHeartbeatTimeout * 4);
  // The watcher confirmed already: a's next generation is waiting for it.
  absl::StatusOr<hsdp::v1::AwaitGenerationResponse> next =
      a->AwaitGeneration(0, kLong);
  ASSERT_TRUE(next.ok()) << next.status();
  ASSERT_EQ(next->outcome(), hsdp::v1::AWAIT_OUTCOME_FORMED);
  EXPECT_EQ(next->generation().generation(), 1);
  EXPECT_EQ(next->generation().start_step(), 2);
  EXPECT_EQ(a->generation(), 1);
  EXPECT_EQ(a->rank(), 0);
  EXPECT_EQ(a->join_response().world_size(), 1);
  EXPECT_EQ(a->join_response().rendezvous_prefix(), "hsdp/job-elastic/gen-1/");
  // The rendezvous store follows the adopted generation.
  CoordinatorStore store(*a, a->join_response().rendezvous_prefix());
  ASSERT_TRUE(store.Set("k", "v").ok());
  EXPECT_EQ(*store.Get("k", absl::Seconds(1)), "v");
  absl::StatusOr<hsdp::v1::CommitStepResponse> alone = a->CommitStep(2);
  ASSERT_TRUE(alone.ok()) << alone.status();
  EXPECT_FALSE(alone->reform_after());

  // A replacement joins, stands by, and is taken in at the next boundary.
  auto c = MakeAgent(std::nullopt);
  absl::StatusOr<hsdp::v1::JoinResponse> joined = c->Join();
  ASSERT_TRUE(joined.ok()) << joined.status();
  EXPECT_EQ(joined->worker_state(), hsdp::v1::WORKER_STATE_JOINING);
  c->StartHeartbeat();
  absl::StatusOr<hsdp::v1::AwaitGenerationResponse> standby =
      c->AwaitGeneration(-1, kLong);
  ASSERT_TRUE(standby.ok()) << standby.status();
  EXPECT_EQ(standby->outcome(), hsdp::v1::AWAIT_OUTCOME_STANDBY);
  absl::StatusOr<hsdp::v1::AwaitGenerationResponse> taken_in;
  std::thread waiting([&] { taken_in = c->AwaitGeneration(1, kLong); });
  absl::StatusOr<hsdp::v1::CommitStepResponse> boundary = a->CommitStep(3);
  ASSERT_TRUE(boundary.ok()) << boundary.status();
  EXPECT_TRUE(boundary->reform_after());
  EXPECT_EQ(watch.WaitFor(2).size(), 2u);
  next = a->AwaitGeneration(1, kLong);
  waiting.join();
  ASSERT_TRUE(next.ok()) << next.status();
  ASSERT_EQ(next->outcome(), hsdp::v1::AWAIT_OUTCOME_FORMED);
  ASSERT_TRUE(taken_in.ok()) << taken_in.status();
  ASSERT_EQ(taken_in->outcome(), hsdp::v1::AWAIT_OUTCOME_FORMED);
  const hsdp::v1::Generation& g = taken_in->generation();
  EXPECT_EQ(g.generation(), 2);
  EXPECT_EQ(g.start_step(), 4);
  EXPECT_EQ(c->rank(), 1);
  EXPECT_EQ(g.roles(0), hsdp::v1::GENERATION_ROLE_HEAL_SOURCE);
  EXPECT_EQ(g.roles(1), hsdp::v1::GENERATION_ROLE_HEAL_TARGET);
  ASSERT_EQ(g.heal_plans_size(), 1);
  CommitBoth(*a, *c, 4, false);
}

// A failure report ends the generation at once: the other member's waiting
// vote comes back ABORTED (not retried), and both re-form.
TEST_F(AgentElasticTest, FailureReportAbortsAWaitingVote) {
  StartServer({2, 1});
  auto a = MakeAgent(0);
  auto b = MakeAgent(1);
  ASSERT_TRUE(a->Join().ok());
  ASSERT_TRUE(b->Join().ok());
  absl::StatusOr<hsdp::v1::CommitStepResponse> vote;
  absl::Time voted_back;
  std::thread voter([&] {
    vote = b->CommitStep(0);
    voted_back = absl::Now();
  });
  absl::SleepFor(absl::Milliseconds(100));
  const absl::Time reported = absl::Now();
  absl::StatusOr<bool> ended = a->ReportFailure(0, "AllGather failed");
  voter.join();
  ASSERT_TRUE(ended.ok()) << ended.status();
  EXPECT_TRUE(*ended);
  EXPECT_EQ(vote.status().code(), absl::StatusCode::kAborted) << vote.status();
  EXPECT_LT(voted_back - reported, absl::Seconds(1));
  // Other calls of the ended generation say the same.
  EXPECT_EQ(b->GetSchedule(0, 0).status().code(), absl::StatusCode::kAborted);
  absl::StatusOr<hsdp::v1::AwaitGenerationResponse> nb;
  std::thread other([&] { nb = b->AwaitGeneration(0, kLong); });
  absl::StatusOr<hsdp::v1::AwaitGenerationResponse> na =
      a->AwaitGeneration(0, kLong);
  other.join();
  ASSERT_TRUE(na.ok() && nb.ok());
  EXPECT_EQ(na->outcome(), hsdp::v1::AWAIT_OUTCOME_FORMED);
  EXPECT_EQ(nb->outcome(), hsdp::v1::AWAIT_OUTCOME_FORMED);
  EXPECT_EQ(a->generation(), 1);
  // The new generation's schedules (the step that aborted, again).
  absl::StatusOr<hsdp::v1::GetScheduleResponse> s = b->GetSchedule(0, 0);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->schedule().generation(), 1);
  CommitBoth(*a, *b, 0, false);
  // The failure and what it cost (measured up to that first commit).
  const std::string metrics = server_->metrics().Serialize();
  EXPECT_NE(metrics.find("hsdp_generation_ends_total{cause=\"FAILURE_CAUSE_"
                         "REPORTED\"} 1"),
            std::string::npos)
      << metrics;
  EXPECT_NE(metrics.find("hsdp_failure_seconds_count{phase=\"lost\"} 1"),
            std::string::npos)
      << metrics;
  EXPECT_NE(metrics.find("hsdp_committed_step 0"), std::string::npos);
  const coordinator::MembershipStatus status = server_->membership().Status();
  ASSERT_TRUE(status.last_failure.has_value());
  EXPECT_GT(status.last_failure->recovered_unix_ms(), 0);
}

// The count of `hsdp_commit_votes_total{via="<via>"}` in `metrics`, or -1.
int Votes(const std::string& metrics, const std::string& via) {
  const std::string key = "hsdp_commit_votes_total{via=\"" + via + "\"} ";
  const size_t at = metrics.find(key);
  if (at == std::string::npos) return -1;
  return std::stoi(metrics.substr(at + key.size()));
}

// Agents that take their schedules from the schedule stream vote on the
// report stream and get the commit on the schedule stream: no CommitStep call.
// A member's failure ends a vote waiting there at once; the answer then comes
// by call (ABORTED).
TEST_F(AgentElasticTest, VotesGoOnTheStreamsAndAFailureEndsAWaitingOneAtOnce) {
  StartServer({2, 1});
  auto a = MakeAgent(0);
  auto b = MakeAgent(1);
  ASSERT_TRUE(a->Join().ok());
  ASSERT_TRUE(b->Join().ok());
  // Steps as the training loop runs them: schedule (from the stream), vote,
  // report.
  auto take_schedule = [](Agent& agent, int64_t step) {
    absl::StatusOr<hsdp::v1::GetScheduleResponse> s =
        agent.GetSchedule(step, 10);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(s->schedule().step(), step);
  };
  constexpr int64_t kSteps = 4;
  for (int64_t step = 0; step < kSteps; ++step) {
    take_schedule(*a, step);
    take_schedule(*b, step);
    CommitBoth(*a, *b, step, false);
    for (Agent* agent : {a.get(), b.get()}) {
      hsdp::v1::StepReport report;
      report.set_step(step);
      ASSERT_TRUE(agent->ReportStep(report, /*finished=*/false).ok());
    }
  }
  std::string metrics = server_->metrics().Serialize();
  EXPECT_EQ(Votes(metrics, "stream"), 2 * kSteps) << metrics;
  EXPECT_EQ(Votes(metrics, "call"), 0) << metrics;
  EXPECT_NE(metrics.find("hsdp_committed_step 3"), std::string::npos);

  take_schedule(*a, kSteps);
  take_schedule(*b, kSteps);
  absl::StatusOr<hsdp::v1::CommitStepResponse> vote;
  absl::Time voted_back;
  std::thread voter([&] {
    vote = b->CommitStep(kSteps);
    voted_back = absl::Now();
  });
  // Until the streamed vote is counted.
  const absl::Time deadline = absl::Now() + kLong;
  while (Votes(server_->metrics().Serialize(), "stream") < 2 * kSteps + 1 &&
         absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  const absl::Time reported = absl::Now();
  absl::StatusOr<bool> ended = a->ReportFailure(kSteps, "AllGather failed");
  voter.join();
  ASSERT_TRUE(ended.ok()) << ended.status();
  EXPECT_TRUE(*ended);
  EXPECT_EQ(vote.status().code(), absl::StatusCode::kAborted) << vote.status();
  EXPECT_LT(voted_back - reported, absl::Seconds(1));
  metrics = server_->metrics().Serialize();
  EXPECT_EQ(Votes(metrics, "stream"), 2 * kSteps + 1) << metrics;
  EXPECT_EQ(Votes(metrics, "call"), 1) << metrics;
}

// The coordinator restarts (same port, same state directory) while one vote
// waits: the agents retry, vote again on the restarted coordinator, and the
// step commits once for both.
TEST_F(AgentElasticTest, VotesSurviveACoordinatorRestart) {
  const std::string dir = ::testing::TempDir() + "/agent_elastic_restart_" +
                          std::to_string(getpid());
  StartServer({2, 1}, dir, 0, absl::Seconds(30));
  const int port = server_->port();
  auto a = MakeAgent(0);
  auto b = MakeAgent(1);
  ASSERT_TRUE(a->Join().ok());
  ASSERT_TRUE(b->Join().ok());
  // As ranks do: a step is fetched (sealed, persisted) before it is trained
  // and committed; the restarted coordinator refuses a committed step with no
  // sealed record.
  ASSERT_TRUE(a->GetSchedule(0, 0).ok());
  CommitBoth(*a, *b, 0, false);
  ASSERT_TRUE(a->GetSchedule(1, 0).ok());
  absl::StatusOr<hsdp::v1::CommitStepResponse> waiting;
  std::thread voter([&] { waiting = a->CommitStep(1); });
  absl::SleepFor(absl::Milliseconds(100));
  server_->Shutdown();
  server_.reset();
  StartServer({2, 1}, dir, port, absl::Seconds(30));
  absl::StatusOr<hsdp::v1::CommitStepResponse> second = b->CommitStep(1);
  voter.join();
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_TRUE(waiting.ok()) << waiting.status();
  EXPECT_EQ(server_->membership().last_committed_step(), 1);
  EXPECT_EQ(a->generation(), 0);
  // A vote retried for the step committed before the restart: the same.
  absl::StatusOr<hsdp::v1::CommitStepResponse> again = a->CommitStep(0);
  EXPECT_TRUE(again.ok()) << again.status();
}

// A worker the coordinator declared lost (it stopped heartbeating) is told so
// and joins again as a new worker.
TEST_F(AgentElasticTest, LostWorkerJoinsAgainAsANewWorker) {
  std::unique_ptr<Agent> a, b;
  LoseTheSecondMember(a, b);
  ASSERT_FALSE(HasFatalFailure());
  const int64_t old_id = b->worker_id();
  absl::StatusOr<hsdp::v1::AwaitGenerationResponse> nb =
      b->AwaitGeneration(0, kLong);
  EXPECT_EQ(nb.status().code(), absl::StatusCode::kFailedPrecondition)
      << nb.status();
  absl::StatusOr<hsdp::v1::JoinResponse> again = b->Join();
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_NE(again->worker_id(), old_id);
  EXPECT_EQ(again->worker_state(), hsdp::v1::WORKER_STATE_JOINING);
}

// A member that was declared lost while its training thread was between calls
// (its heartbeats never arrived): the next schedule call says re-form
// (ABORTED), not a fatal error, and waiting for a generation then says join
// again.
TEST_F(AgentElasticTest, ALostMembersScheduleCallSaysReForm) {
  std::unique_ptr<Agent> a, b;
  LoseTheSecondMember(a, b);
  ASSERT_FALSE(HasFatalFailure());
  absl::StatusOr<hsdp::v1::GetScheduleResponse> schedule =
      b->GetSchedule(0, 10);
  EXPECT_EQ(schedule.status().code(), absl::StatusCode::kAborted)
      << schedule.status();
  EXPECT_NE(schedule.status().message().find("declared lost"),
            std::string::npos)
      << schedule.status();
  absl::StatusOr<hsdp::v1::AwaitGenerationResponse> nb =
      b->AwaitGeneration(0, kLong);
  EXPECT_EQ(nb.status().code(), absl::StatusCode::kFailedPrecondition)
      << nb.status();
}

}  // namespace
}  // namespace hsdp::agent
