// A task whose loss turns NaN at one step in one microbatch (the example
// ResNet fed a NaN image there), sharded 2x2 with two microbatches per rank
// under an in-process coordinator and through the single-process reference:
//   - stop (the default): every rank's RunTask fails naming the step, the rank
//     and the microbatch; the coordinator's GetStatus says FAILED with that
//     reason; the reference stops with the same line;
//   - skip-step: every rank skips that step alike (no update), the runs go on
//     and match the reference, which skips it too;
// and every report line of every run parses as JSON ("loss":null there).
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "coordinator/server.h"
#include "gtest/gtest.h"
#include "hsdp/runner.h"
#include "hsdp/v1/control_service.grpc.pb.h"
#include "resnet_task.h"

namespace resnet {
namespace {

// The ranks, the coordinator and the test's own status client share one
// process: a socket closed at shutdown must give EPIPE, not kill the test.
const bool kIgnoreSigpipe = [] {
  std::signal(SIGPIPE, SIG_IGN);
  return true;
}();

using hsdp::train::Batch;
using hsdp::train::BatchRequest;
using hsdp::train::NonFiniteAction;
using hsdp::train::TaskArgs;
using hsdp::train::TrainingOptions;
using Json = nlohmann::json;

constexpr int kSteps = 6;
constexpr int kWorld = 4;
constexpr int kMicrobatches = 2;
constexpr int kMicrobatchSize = 2;
// Global microbatch 5 of step 3: rank 5 / 2 = 2, its microbatch 5 % 2 = 1.
constexpr int64_t kPoisonedStep = 3;
constexpr int64_t kPoisonedSlot = 5;
constexpr char kExpectedLine[] =
    "step 3: the loss is nan on rank 2, microbatch 1";
constexpr char kJob[] = "nonfinite-test";

TaskArgs Args() {
  TaskArgs args;
  args.model = kModelName;
  args.options = {{"channels", "8"}, {"blocks", "2"}, {"image_size", "6"}};
  return args;
}

// The ResNet task, but the images of one microbatch of one step are NaN.
class PoisonedTask : public hsdp::train::Task {
 public:
  PoisonedTask() {
    absl::StatusOr<std::unique_ptr<ResNetTask>> task =
        ResNetTask::Create(Args().options);
    EXPECT_TRUE(task.ok()) << task.status();
    if (task.ok()) inner_ = std::move(*task);
  }
  std::string Name() const override { return inner_->Name(); }
  absl::Status Build(const hsdp::train::BuildContext& context) override {
    return inner_->Build(context);
  }
  std::shared_ptr<torch::nn::Module> Model() override {
    return inner_->Model();
  }
  int NumUnits() const override { return inner_->NumUnits(); }
  absl::StatusOr<hsdp::train::UnitSpec> BuildUnit(int index) override {
    return inner_->BuildUnit(index);
  }
  void ReleaseUnit(int index) override { inner_->ReleaseUnit(index); }
  void SetShardContext(hsdp::train::ShardContext& context) override {
    inner_->SetShardContext(context);
  }
  absl::StatusOr<Batch> GetBatch(const BatchRequest& request) override {
    absl::StatusOr<Batch> batch = inner_->GetBatch(request);
    if (batch.ok() && request.step == kPoisonedStep &&
        request.first_sample == kPoisonedSlot * kMicrobatchSize) {
      batch->input =
          at::full_like(batch->input, std::numeric_limits<float>::quiet_NaN());
    }
    return batch;
  }
  absl::StatusOr<at::Tensor> Loss(const Batch& batch) override {
    return inner_->Loss(batch);
  }

