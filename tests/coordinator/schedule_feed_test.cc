// CoordinatorService.WatchSchedules (coordinator/service/schedule_feed.h) over
// real gRPC on loopback: what it pushes is GetSchedule's sealed bytes, in
// order, when the slowest rank allows, persisted; it catches up streams opened
// late, ends with drained, refuses strangers, ends a generation's streams
// ABORTED when it ends (the next generation's streams get its steps, sealed
// again), carries the commits of votes sent on the report stream, and ends
// every stream when the coordinator stops.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/clock.h"
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
  void Start(int push_ahead, const std::string& state_dir = "",
             MeshShape mesh = MeshShape{1, kWorld}) {
    JobConfig job;
    job.job_id = kJob;
    job.world_size = kWorld;
    job.mesh = mesh;
    job.state_dir = state_dir;
    ServerOptions options;
    options.listen = "127.0.0.1:0";
    options.sync_state = false;
    options.schedule_push_ahead = push_ahead;
    auto server = CoordinatorServer::Start(job, options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    stub_ = CoordinatorService::NewStub(Connect(server_->address()));
    joined_.clear();
    for (int r = 0; r < kWorld; ++r) {
      hsdp::v1::JoinResponse response;
      ASSERT_TRUE(
          stub_->Join(Ctx().get(), MakeJoin(kJob, kLayers, r), &response).ok());
      joined_.push_back(response);
    }
  }

  // A member's stream (by worker id) for `generation`.
  std::unique_ptr<Stream> WatchAs(int rank, int64_t generation,
                                  int64_t from_step,
                                  grpc::ClientContext* context) {
    hsdp::v1::WatchSchedulesRequest request;
    request.set_job_id(kJob);
    request.set_worker_id(joined_[rank].worker_id());
    request.set_generation(generation);
    request.set_from_step(from_step);
    return stub_->WatchSchedules(context, request);
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

  // Rank 0 reports a failed collective at `step` of generation 0: the
  // generation ends at once.
  void FailAsRankZero(int64_t step) {
    hsdp::v1::ReportFailureRequest failure;
    failure.set_job_id(kJob);
    failure.set_worker_id(joined_[0].worker_id());
    failure.set_generation(0);
    failure.set_step(step);
    failure.set_detail("AllReduce: lost peer rank 1");
    hsdp::v1::ReportFailureResponse failed;
    ASSERT_TRUE(stub_->ReportFailure(Ctx().get(), failure, &failed).ok());
  }

  std::unique_ptr<CoordinatorServer> server_;
  std::unique_ptr<CoordinatorService::Stub> stub_;
  std::vector<hsdp::v1::JoinResponse> joined_;
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

// Two streams of rank 0 and one of rank 1 wait in generation 0; rank 1's
// goes away (its process died), rank 0 reports a failed collective: the
// generation ends, rank 0's streams end ABORTED, and a stream of generation 1
// (rank 0 alone) gets step 0 sealed again for one rank.
TEST_F(FeedTest, AnEndedGenerationsStreamsEndAbortedAndTheNextOnesGetItsSteps) {
  Start(/*push_ahead=*/1, "", MeshShape{kWorld, 1});
  hsdp::v1::WatchSchedulesResponse message;
  auto c0 = Ctx(), c0b = Ctx(), c1 = Ctx();
  std::unique_ptr<Stream> s0 = WatchAs(0, 0, 0, c0.get());
  std::unique_ptr<Stream> s0b = WatchAs(0, 0, 0, c0b.get());
  std::unique_ptr<Stream> s1 = WatchAs(1, 0, 0, c1.get());
  for (Stream* s : {s0.get(), s0b.get(), s1.get()}) {
    ASSERT_TRUE(s->Read(&message));
    EXPECT_EQ(message.step(), 0);
  }
  c1->TryCancel();
  while (s1->Read(&message)) {
  }
  EXPECT_EQ(s1->Finish().error_code(), grpc::StatusCode::CANCELLED);
  ASSERT_NO_FATAL_FAILURE(FailAsRankZero(/*step=*/0));
  for (Stream* s : {s0.get(), s0b.get()}) {
    while (s->Read(&message)) EXPECT_LE(message.step(), 1);
    EXPECT_EQ(s->Finish().error_code(), grpc::StatusCode::ABORTED);
  }
  // Formed at once: rank 1 is gone, rank 0's report was its confirmation.
  hsdp::v1::AwaitGenerationRequest await;
  await.set_job_id(kJob);
  await.set_worker_id(joined_[0].worker_id());
  await.set_generation(0);
  hsdp::v1::AwaitGenerationResponse next;
  ASSERT_TRUE(stub_->AwaitGeneration(Ctx().get(), await, &next).ok());
  ASSERT_EQ(next.outcome(), hsdp::v1::AWAIT_OUTCOME_FORMED);
  ASSERT_EQ(next.generation().generation(), 1);
  auto c = Ctx();
  std::unique_ptr<Stream> s = WatchAs(0, 1, 0, c.get());
  ASSERT_TRUE(s->Read(&message));
  EXPECT_EQ(message.step(), 0);
  hsdp::v1::StepSchedule parsed;
  ASSERT_TRUE(parsed.ParseFromString(message.schedule()));
  EXPECT_EQ(parsed.generation(), 1);
  EXPECT_EQ(parsed.world_size(), 1);
}

// Votes sent on the report stream are answered on the schedule streams: each
// commit goes to every stream of its generation, inside the message of the
// step it made pushable, a stream opened later first gets the latest one, a
// refused vote ends its voter's stream with the vote's error, and the
// generation's end ends the others ABORTED.
TEST_F(FeedTest, StreamedVotesAreAnsweredOnEveryStreamOfTheGeneration) {
  Start(/*push_ahead=*/1, "", MeshShape{kWorld, 1});
  using Writer = grpc::ClientWriter<hsdp::v1::StreamReportsRequest>;
  std::vector<std::unique_ptr<grpc::ClientContext>> report_contexts;
  std::vector<hsdp::v1::StreamReportsResponse> closed(kWorld);
  std::vector<std::unique_ptr<Writer>> votes;
  for (int r = 0; r < kWorld; ++r) {
    report_contexts.push_back(Ctx());
    votes.push_back(
        stub_->StreamReports(report_contexts.back().get(), &closed[r]));
  }
  auto vote = [&](int rank, int64_t step) {
    hsdp::v1::StreamReportsRequest message;
    message.mutable_vote()->set_job_id(kJob);
    message.mutable_vote()->set_worker_id(joined_[rank].worker_id());
    message.mutable_vote()->set_generation(0);
    message.mutable_vote()->set_step(step);
    return votes[rank]->Write(message);
  };
  // The next message of a stream that carries a commit (schedules alone are
  // skipped).
  auto next_commit =
      [](Stream* s) -> std::optional<hsdp::v1::WatchSchedulesResponse> {
    hsdp::v1::WatchSchedulesResponse message;
    while (s->Read(&message)) {
      if (message.has_committed()) return message;
    }
    return std::nullopt;
  };
  auto c0 = Ctx(), c1 = Ctx();
  std::unique_ptr<Stream> s0 = WatchAs(0, 0, 0, c0.get());
  std::unique_ptr<Stream> s1 = WatchAs(1, 0, 0, c1.get());
  // Both streams are served (a stream opened after a commit would get it
  // alone first).
  for (Stream* s : {s0.get(), s1.get()}) {
    hsdp::v1::WatchSchedulesResponse first;
    ASSERT_TRUE(s->Read(&first));
    EXPECT_EQ(first.step(), 0);
  }
  for (int64_t step = 0; step < 3; ++step) {
    ASSERT_TRUE(vote(0, step));
    ASSERT_TRUE(vote(1, step));
    for (Stream* s : {s0.get(), s1.get()}) {
      std::optional<hsdp::v1::WatchSchedulesResponse> commit = next_commit(s);
      ASSERT_TRUE(commit.has_value()) << "step " << step;
      EXPECT_EQ(commit->committed().step(), step);
      EXPECT_FALSE(commit->committed().reform_after());
      // The commit of s raised the floor to s: it rides on step s + 2 (push
      // ahead 1), one message per stream.
      EXPECT_EQ(commit->step(), step + 2) << "commit of step " << step;
      EXPECT_FALSE(commit->schedule().empty());
    }
  }
  // Opened after the commits: the latest first.
  auto late_context = Ctx();
  std::unique_ptr<Stream> late = WatchAs(1, 0, 3, late_context.get());
  std::optional<hsdp::v1::WatchSchedulesResponse> latest =
      next_commit(late.get());
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->committed().step(), 2);
  // Step 5 is not the next to commit: rank 0's vote is refused, and its
  // schedule stream ends with the same error its report stream ends with.
  ASSERT_TRUE(vote(0, 5));
  EXPECT_FALSE(next_commit(s0.get()).has_value());
  const grpc::Status refused = s0->Finish();
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::OUT_OF_RANGE);
  EXPECT_NE(refused.error_message().find("not the next step"),
            std::string::npos)
      << refused.error_message();
  while (vote(0, 5)) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_EQ(votes[0]->Finish().error_code(), grpc::StatusCode::OUT_OF_RANGE);
  // Rank 1's streams carry on until the generation ends.
  ASSERT_NO_FATAL_FAILURE(FailAsRankZero(/*step=*/3));
  for (Stream* s : {s1.get(), late.get()}) {
    EXPECT_FALSE(next_commit(s).has_value());
    EXPECT_EQ(s->Finish().error_code(), grpc::StatusCode::ABORTED);
  }
  votes[1]->WritesDone();
  EXPECT_TRUE(votes[1]->Finish().ok());
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
