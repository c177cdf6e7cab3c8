// The host relay (worker/relay/host_relay.h) between real agents and a real
// coordinator, all in this process over loopback: two workers of one host
// take their schedules, vote and report through one pair of upstream streams;
// a coordinator records every message of a relayed batch and ends the stream
// with the first error; workers whose relay stops carry on by call; a local
// stream without the job token is refused.
#include "worker/relay/host_relay.h"

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "coordinator/core/membership.h"
#include "coordinator/core/metrics.h"
#include "coordinator/server.h"
#include "gtest/gtest.h"
#include "tests/worker/agent/live_coordinator.h"
#include "worker/agent/agent.h"

namespace hsdp::relay {
namespace {

constexpr char kJob[] = "job-relay";

int Votes(const std::string& metrics, const std::string& via) {
  const std::string key = "hsdp_commit_votes_total{via=\"" + via + "\"} ";
  const size_t at = metrics.find(key);
  if (at == std::string::npos) return -1;
  return std::stoi(metrics.substr(at + key.size()));
}

class HostRelayTest : public ::testing::Test {
 protected:
  void StartCoordinator(const std::string& job_token = "",
                        absl::Duration window = absl::Seconds(5)) {
    coordinator::JobConfig job;
    job.job_id = kJob;
    job.world_size = 2;
    job.mesh = MeshShape{2, 1};
    job.heartbeat_timeout = window;
    job.reform_window = window;
    job.join_wait = absl::Seconds(30);
    coordinator::ServerOptions options;
    options.job_token = job_token;
    options.listen = "127.0.0.1:0";
    options.sync_state = false;
    options.shutdown_deadline = absl::Seconds(1);
    auto server = coordinator::CoordinatorServer::Start(job, options);
    ASSERT_TRUE(server.ok()) << server.status();
    coordinator_ = *std::move(server);
  }

  // A relay on loopback in front of the coordinator.
  void StartRelay(const std::string& job_token = "") {
    agent::AgentOptions upstream_options;
    upstream_options.job_token = job_token;
    absl::Status setup;
    relay_ = std::make_unique<HostRelay>(
        agent::MakeCoordinatorChannel(upstream_options, coordinator_->address(),
                                      /*secure=*/true, &setup),
        HostRelay::Options{job_token, 64});
    ASSERT_TRUE(setup.ok()) << setup;
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                             &port);
    builder.RegisterService(relay_.get());
    relay_server_ = builder.BuildAndStart();
    ASSERT_NE(relay_server_, nullptr);
    relay_address_ = "127.0.0.1:" + std::to_string(port);
  }

  void StopRelay() {
    relay_->Stop();
    relay_server_->Shutdown();
  }

  void TearDown() override {
    if (relay_server_ != nullptr) StopRelay();
  }

  std::unique_ptr<agent::Agent> MakeAgent(int rank) {
    agent::AgentOptions o =
        agent::testing::OneUnitAgentOptions(coordinator_->address(), kJob);
    o.relay = relay_address_;
    o.rank_hint = rank;
    o.hostname = "host-a";
    o.retry_budget = absl::Seconds(5);
    o.long_poll_timeout = absl::Seconds(5);
    o.schedule_poll_timeout = absl::Seconds(5);
    return std::make_unique<agent::Agent>(o);
  }

  // The job's two workers (ranks 0 and 1), joined.
  void JoinTwo(std::unique_ptr<agent::Agent>& a,
               std::unique_ptr<agent::Agent>& b) {
    a = MakeAgent(0);
    b = MakeAgent(1);
    ASSERT_TRUE(a->Join().ok());
    ASSERT_TRUE(b->Join().ok());
  }