 private:
  std::unique_ptr<ResNetTask> inner_;
};

TrainingOptions Training(NonFiniteAction action) {
  TrainingOptions t;
  t.steps = kSteps;
  t.microbatch_size = kMicrobatchSize;
  t.seed = 5;
  t.optimizer.kind = hsdp::train::OptimizerKind::kSgd;
  t.optimizer.lr = 0.1;
  t.on_nonfinite = action;
  return t;
}

// Per process: several builds may run this test at once.
std::string FreshFile(const std::string& name) {
  const std::string path =
      absl::StrCat(::testing::TempDir(), "/", getpid(), "-", name);
  std::remove(path.c_str());
  return path;
}

// Every line of `path`, each required to be a JSON object.
std::vector<Json> JsonLines(const std::string& path) {
  std::ifstream in(path);
  std::vector<Json> out;
  std::string line;
  while (std::getline(in, line)) {
    Json j = Json::parse(line, nullptr, /*allow_exceptions=*/false);
    EXPECT_TRUE(j.is_object()) << path << ": not JSON: " << line;
    if (j.is_object()) out.push_back(std::move(j));
  }
  return out;
}

struct ShardedResult {
  std::vector<absl::Status> results;
  std::vector<std::string> reports;
  hsdp::v1::GetStatusResponse status;
};

// Four RunTask threads on a 2x2 mesh, two microbatches each; the status is the
// coordinator's GetStatus answer after they returned.
ShardedResult RunSharded(NonFiniteAction action, const std::string& tag) {
  unsetenv("HSDP_JOB_TOKEN");
  unsetenv("HSDP_JOB_TOKEN_FILE");
  ShardedResult out;
  hsdp::coordinator::JobConfig job;
  job.job_id = kJob;
  job.world_size = kWorld;
  job.mesh = hsdp::MeshShape{2, 2};
  job.policy.set_microbatches(kMicrobatches);
  hsdp::coordinator::ServerOptions server_options;
  server_options.listen = "127.0.0.1:0";
  server_options.sync_state = false;
  auto server =
      hsdp::coordinator::CoordinatorServer::Start(job, server_options);
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok()) return out;

  out.results.resize(kWorld);
  std::vector<std::thread> ranks;
  for (int r = 0; r < kWorld; ++r) {
    out.reports.push_back(FreshFile(absl::StrCat(tag, "-rank-", r, ".jsonl")));
    hsdp::train::WorkerOptions w;
    w.training = Training(action);
    w.process.report_file = out.reports.back();
    w.task_args = Args();
    w.coordinator = (*server)->address();
    w.job_id = kJob;
    w.rank_hint = r;
    w.gloo_hostname = "127.0.0.1";
    w.shared_memory = false;  // the ranks are threads of one process
    w.collective_timeout = absl::Seconds(30);
    w.coordinator_timeout = absl::Seconds(30);
    ranks.emplace_back([w, r, &out] {
      out.results[r] =
          hsdp::train::RunTask(std::make_unique<PoisonedTask>(), w);
    });
  }
  for (std::thread& t : ranks) t.join();

