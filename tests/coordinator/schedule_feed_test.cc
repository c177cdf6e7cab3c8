// CoordinatorService.WatchSchedules (coordinator/service/schedule_feed.h) over real
// gRPC on loopback: what it pushes is GetSchedule's sealed bytes, in order,
// when the slowest rank allows, persisted; it catches up streams opened late,
// ends with drained, refuses strangers, and ends every stream when the
// coordinator stops.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "coordinator/core/state_store.h"
#include "coordinator/server.h"
#include "hsdp/v1/control_service.grpc.pb.h"
#include "hsdp/v1/coordinator_service.grpc.pb.h"
#include "tests/coordinator/core_test_util.h"
#include "tests/coordinator/service_test_util.h"

namespace hsdp::coordinator {
namespace {

using ::hsdp::testing::Connect;
using ::hsdp::testing::Ctx;
using ::hsdp::testing::MakeJoin;
using ::hsdp::v1::CoordinatorService;
using Stream = grpc::ClientReader<hsdp::v1::WatchSchedulesResponse>;

constexpr char kJob[] = "job-feed";
constexpr int kLayers = 3;
constexpr int kWorld = 2;

class FeedTest : public ::testing::Test {
 protected:
  void Start(int push_ahead, const std::string& state_dir = "") {
    JobConfig job;
    job.job_id = kJob;
    job.world_size = kWorld;
    job.mesh = MeshShape{1, kWorld};
    job.state_dir = state_dir;
    ServerOptions options;
    options.listen = "127.0.0.1:0";
    options.sync_state = false;
    options.schedule_push_ahead = push_ahead;
    auto server = CoordinatorServer::Start(job, options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    stub_ = CoordinatorService::NewStub(Connect(server_->address()));
    for (int r = 0; r < kWorld; ++r) {
      hsdp::v1::JoinResponse response;
      ASSERT_TRUE(
          stub_->Join(Ctx().get(), MakeJoin(kJob, kLayers, r), &response).ok());
    }
  }

  std::unique_ptr<Stream> Watch(int rank, int64_t from_step,
                                grpc::ClientContext* context) {
    hsdp::v1::WatchSchedulesRequest request;
    request.set_job_id(kJob);
    request.set_rank(rank);
    request.set_from_step(from_step);
    return stub_->WatchSchedules(context, request);
  }

  void ReportAll(int64_t step) {
    for (int r = 0; r < kWorld; ++r) {
      hsdp::v1::ReportStepRequest request;
      request.set_job_id(kJob);
      request.mutable_report()->set_rank(r);
      request.mutable_report()->set_step(step);
      hsdp::v1::ReportStepResponse response;
      ASSERT_TRUE(stub_->ReportStep(Ctx().get(), request, &response).ok());
    }
  }

  std::string Fetch(int64_t step) {
    hsdp::v1::GetScheduleRequest request;
    request.set_job_id(kJob);
    request.set_rank(0);
    request.set_step(step);
    hsdp::v1::GetScheduleResponse response;
    EXPECT_TRUE(stub_->GetSchedule(Ctx().get(), request, &response).ok());
    return response.schedule().SerializeAsString();
  }

  std::unique_ptr<CoordinatorServer> server_;
  std::unique_ptr<CoordinatorService::Stub> stub_;
};

// Steps arrive in order, as the sealed bytes GetSchedule serves, and only as
// far as the slowest rank allows: push-ahead 1 means step s + 1 while the
// slowest rank runs step s.
TEST_F(FeedTest, PushesSealedBytesInOrderAsTheSlowestRankAllows) {
  const std::string dir = testing::FreshDir("feed");
  Start(/*push_ahead=*/1, dir);
  auto context = Ctx();
  std::unique_ptr<Stream> stream = Watch(1, 0, context.get());
  hsdp::v1::WatchSchedulesResponse message;
  // Before any report: steps 0 and 1.
  for (int64_t step : {0, 1}) {
    ASSERT_TRUE(stream->Read(&message));
    EXPECT_EQ(message.step(), step);
    EXPECT_FALSE(message.drained());
    EXPECT_EQ(message.schedule(), Fetch(step));
  }
  EXPECT_EQ(server_->schedule_log().sealed_step(), 1);
  // Step 2 waits for both ranks' report of step 0.
  ReportAll(0);
  ASSERT_TRUE(stream->Read(&message));
  EXPECT_EQ(message.step(), 2);
  EXPECT_EQ(message.schedule(), Fetch(2));
  hsdp::v1::StepSchedule parsed;
  ASSERT_TRUE(parsed.ParseFromString(message.schedule()));
  EXPECT_EQ(parsed.step(), 2);
  // Every pushed step was persisted: the state directory (opened once the
  // coordinator released its lock) holds the pushed bytes.
  context->TryCancel();
  stream.reset();
  server_.reset();
  auto store = StateStore::Open(dir);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ((*store)->SealedSteps().at({2, 0}), message.schedule());
}

TEST_F(FeedTest, LateStreamCatchesUpAndDrainEndsIt) {
  Start(/*push_ahead=*/0);
  for (int64_t step = 0; step < 3; ++step) {
    Fetch(step);
    ReportAll(step);
  }
  // Opened late, from step 1: the sealed steps 1..3 (3 = floor 2 + 1).
  auto context = Ctx();
  std::unique_ptr<Stream> stream = Watch(0, 1, context.get());
  hsdp::v1::WatchSchedulesResponse message;
  for (int64_t step = 1; step <= 3; ++step) {
    ASSERT_TRUE(stream->Read(&message));
    EXPECT_EQ(message.step(), step);
    EXPECT_EQ(message.schedule(), Fetch(step));
  }
  // Drained after step 4 (the first unsealed step).
  auto drain = server_->schedule_log().Drain();
  ASSERT_TRUE(drain.ok());
  EXPECT_EQ(*drain, 4);
  ReportAll(3);
  ASSERT_TRUE(stream->Read(&message));
  EXPECT_EQ(message.step(), 4);
  EXPECT_FALSE(message.drained());
  ReportAll(4);
  ASSERT_TRUE(stream->Read(&message));
  EXPECT_EQ(message.step(), 5);
  EXPECT_TRUE(message.drained());
  EXPECT_TRUE(message.schedule().empty());
  EXPECT_FALSE(stream->Read(&message));
  EXPECT_TRUE(stream->Finish().ok());
}

TEST_F(FeedTest, StrangersAreRefusedAndStopEndsEveryStream) {
  Start(/*push_ahead=*/1);
  hsdp::v1::WatchSchedulesResponse message;
  {
    auto context = Ctx();
    std::unique_ptr<Stream> stream = Watch(kWorld + 3, 0, context.get());
    EXPECT_FALSE(stream->Read(&message));
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::NOT_FOUND);
  }
  {
    auto context = Ctx();
    std::unique_ptr<Stream> stream = Watch(0, -1, context.get());
    EXPECT_FALSE(stream->Read(&message));
    EXPECT_EQ(stream->Finish().error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
  }
  auto context = Ctx();
  std::unique_ptr<Stream> stream = Watch(0, 0, context.get());
  ASSERT_TRUE(stream->Read(&message));
  ASSERT_TRUE(stream->Read(&message));  // steps 0 and 1
  const auto start = std::chrono::steady_clock::now();
  server_->StopServing();
  EXPECT_FALSE(stream->Read(&message));
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

}  // namespace
}  // namespace hsdp::coordinator
