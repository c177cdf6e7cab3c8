// Agent and CoordinatorStore against an in-process fake CoordinatorService on
// loopback.
#include "worker/agent/agent.h"

#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>

#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "worker/agent/coordinator_store.h"

namespace hsdp::agent {
namespace {

using hsdp::v1::CoordinatorService;

// A minimal coordinator: fixed rank/generation, schedules for any step, an
// in-memory store. `forget_members` makes membership calls fail NOT_FOUND until
// the next Join (a restart that lost the member list).
class FakeCoordinator final : public CoordinatorService::Service {
 public:
  grpc::Status Join(grpc::ServerContext*, const v1::JoinRequest* req,
                    v1::JoinResponse* resp) override {
    absl::MutexLock lock(&mu_);
    ++joins_;
    forget_members_ = false;
    resp->set_rank(req->has_rank_hint() ? req->rank_hint() : 3);
    resp->set_world_size(4);
    resp->mutable_mesh()->set_replicate(2);
    resp->mutable_mesh()->set_shard(2);
    resp->set_generation(7);
    resp->set_rendezvous_prefix("job/7/");
    resp->set_heartbeat_interval_ms(50);
    return grpc::Status::OK;
  }
  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest*,
                         v1::HeartbeatResponse* resp) override {
    absl::MutexLock lock(&mu_);
    ++heartbeats_;
    resp->set_generation(heartbeat_generation_);
    return grpc::Status::OK;
  }
  grpc::Status GetSchedule(grpc::ServerContext*,
                           const v1::GetScheduleRequest* req,
                           v1::GetScheduleResponse* resp) override {
    absl::MutexLock lock(&mu_);
    if (forget_members_)
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown worker");
    schedule_requests_.push_back(req->step());
    if (abort_schedules_) {
      return grpc::Status(grpc::StatusCode::ABORTED, "generation 7 ended");
    }
    if (req->step() > drain_after_) {
      resp->set_drained(true);
    } else {
      resp->mutable_schedule()->set_step(req->step());
    }
    return grpc::Status::OK;
  }
  grpc::Status ReportStep(grpc::ServerContext*,
                          const v1::ReportStepRequest* req,
                          v1::ReportStepResponse*) override {
    absl::MutexLock lock(&mu_);
    if (forget_members_)
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown worker");
    reported_.push_back(req->report().step());
    return grpc::Status::OK;
  }
  grpc::Status StoreSet(grpc::ServerContext*, const v1::StoreSetRequest* req,
                        v1::StoreSetResponse*) override {
    absl::MutexLock lock(&mu_);
    store_[req->key()] = req->value();
    return grpc::Status::OK;
  }
  grpc::Status StoreGet(grpc::ServerContext*, const v1::StoreGetRequest* req,
                        v1::StoreGetResponse* resp) override {
    absl::MutexLock lock(&mu_);
    // Abseil evaluates a Condition with mu_ held.
    auto present = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return store_.count(req->key()) > 0;
    };
    if (!mu_.AwaitWithTimeout(absl::Condition(&present),
                              absl::Milliseconds(req->timeout_ms()))) {
      return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                          "missing " + req->key());
    }
    resp->set_value(store_[req->key()]);
    return grpc::Status::OK;
  }
  grpc::Status StoreWait(grpc::ServerContext*, const v1::StoreWaitRequest* req,
                         v1::StoreWaitResponse*) override {
    absl::MutexLock lock(&mu_);
    auto present = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      for (const auto& k : req->keys()) {
        if (!store_.count(k)) return false;
      }
      return true;
    };
    if (!mu_.AwaitWithTimeout(absl::Condition(&present),
                              absl::Milliseconds(req->timeout_ms()))) {
      return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "missing keys");
    }
    return grpc::Status::OK;
  }

  absl::Mutex mu_;
  int joins_ ABSL_GUARDED_BY(mu_) = 0;
  int heartbeats_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t heartbeat_generation_ ABSL_GUARDED_BY(mu_) = 7;
  int64_t drain_after_ ABSL_GUARDED_BY(mu_) = 1000;
  int64_t hold_after_ ABSL_GUARDED_BY(mu_) = 1000;
  bool forget_members_ ABSL_GUARDED_BY(mu_) = false;
  bool abort_schedules_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<int64_t> schedule_requests_ ABSL_GUARDED_BY(mu_);
  std::vector<int64_t> reported_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> store_ ABSL_GUARDED_BY(mu_);
};