  auto stub = hsdp::v1::ControlService::NewStub(grpc::CreateChannel(
      (*server)->address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  const grpc::Status s =
      stub->GetStatus(&ctx, hsdp::v1::GetStatusRequest(), &out.status);
  EXPECT_TRUE(s.ok()) << s.error_message();
  (*server)->Shutdown();
  return out;
}

absl::Status RunReference(NonFiniteAction action, const std::string& report) {
  hsdp::train::ReferenceOptions ref;
  ref.training = Training(action);
  ref.world_size = kWorld;
  ref.microbatches = kMicrobatches;
  ref.task_args = Args();
  ref.process.report_file = report;
  return hsdp::train::RunReference(std::make_unique<PoisonedTask>(), ref);
}

TEST(NonFiniteLossTest, StopNamesStepRankAndMicrobatchAndFailsTheJob) {
  const ShardedResult run = RunSharded(NonFiniteAction::kStop, "stop");
  ASSERT_EQ(run.results.size(), static_cast<size_t>(kWorld));
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_FALSE(run.results[r].ok()) << "rank " << r;
    // Each rank either found the step itself or was told the job failed:
    // both name the same step, rank and microbatch.
    EXPECT_TRUE(absl::StrContains(run.results[r].message(), kExpectedLine))
        << "rank " << r << ": " << run.results[r];
    EXPECT_FALSE(absl::StrContains(run.results[r].message(), "\n"));
  }
  EXPECT_EQ(run.status.state(), hsdp::v1::JOB_STATE_FAILED)
      << hsdp::v1::JobState_Name(run.status.state());
  EXPECT_TRUE(absl::StartsWith(run.status.message(), kExpectedLine))
      << run.status.message();
  EXPECT_TRUE(absl::StrContains(run.status.message(), "--on-nonfinite"))
      << run.status.message();
  EXPECT_EQ(run.status.last_committed_step(), kPoisonedStep - 1);

  for (int r = 0; r < kWorld; ++r) {
    const std::vector<Json> lines = JsonLines(run.reports[r]);
    // The steps before: the failed one is never committed, never reported.
    ASSERT_EQ(lines.size(), static_cast<size_t>(kPoisonedStep)) << r;
    for (size_t s = 0; s < lines.size(); ++s) {
      EXPECT_EQ(lines[s]["step"], s);
      EXPECT_TRUE(lines[s]["loss"].is_number());
    }
  }

  const std::string ref_report = FreshFile("stop-reference.jsonl");
  const absl::Status ref = RunReference(NonFiniteAction::kStop, ref_report);
  EXPECT_FALSE(ref.ok());
  // The reference names the rank and microbatch the sharded run trains the
  // poisoned samples on, in the same words.
  EXPECT_TRUE(absl::StartsWith(ref.message(), kExpectedLine)) << ref;
  EXPECT_EQ(ref.message(), run.status.message());
  EXPECT_EQ(JsonLines(ref_report).size(), static_cast<size_t>(kPoisonedStep));
}

TEST(NonFiniteLossTest, SkipStepSkipsOnEveryRankAndMatchesTheReference) {
  const ShardedResult run = RunSharded(NonFiniteAction::kSkipStep, "skip");
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(run.results[r].ok()) << "rank " << r << ": " << run.results[r];
  }
  EXPECT_EQ(run.status.state(), hsdp::v1::JOB_STATE_FINISHED)
      << hsdp::v1::JobState_Name(run.status.state());

  const std::string ref_report = FreshFile("skip-reference.jsonl");
  const absl::Status ref = RunReference(NonFiniteAction::kSkipStep, ref_report);
  ASSERT_TRUE(ref.ok()) << ref;
  const std::vector<Json> expected = JsonLines(ref_report);
  ASSERT_EQ(expected.size(), static_cast<size_t>(kSteps));
  EXPECT_TRUE(expected[kPoisonedStep]["loss"].is_null());
  EXPECT_EQ(expected[kPoisonedStep]["skipped"], true);

  for (int r = 0; r < kWorld; ++r) {
    const std::vector<Json> got = JsonLines(run.reports[r]);
    ASSERT_EQ(got.size(), static_cast<size_t>(kSteps)) << "rank " << r;
    for (int s = 0; s < kSteps; ++s) {
      if (s == kPoisonedStep) {
        EXPECT_TRUE(got[s]["loss"].is_null()) << got[s].dump();
        EXPECT_EQ(got[s]["skipped"], true);
        ASSERT_TRUE(got[s]["nonfinite"].is_string());
        EXPECT_TRUE(absl::StartsWith(got[s]["nonfinite"].get<std::string>(),
                                     kExpectedLine))
            << got[s].dump();
        EXPECT_EQ(got[s]["nonfinite"], expected[s]["nonfinite"]);
        continue;
      }
      ASSERT_TRUE(got[s]["loss"].is_number()) << got[s].dump();
      EXPECT_EQ(got[s].count("skipped"), 0u);
      // After the skipped step too: no NaN reached the parameters, and the
      // ranks and the reference skipped the same update.
      EXPECT_NEAR(got[s]["loss"].get<double>(),
                  expected[s]["loss"].get<double>(), 1e-5)
          << "rank " << r << " step " << s;
    }
  }
}

}  // namespace
}  // namespace resnet
