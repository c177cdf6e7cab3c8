// The worker's report stream (worker/agent/report_stream.h) and the Agent's
// use of it, against a real in-process coordinator on loopback: reports sent
// on the stream are all recorded once it closes, a refused report ends the
// stream and the next one opens a new stream, and across a coordinator
// restart every ReportStep succeeds and the worker's last report is
// acknowledged after every streamed one. (A streamed report in flight when the
// coordinator goes away can be lost, as a pushed schedule can: the next report
// supersedes it.)
#include "worker/agent/report_stream.h"

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <filesystem>
#include <memory>
#include <string>

#include "absl/time/clock.h"
#include "coordinator/core/membership.h"
#include "coordinator/server.h"
#include "gtest/gtest.h"
#include "tests/worker/agent/live_coordinator.h"
#include "worker/agent/agent.h"

namespace hsdp::agent {
namespace {

constexpr char kJob[] = "job-report-stream";

std::unique_ptr<coordinator::CoordinatorServer> StartCoordinator(
    const std::string& listen, const std::string& state_dir = "") {
  return testing::StartOneRankCoordinator(kJob, listen, state_dir);
}

AgentOptions Options(const std::string& address) {
  return testing::OneUnitAgentOptions(address, kJob);
}

bool Connected(grpc::Channel& channel) {
  return channel.WaitForConnected(
      absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
}

hsdp::v1::StepReport Report(int64_t step) {
  hsdp::v1::StepReport report;
  report.set_rank(0);
  report.set_step(step);
  report.set_loss(static_cast<double>(step));
  return report;
}

TEST(AgentReportStreamTest, SentReportsAreRecordedByClose) {
  auto server = StartCoordinator("127.0.0.1:0");
  ASSERT_NE(server, nullptr);
  Agent agent(Options(server->address()));
  ASSERT_TRUE(agent.Join().ok());
  auto channel = grpc::CreateChannel(server->address(),
                                     grpc::InsecureChannelCredentials());
  // Not connected yet: the report goes by call.
  EXPECT_TRUE(absl::IsUnavailable(
      ReportStream(channel).Send(hsdp::v1::ReportStepRequest())));
  ASSERT_TRUE(Connected(*channel));
  ReportStream stream(channel);
  for (int64_t step = 0; step < 5; ++step) {
    hsdp::v1::ReportStepRequest request;
    request.set_job_id(kJob);
    *request.mutable_report() = Report(step);
    request.mutable_report()->set_worker_id(agent.worker_id());
    request.mutable_report()->set_generation(agent.generation());
    const absl::Status sent = stream.Send(request);
    ASSERT_TRUE(sent.ok()) << sent;
  }
  EXPECT_TRUE(stream.Close().ok());
  EXPECT_FALSE(stream.unsupported());
  EXPECT_EQ(server->schedule_log().min_completed_step(), 4);
}

// A report the coordinator refuses ends the stream; the next Send returns
// that error (the report was not sent) and the one after opens a new stream.
TEST(AgentReportStreamTest,
     AnErrorComesBackFromTheNextSendThenTheStreamReopens) {
  auto server = StartCoordinator("127.0.0.1:0");
  ASSERT_NE(server, nullptr);
  Agent agent(Options(server->address()));
  ASSERT_TRUE(agent.Join().ok());
  auto channel = grpc::CreateChannel(server->address(),
                                     grpc::InsecureChannelCredentials());
  ASSERT_TRUE(Connected(*channel));
  ReportStream stream(channel);
  hsdp::v1::ReportStepRequest request;
  request.set_job_id("another-job");
  *request.mutable_report() = Report(0);
  ASSERT_TRUE(stream.Send(request).ok());  // sent; refused on arrival
  request.set_job_id(kJob);
  request.mutable_report()->set_worker_id(agent.worker_id());
  request.mutable_report()->set_generation(agent.generation());
  absl::Status sent;
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (absl::Now() < give_up) {
    sent = stream.Send(request);
    if (!sent.ok()) break;
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_FALSE(sent.ok());
  EXPECT_NE(sent.message().find("another-job"), std::string::npos) << sent;
  request.mutable_report()->set_step(3);
  ASSERT_TRUE(stream.Send(request).ok());
  EXPECT_TRUE(stream.Close().ok());
  EXPECT_EQ(server->schedule_log().min_completed_step(), 3);
}

// The Agent streams its reports and sends the last one by call after them:
// when that returns, the coordinator holds every report and the worker is
// finished. Across a coordinator restart every ReportStep still succeeds.
TEST(AgentReportStreamTest, AgentStreamsThroughARestartAndAcknowledgesTheLast) {
  const std::string dir =
      ::testing::TempDir() + "/hsdp-report-stream-" + std::to_string(getpid());
  std::filesystem::remove_all(dir);
  auto server = StartCoordinator("127.0.0.1:0", dir);
  ASSERT_NE(server, nullptr);
  const int port = server->port();
  Agent agent(Options(server->address()));
  ASSERT_TRUE(agent.Join().ok());
  for (int64_t step = 0; step < 4; ++step) {
    ASSERT_TRUE(agent.ReportStep(Report(step), false).ok()) << step;
  }
  server->Shutdown();
  server.reset();
  server = StartCoordinator(coordinator::WithPort("127.0.0.1:0", port), dir);
  ASSERT_NE(server, nullptr);
  for (int64_t step = 4; step < 8; ++step) {
    ASSERT_TRUE(agent.ReportStep(Report(step), false).ok()) << step;
  }
  ASSERT_TRUE(agent.ReportStep(Report(8), /*finished=*/true).ok());
  EXPECT_EQ(server->schedule_log().min_completed_step(), 8);
  const auto workers = server->membership().Workers();
  ASSERT_EQ(workers.size(), 1u);
  EXPECT_EQ(workers[0].state, hsdp::v1::WORKER_STATE_FINISHED);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace hsdp::agent