  // One step as the training loop runs it, on both agents: the schedule,
  // the vote (each from its own thread: a vote returns once both voted), the
  // report.
  static void Step(agent::Agent& a, agent::Agent& b, int64_t step) {
    for (agent::Agent* agent : {&a, &b}) {
      absl::StatusOr<hsdp::v1::GetScheduleResponse> s =
          agent->GetSchedule(step, 100);
      ASSERT_TRUE(s.ok()) << s.status();
      EXPECT_EQ(s->schedule().step(), step);
    }
    absl::StatusOr<hsdp::v1::CommitStepResponse> ra, rb;
    std::thread t([&] { rb = b.CommitStep(step); });
    ra = a.CommitStep(step);
    t.join();
    ASSERT_TRUE(ra.ok()) << ra.status();
    ASSERT_TRUE(rb.ok()) << rb.status();
    for (agent::Agent* agent : {&a, &b}) {
      hsdp::v1::StepReport report;
      report.set_step(step);
      report.set_loss(1.0);
      ASSERT_TRUE(agent->ReportStep(report, /*finished=*/false).ok());
    }
  }

  std::unique_ptr<coordinator::CoordinatorServer> coordinator_;
  std::unique_ptr<HostRelay> relay_;
  std::unique_ptr<grpc::Server> relay_server_;
  std::string relay_address_;
};

TEST_F(HostRelayTest, TwoWorkersShareOneStreamPairAndVoteThroughIt) {
  StartCoordinator();
  StartRelay();
  std::unique_ptr<agent::Agent> a, b;
  JoinTwo(a, b);
  if (HasFatalFailure()) return;
  constexpr int64_t kSteps = 4;
  for (int64_t step = 0; step < kSteps; ++step) {
    Step(*a, *b, step);
    if (HasFatalFailure()) return;
  }
  // The last reports are acknowledged: every streamed one was recorded first.
  for (agent::Agent* agent : {a.get(), b.get()}) {
    hsdp::v1::StepReport report;
    report.set_step(kSteps);
    ASSERT_TRUE(agent->ReportStep(report, /*finished=*/true).ok());
  }
  const std::string metrics = coordinator_->metrics().Serialize();
  // Every vote came on the (relayed) report stream, none by call.
  EXPECT_EQ(Votes(metrics, "stream"), 2 * kSteps) << metrics;
  EXPECT_EQ(Votes(metrics, "call"), 0) << metrics;
  EXPECT_EQ(coordinator_->membership().last_committed_step(), kSteps - 1);
  // Both workers' streamed reports reached the coordinator's books.
  EXPECT_GE(coordinator_->schedule_log().min_completed_step(), kSteps - 1);

  const HostRelay::Stats stats = relay_->stats();
  // One upstream schedule stream for the generation, for two local ones.
  EXPECT_EQ(stats.upstream_watches, 1);
  EXPECT_EQ(stats.local_watches, 2);
  // 2 workers x kSteps x (vote + report), in as many upstream messages or
  // fewer; one upstream report stream until the workers' last reports closed
  // it (each close waits for the coordinator to record what came before).
  EXPECT_EQ(stats.relayed, 2 * kSteps * 2);
  EXPECT_LE(stats.upstream_messages, stats.relayed);
  EXPECT_GE(stats.upstream_report_streams, 1);
  EXPECT_LE(stats.upstream_report_streams, 3);
}

// A relayed batch (one worker's vote, the other's alongside, and one that is
// refused) is recorded whole: the step commits, and the stream ends with the
// refusal.
TEST_F(HostRelayTest,
       ACoordinatorRecordsEveryRelayedMessageAndEndsWithTheFirstError) {
  StartCoordinator();
  std::unique_ptr<agent::Agent> a, b;
  JoinTwo(a, b);
  if (HasFatalFailure()) return;
  ASSERT_TRUE(a->GetSchedule(0, 10).ok());
  auto stub = hsdp::v1::CoordinatorService::NewStub(grpc::CreateChannel(
      coordinator_->address(), grpc::InsecureChannelCredentials()));
  auto vote = [](agent::Agent& agent, int64_t step) {
    hsdp::v1::CommitStepRequest v;
    v.set_job_id(kJob);
    v.set_worker_id(agent.worker_id());
    v.set_generation(agent.generation());
    v.set_step(step);
    return v;
  };
  hsdp::v1::StreamReportsRequest batch;
  // A worker the coordinator never saw: refused, before a's and b's votes in
  // the batch.
  hsdp::v1::CommitStepRequest stranger = vote(*a, 0);
  stranger.set_worker_id(a->worker_id() + b->worker_id() + 100);
  *batch.mutable_vote() = stranger;
  *batch.add_relayed()->mutable_vote() = vote(*b, 0);
  *batch.add_relayed()->mutable_vote() = vote(*a, 0);
  grpc::ClientContext context;
  hsdp::v1::StreamReportsResponse response;
  auto writer = stub->StreamReports(&context, &response);
  writer->Write(batch);
  writer->WritesDone();
  const grpc::Status ended = writer->Finish();
  EXPECT_FALSE(ended.ok());
  EXPECT_NE(ended.error_message().find(std::to_string(stranger.worker_id())),
            std::string::npos)
      << ended.error_message();
  EXPECT_EQ(coordinator_->membership().last_committed_step(), 0);

  // A relayed message with relayed messages of its own is refused, naming
  // the field; its neighbours are recorded.
  ASSERT_TRUE(a->GetSchedule(1, 10).ok());
  hsdp::v1::StreamReportsRequest nested;
  *nested.mutable_vote() = vote(*a, 1);
  hsdp::v1::StreamReportsRequest* inner = nested.add_relayed();
  *inner->add_relayed()->mutable_vote() = vote(*b, 1);
  *nested.add_relayed()->mutable_vote() = vote(*b, 1);
  grpc::ClientContext context2;
  auto writer2 = stub->StreamReports(&context2, &response);
  writer2->Write(nested);
  writer2->WritesDone();
  const grpc::Status refused = writer2->Finish();
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // Operators see how many messages came relayed: 2 per batch here.
  EXPECT_NE(
      coordinator_->metrics().Serialize().find("hsdp_relayed_messages_total 4"),
      std::string::npos)
      << coordinator_->metrics().Serialize();
  EXPECT_NE(refused.error_message().find("StreamReportsRequest.relayed"),
            std::string::npos)
      << refused.error_message();
  EXPECT_EQ(coordinator_->membership().last_committed_step(), 1);
}

// A vote the coordinator refuses, with nothing sent after it: the relay's idle
// upstream stream is probed, and the host's local streams end with the
// refusal within about a second (a voter waiting for its commit then asks
// CommitStep), rather than waiting for a message that may never come.
TEST_F(HostRelayTest, ARefusedVoteEndsTheHostsStreamsWithoutAnotherMessage) {
  StartCoordinator();
  StartRelay();
  std::unique_ptr<agent::Agent> a, b;
  JoinTwo(a, b);
  if (HasFatalFailure()) return;
  auto relay = hsdp::v1::CoordinatorService::NewStub(
      grpc::CreateChannel(relay_address_, grpc::InsecureChannelCredentials()));
  // a's schedule stream through the relay.
  grpc::ClientContext watch_context;
  watch_context.set_deadline(std::chrono::system_clock::now() +
                             std::chrono::seconds(20));
  hsdp::v1::WatchSchedulesRequest watch;
  watch.set_job_id(kJob);
  watch.set_worker_id(a->worker_id());
  watch.set_generation(a->generation());
  auto schedules = relay->WatchSchedules(&watch_context, watch);
  hsdp::v1::WatchSchedulesResponse pushed;
  ASSERT_TRUE(schedules->Read(&pushed));  // step 0: the stream is up
  // A vote of a worker the coordinator never saw: refused.
  const int64_t stranger = a->worker_id() + b->worker_id() + 100;
  grpc::ClientContext report_context;
  hsdp::v1::StreamReportsResponse response;
  auto reports = relay->StreamReports(&report_context, &response);
  hsdp::v1::StreamReportsRequest vote;
  vote.mutable_vote()->set_job_id(kJob);
  vote.mutable_vote()->set_worker_id(stranger);
  vote.mutable_vote()->set_generation(a->generation());
  vote.mutable_vote()->set_step(0);
  const absl::Time sent = absl::Now();
  ASSERT_TRUE(reports->Write(vote));
  while (schedules->Read(&pushed)) {
  }
  const grpc::Status ended = schedules->Finish();
  EXPECT_LT(absl::Now() - sent, absl::Seconds(5));
  // The refusal itself, not the generation's end (ABORTED) or the deadline.
  EXPECT_NE(ended.error_message().find(std::to_string(stranger)),
            std::string::npos)
      << ended.error_code() << ": " << ended.error_message();
  report_context.TryCancel();
}

// The relay goes away mid-job: the workers' streams end, and they go on by
// call (GetSchedule, CommitStep, ReportStep) with the same answers.
TEST_F(HostRelayTest, WorkersCarryOnByCallWhenTheRelayStops) {
  StartCoordinator();
  StartRelay();
  std::unique_ptr<agent::Agent> a, b;
  JoinTwo(a, b);
  if (HasFatalFailure()) return;
  Step(*a, *b, 0);
  if (HasFatalFailure()) return;
  StopRelay();
  relay_server_.reset();
  for (int64_t step = 1; step < 3; ++step) {
    Step(*a, *b, step);
    if (HasFatalFailure()) return;
  }
  const std::string metrics = coordinator_->metrics().Serialize();
  EXPECT_EQ(coordinator_->membership().last_committed_step(), 2);
  EXPECT_EQ(Votes(metrics, "stream"), 2) << metrics;
  EXPECT_EQ(Votes(metrics, "call"), 4) << metrics;
}

// A worker whose process dies: its stream to the relay ends, the relay says
// so upstream, and when the generation ends the next one forms without
// waiting for it, as it would without a relay (the heartbeat timeout and the
// re-form window are 30 s here).
TEST_F(HostRelayTest,
       AWorkerGoneFromTheRelayIsNotWaitedForByTheNextGeneration) {
  StartCoordinator("", absl::Seconds(30));
  StartRelay();
  std::unique_ptr<agent::Agent> a, b;
  JoinTwo(a, b);
  if (HasFatalFailure()) return;
  Step(*a, *b, 0);
  if (HasFatalFailure()) return;
  b.reset();  // its streams close, as a dead process's do
  const absl::Time start = absl::Now();
  absl::StatusOr<bool> ended = a->ReportFailure(1, "AllGather failed");
  ASSERT_TRUE(ended.ok()) << ended.status();
  absl::StatusOr<hsdp::v1::AwaitGenerationResponse> next;
  do {
    next = a->AwaitGeneration(0, absl::Seconds(20));
  } while (next.ok() && next->outcome() == hsdp::v1::AWAIT_OUTCOME_ENDED);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->outcome(), hsdp::v1::AWAIT_OUTCOME_FORMED);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(next->generation().worker_ids_size(), 1);
}

// With a job token, a local stream must carry it as a call to the coordinator
// would.
TEST_F(HostRelayTest, ALocalStreamWithoutTheJobTokenIsRefused) {
  StartCoordinator("s3cret");
  StartRelay("s3cret");
  auto stub = hsdp::v1::CoordinatorService::NewStub(
      grpc::CreateChannel(relay_address_, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  hsdp::v1::WatchSchedulesRequest request;
  request.set_job_id(kJob);
  request.set_worker_id(1);
  auto reader = stub->WatchSchedules(&context, request);
  hsdp::v1::WatchSchedulesResponse message;
  EXPECT_FALSE(reader->Read(&message));
  const grpc::Status s = reader->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_NE(s.error_message().find("authorization"), std::string::npos)
      << s.error_message();
}

}  // namespace
}  // namespace hsdp::relay
