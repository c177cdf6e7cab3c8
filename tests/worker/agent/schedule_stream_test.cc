// The worker's schedule stream (worker/agent/schedule_stream.h) and the
// Agent's use of it, against a real in-process coordinator on loopback: the
// pushed schedules are the sealed ones, a drain reaches the worker, and a
// coordinator restart on its state directory costs no step.
#include "worker/agent/schedule_stream.h"

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <memory>
#include <string>

#include "absl/time/clock.h"
#include "coordinator/server.h"
#include "gtest/gtest.h"
#include "tests/worker/agent/live_coordinator.h"
#include "worker/agent/agent.h"

namespace hsdp::agent {
namespace {

constexpr char kJob[] = "job-stream";

std::unique_ptr<coordinator::CoordinatorServer> StartCoordinator(
    const std::string& listen, const std::string& state_dir = "") {
  return testing::StartOneRankCoordinator(kJob, listen, state_dir);
}

AgentOptions Options(const std::string& address) {
  return testing::OneUnitAgentOptions(address, kJob);
}

std::string SealedBytes(coordinator::CoordinatorServer& server, int64_t step) {
  auto sealed = server.schedule_log().GetSealed(step);
  EXPECT_TRUE(sealed.ok()) << sealed.status();
  return sealed.ok() ? (*sealed)->bytes : "";
}

TEST(ScheduleStreamTest, TakesPushedStepsAndTimesOutBeyondThem) {
  auto server = StartCoordinator("127.0.0.1:0");
  ASSERT_NE(server, nullptr);
  Agent agent(Options(server->address()));
  ASSERT_TRUE(agent.Join().ok());
  auto stub = hsdp::v1::CoordinatorService::NewStub(grpc::CreateChannel(
      server->address(), grpc::InsecureChannelCredentials()));
  ScheduleStream stream(stub.get(), kJob, agent.worker_id(), 0,
                        agent.generation(), 0, ScheduleStream::Options());
  // Push-ahead 1: steps 0 and 1 before any report.
  for (int64_t step : {0, 1}) {
    auto taken = stream.Take(step, absl::Seconds(10));
    ASSERT_TRUE(taken.has_value()) << step;
    EXPECT_EQ(taken->schedule().SerializeAsString(),
              SealedBytes(*server, step));
  }
  // Step 2 needs the report of step 0: not within 200 ms.
  const absl::Time start = absl::Now();
  EXPECT_FALSE(stream.Take(2, absl::Milliseconds(200)).has_value());
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(190));
  hsdp::v1::StepReport report;
  report.set_rank(0);
  report.set_step(0);
  ASSERT_TRUE(agent.ReportStep(report, false).ok());
  auto taken = stream.Take(2, absl::Seconds(10));
  ASSERT_TRUE(taken.has_value());
  EXPECT_EQ(taken->schedule().step(), 2);
  EXPECT_FALSE(stream.unsupported());
}

// The Agent takes every step from the stream, ends at the drain, and rides
// over a coordinator restart: every step it got is the sealed one.
TEST(ScheduleStreamTest, AgentFollowsTheStreamThroughARestartToTheDrain) {
  const std::string dir = ::testing::TempDir() + "/hsdp-schedule-stream-" +
                          std::to_string(getpid());
  std::filesystem::remove_all(dir);
  auto server = StartCoordinator("127.0.0.1:0", dir);
  ASSERT_NE(server, nullptr);
  const int port = server->port();
  const std::string address = server->address();
  Agent agent(Options(address));
  ASSERT_TRUE(agent.Join().ok());
  agent.StartHeartbeat();
  std::map<int64_t, std::string> got;
  auto run = [&](int64_t first, int64_t last) {
    for (int64_t step = first; step <= last; ++step) {
      agent.SetCurrentStep(step);
      auto response = agent.GetSchedule(step, 1000);
      ASSERT_TRUE(response.ok()) << response.status();
      ASSERT_FALSE(response->drained()) << step;
      EXPECT_EQ(response->schedule().step(), step);
      got[step] = response->schedule().SerializeAsString();
      hsdp::v1::StepReport report;
      report.set_rank(0);
      report.set_step(step);
      ASSERT_TRUE(agent.ReportStep(report, false).ok());
    }
  };
  run(0, 3);
  for (int64_t step = 0; step <= 3; ++step) {
    EXPECT_EQ(got[step], SealedBytes(*server, step)) << step;
  }
  server->Shutdown();
  server.reset();
  server = StartCoordinator(coordinator::WithPort("127.0.0.1:0", port), dir);
  ASSERT_NE(server, nullptr);
  run(4, 7);
  for (int64_t step = 4; step <= 7; ++step) {
    EXPECT_EQ(got[step], SealedBytes(*server, step)) << step;
  }
  auto drain = server->schedule_log().Drain();
  ASSERT_TRUE(drain.ok());
  run(8, *drain);
  auto past = agent.GetSchedule(*drain + 1, 1000);
  ASSERT_TRUE(past.ok()) << past.status();
  EXPECT_TRUE(past->drained());
}

}  // namespace
}  // namespace hsdp::agent
