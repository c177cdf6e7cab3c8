// CoordinatorService.StreamReports (coordinator/service/report_stream.h) over
// real gRPC on loopback: the coordinator announces the stream in its initial
// metadata, records every report in the order sent (they move the read-ahead
// window as ReportStep's do), ends the stream with the error ReportStep gives
// the same report, and refuses a stream without the job token before reading.
#include "coordinator/service/report_stream.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "coordinator/server.h"
#include "hsdp/v1/control_service.grpc.pb.h"
#include "hsdp/v1/coordinator_service.grpc.pb.h"
#include "tests/coordinator/service_test_util.h"

namespace hsdp::coordinator {
namespace {

using ::hsdp::testing::Connect;
using ::hsdp::testing::Ctx;
using ::hsdp::testing::MakeJoin;
using ::hsdp::v1::CoordinatorService;
using Writer = grpc::ClientWriter<hsdp::v1::StreamReportsRequest>;

constexpr char kJob[] = "job-reports";
constexpr char kToken[] = "job-token-reports-0123456789";
constexpr int kLayers = 2;
constexpr int kWorld = 2;

class ReportStreamTest : public ::testing::Test {
 protected:
  void Start(const std::string& token = "") {
    JobConfig job;
    job.job_id = kJob;
    job.world_size = kWorld;
    job.mesh = MeshShape{1, kWorld};
    ServerOptions options;
    options.listen = "127.0.0.1:0";
    options.sync_state = false;
    options.job_token = token;
    auto server = CoordinatorServer::Start(job, options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    channel_ = Connect(server_->address());
    stub_ = CoordinatorService::NewStub(channel_);
    token_ = token;
    for (int r = 0; r < kWorld; ++r) {
      hsdp::v1::JoinResponse response;
      ASSERT_TRUE(
          stub_->Join(Context().get(), MakeJoin(kJob, kLayers, r), &response)
              .ok());
      joined_.push_back(response);
    }
  }

  std::unique_ptr<grpc::ClientContext> Context() {
    auto context = Ctx();
    if (!token_.empty()) {
      context->AddMetadata("authorization", "Bearer " + token_);
    }
    return context;
  }

  hsdp::v1::ReportStepRequest Report(int rank, int64_t step) const {
    hsdp::v1::ReportStepRequest request;
    request.set_job_id(kJob);
    hsdp::v1::StepReport* report = request.mutable_report();
    report->set_worker_id(joined_[rank].worker_id());
    report->set_generation(joined_[rank].generation());
    report->set_rank(rank);
    report->set_step(step);
    report->set_loss(10.0 * rank + static_cast<double>(step));
    return request;
  }

  static hsdp::v1::StreamReportsRequest Streamed(
      const hsdp::v1::ReportStepRequest& report) {
    hsdp::v1::StreamReportsRequest message;
    *message.mutable_report() = report;
    return message;
  }

  // rank -> its last recorded report, from ListWorkers.
  std::vector<hsdp::v1::StepReport> LastReports() {
    auto control = hsdp::v1::ControlService::NewStub(channel_);
    hsdp::v1::ListWorkersResponse workers;
    EXPECT_TRUE(control->ListWorkers(Ctx().get(), {}, &workers).ok());
    std::vector<hsdp::v1::StepReport> last(kWorld);
    for (const auto& w : workers.workers()) {
      if (w.rank() >= 0 && w.rank() < kWorld) last[w.rank()] = w.last_report();
    }
    return last;
  }

  std::unique_ptr<CoordinatorServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<CoordinatorService::Stub> stub_;
  std::string token_;
  std::vector<hsdp::v1::JoinResponse> joined_;
};

TEST_F(ReportStreamTest, RecordsEveryReportInOrderAndMovesTheWindow) {
  Start();
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<hsdp::v1::StreamReportsResponse> responses(kWorld);
  std::vector<std::unique_ptr<Writer>> writers;
  for (int r = 0; r < kWorld; ++r) {
    contexts.push_back(Context());
    writers.push_back(stub_->StreamReports(contexts[r].get(), &responses[r]));
    writers[r]->WaitForInitialMetadata();
    const auto& metadata = contexts[r]->GetServerInitialMetadata();
    auto marker = metadata.find(kReportStreamMetadataKey);
    ASSERT_NE(marker, metadata.end());
    EXPECT_EQ(std::string(marker->second.data(), marker->second.size()),
              kReportStreamVersion);
  }
  constexpr int64_t kSteps = 6;
  for (int64_t step = 0; step < kSteps; ++step) {
    for (int r = 0; r < kWorld; ++r) {
      ASSERT_TRUE(writers[r]->Write(Streamed(Report(r, step))))
          << r << " " << step;
    }
  }
  // Closing waits until every report sent was recorded.
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(writers[r]->WritesDone());
    const grpc::Status done = writers[r]->Finish();
    EXPECT_TRUE(done.ok()) << done.error_message();
  }
  EXPECT_EQ(server_->schedule_log().min_completed_step(), kSteps - 1);
  const std::vector<hsdp::v1::StepReport> last = LastReports();
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(last[r].step(), kSteps - 1) << r;
    EXPECT_EQ(last[r].loss(), 10.0 * r + (kSteps - 1)) << r;
  }
}

// A report ReportStep refuses ends the stream with ReportStep's status, and
// the reports before it stay recorded.
TEST_F(ReportStreamTest, EndsWithTheErrorReportStepGivesTheSameReport) {
  Start();
  hsdp::v1::ReportStepRequest stranger = Report(0, 3);
  stranger.mutable_report()->set_worker_id(joined_[1].worker_id() + 1000);
  hsdp::v1::ReportStepResponse unary_response;
  const grpc::Status unary =
      stub_->ReportStep(Context().get(), stranger, &unary_response);
  ASSERT_FALSE(unary.ok());

  auto context = Context();
  hsdp::v1::StreamReportsResponse response;
  std::unique_ptr<Writer> writer =
      stub_->StreamReports(context.get(), &response);
  ASSERT_TRUE(writer->Write(Streamed(Report(0, 2))));
  writer->Write(Streamed(stranger));
  // The stream ended at the stranger: once the worker's side learns it,
  // writes fail.
  bool wrote = true;
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (wrote && absl::Now() < give_up) {
    wrote = writer->Write(Streamed(Report(0, 4)));
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_FALSE(wrote);
  const grpc::Status streamed = writer->Finish();
  EXPECT_EQ(streamed.error_code(), unary.error_code());
  EXPECT_EQ(streamed.error_message(), unary.error_message());
  EXPECT_EQ(LastReports()[0].step(), 2);
}

TEST_F(ReportStreamTest, WithoutTheJobTokenNothingIsRead) {
  Start(kToken);
  grpc::ClientContext context;  // no token
  hsdp::v1::StreamReportsResponse response;
  std::unique_ptr<Writer> writer = stub_->StreamReports(&context, &response);
  writer->WaitForInitialMetadata();
  EXPECT_EQ(context.GetServerInitialMetadata().count(kReportStreamMetadataKey),
            0u);
  writer->Write(Streamed(Report(0, 5)));
  writer->WritesDone();
  EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(server_->schedule_log().min_completed_step(), -1);
  EXPECT_EQ(LastReports()[0].step(), 0);
}

}  // namespace
}  // namespace hsdp::coordinator