std::unique_ptr<grpc::Server> Serve(FakeCoordinator* service,
                                    const std::string& address, int* port) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), port);
  builder.RegisterService(service);
  return builder.BuildAndStart();
}

AgentOptions Options(int port) {
  AgentOptions o;
  o.coordinator = "127.0.0.1:" + std::to_string(port);
  o.job_id = "job";
  o.model = "gpt-tiny";
  o.retry_budget = absl::Seconds(10);
  o.initial_backoff = absl::Milliseconds(20);
  o.max_backoff = absl::Milliseconds(200);
  return o;
}

TEST(AgentTest, JoinScheduleWithPrefetchReportAndHeartbeat) {
  FakeCoordinator fake;
  int port = 0;
  auto server = Serve(&fake, "127.0.0.1:0", &port);
  ASSERT_GT(port, 0);
  Agent agent(Options(port));
  auto join = agent.Join();
  ASSERT_TRUE(join.ok()) << join.status();
  EXPECT_EQ(join->rank(), 3);
  EXPECT_EQ(agent.generation(), 7);
  agent.StartHeartbeat();

  auto s0 = agent.GetSchedule(0, 2);
  ASSERT_TRUE(s0.ok()) << s0.status();
  EXPECT_EQ(s0->schedule().step(), 0);
  // Step 1 is fetched in the background without being asked for.
  for (int i = 0; i < 200; ++i) {
    {
      absl::MutexLock lock(&fake.mu_);
      if (fake.schedule_requests_.size() == 2) break;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  auto s1 = agent.GetSchedule(1, 2);
  ASSERT_TRUE(s1.ok());
  EXPECT_EQ(s1->schedule().step(), 1);
  auto s2 = agent.GetSchedule(2, 2);
  ASSERT_TRUE(s2.ok());
  {
    absl::MutexLock lock(&fake.mu_);
    // Each step fetched exactly once and nothing past last_step.
    EXPECT_EQ(fake.schedule_requests_, (std::vector<int64_t>{0, 1, 2}));
  }
  v1::StepReport report;
  report.set_step(2);
  ASSERT_TRUE(agent.ReportStep(report, true).ok());
  absl::SleepFor(absl::Milliseconds(300));
  absl::MutexLock lock(&fake.mu_);
  EXPECT_GE(fake.heartbeats_, 2);
  EXPECT_EQ(fake.reported_, (std::vector<int64_t>{2}));
}

// A coordinator without StreamReports (UNIMPLEMENTED) gets every report by
// ReportStep, in order, none lost.
TEST(AgentTest, ReportsGoByCallWhenTheCoordinatorStreamsNone) {
  FakeCoordinator fake;
  int port = 0;
  auto server = Serve(&fake, "127.0.0.1:0", &port);
  Agent agent(Options(port));
  ASSERT_TRUE(agent.Join().ok());
  for (int64_t step = 0; step < 3; ++step) {
    v1::StepReport report;
    report.set_step(step);
    ASSERT_TRUE(agent.ReportStep(report, /*finished=*/false).ok()) << step;
  }
  absl::MutexLock lock(&fake.mu_);
  EXPECT_EQ(fake.reported_, (std::vector<int64_t>{0, 1, 2}));
}

TEST(AgentTest, DrainedStopsPrefetch) {
  FakeCoordinator fake;
  {
    absl::MutexLock lock(&fake.mu_);
    fake.drain_after_ = 0;
  }
  int port = 0;
  auto server = Serve(&fake, "127.0.0.1:0", &port);
  Agent agent(Options(port));
  ASSERT_TRUE(agent.Join().ok());
  ASSERT_FALSE(agent.GetSchedule(0, 10)->drained());
  EXPECT_TRUE(agent.GetSchedule(1, 10)->drained());
}

TEST(AgentTest, DestructorCancelsAnInFlightLongPoll) {
  FakeCoordinator fake;
  {
    absl::MutexLock lock(&fake.mu_);
    fake.hold_after_ = 0;
  }
  int port = 0;
  auto server = Serve(&fake, "127.0.0.1:0", &port);
  AgentOptions o = Options(port);
  o.schedule_poll_timeout = absl::Seconds(30);
  auto agent = std::make_unique<Agent>(o);
  ASSERT_TRUE(agent->Join().ok());
  ASSERT_TRUE(agent->GetSchedule(0, 10)
                  .ok());  // starts the prefetch of step 1, which hangs
  absl::SleepFor(absl::Milliseconds(100));
  const absl::Time start = absl::Now();
  agent.reset();
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
}

TEST(AgentTest, SurvivesCoordinatorRestartOnSamePort) {
  auto fake = std::make_unique<FakeCoordinator>();
  int port = 0;
  auto server = Serve(fake.get(), "127.0.0.1:0", &port);
  Agent agent(Options(port));
  ASSERT_TRUE(agent.Join().ok());
  server->Shutdown();
  server.reset();
  // Restart 500 ms later, forgetting the member list, while the agent is
  // already retrying.
  auto fake2 = std::make_unique<FakeCoordinator>();
  {
    absl::MutexLock lock(&fake2->mu_);
    fake2->forget_members_ = true;
  }
  std::unique_ptr<grpc::Server> server2;
  std::thread restarter([&] {
    absl::SleepFor(absl::Milliseconds(500));
    int p2 = 0;
    server2 = Serve(fake2.get(), "127.0.0.1:" + std::to_string(port), &p2);
  });
  auto s = agent.GetSchedule(5, 5);
  restarter.join();
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->schedule().step(), 5);
  absl::MutexLock lock(&fake2->mu_);
  EXPECT_EQ(fake2->joins_, 1);  // re-joined exactly once
}

TEST(AgentTest, UnreachableCoordinatorGivesUpWithinBudget) {
  FakeCoordinator fake;
  int port = 0;
  auto server = Serve(&fake, "127.0.0.1:0", &port);
  server->Shutdown();
  server.reset();
  AgentOptions o = Options(port);
  o.retry_budget = absl::Milliseconds(600);
  Agent agent(o);
  const absl::Time start = absl::Now();
  auto join = agent.Join();
  ASSERT_FALSE(join.ok());
  EXPECT_EQ(join.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(join.status().message().find("unreachable"), std::string::npos);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

TEST(AgentTest, GenerationChangeIsReported) {
  FakeCoordinator fake;
  int port = 0;
  auto server = Serve(&fake, "127.0.0.1:0", &port);
  Agent agent(Options(port));
  ASSERT_TRUE(agent.Join().ok());
  agent.StartHeartbeat();
  {
    absl::MutexLock lock(&fake.mu_);
    fake.heartbeat_generation_ = 8;
  }
  for (int i = 0; i < 100 && agent.membership_status().ok(); ++i) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(agent.membership_status().code(), absl::StatusCode::kAborted);
}

// ABORTED has one meaning — the generation ended, re-form — so the agent
// hands it back at once instead of retrying.
TEST(AgentTest, AbortedIsReturnedAtOnceNotRetried) {
  FakeCoordinator fake;
  {
    absl::MutexLock lock(&fake.mu_);
    fake.abort_schedules_ = true;
  }
  int port = 0;
  auto server = Serve(&fake, "127.0.0.1:0", &port);
  Agent agent(Options(port));
  ASSERT_TRUE(agent.Join().ok());
  const absl::Time start = absl::Now();
  absl::StatusOr<v1::GetScheduleResponse> s = agent.GetSchedule(0, 0);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kAborted);
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  absl::MutexLock lock(&fake.mu_);
  EXPECT_EQ(fake.schedule_requests_.size(), 1u);
}

TEST(CoordinatorStoreTest, SetGetWaitThroughRpcs) {
  FakeCoordinator fake;
  int port = 0;
  auto server = Serve(&fake, "127.0.0.1:0", &port);
  Agent agent(Options(port));
  ASSERT_TRUE(agent.Join().ok());
  CoordinatorStore store(agent, agent.join_response().rendezvous_prefix());
  std::thread setter([&] {
    absl::SleepFor(absl::Milliseconds(100));
    ASSERT_TRUE(store.Set("a", "1").ok());
  });
  auto a = store.Get("a", absl::Seconds(5));  // blocks until set
  setter.join();
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(*a, "1");
  {
    absl::MutexLock lock(&fake.mu_);
    EXPECT_EQ(fake.store_.count("job/7/a"), 1u);  // prefixed
  }
  EXPECT_TRUE(store.Wait({"a"}, absl::Seconds(1)).ok());
  auto missing = store.Get("b", absl::Milliseconds(100));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kDeadlineExceeded);
}

}  // namespace
}  // namespace hsdp::agent
