// The usage example of worker/train/task.h, compiled and trained: a task
// written as that comment says builds against the public headers, trains
// sharded on 1x2 under an in-process coordinator and matches its
// single-process reference. task_example_in_sync checks that the code
// between the markers is the comment's, line for line.
#include <torch/torch.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "coordinator/server.h"
#include "gtest/gtest.h"
#include "worker/train/runner.h"
#include "worker/train/task.h"
#include "worker/train/task_util.h"
#include "worker/train/unit.h"

namespace {

// clang-format off
// BEGIN task.h example
class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl() { fc = register_module("fc", torch::nn::Linear(16, 16)); }
  at::Tensor forward(const at::Tensor& x) { return x + torch::relu(fc(x)); }
  torch::nn::Linear fc{nullptr};
};

class MyTask : public hsdp::train::Task {
 public:
  std::string Name() const override { return "my-model"; }
  absl::Status Build(const hsdp::train::BuildContext& ctx) override {
    model_ = std::make_shared<torch::nn::Module>("MyModel");
    for (int i = 0; i < 4; ++i) {
      blocks_.emplace_back(model_->register_module(
          absl::StrCat("blocks_", i), std::make_shared<BlockImpl>()));
    }
    head_ = model_->register_module("head", torch::nn::Linear(16, 2));
    hsdp::train::InitParameters(*model_, ctx.seed);  // not torch's RNG
    return absl::OkStatus();
  }
  std::shared_ptr<torch::nn::Module> Model() override { return model_; }
  int NumUnits() const override { return 4; }
  absl::StatusOr<hsdp::train::UnitSpec> BuildUnit(int i) override {
    return blocks_[i].Spec(absl::StrCat("blocks.", i));
  }
  absl::StatusOr<hsdp::train::Batch> GetBatch(
      const hsdp::train::BatchRequest& r) override {
    at::Tensor x = torch::empty({r.count, 16});
    for (int64_t b = 0; b < r.count; ++b) {  // sample r.first + b
      x[b].normal_(0, 1, hsdp::train::SampleGenerator(r.seed, r.step,
                                                       r.first + b));
    }
    return hsdp::train::Batch{x, (x.sum(1) > 0).to(torch::kLong)};
  }
  absl::StatusOr<at::Tensor> Loss(const hsdp::train::Batch& batch) override {
    at::Tensor h = batch.input;
    for (const auto& block : blocks_) h = block(h);  // enters its unit
    return torch::nn::functional::cross_entropy(head_(h), batch.target);
  }

 private:
  std::shared_ptr<torch::nn::Module> model_;
  std::vector<hsdp::train::Unit<BlockImpl>> blocks_;  // unit.h
  torch::nn::Linear head_{nullptr};
};
// END task.h example
// clang-format on

constexpr int kWorld = 2;
constexpr int kSteps = 30;

std::string FreshFile(const std::string& name) {
  const std::string path =
      absl::StrCat(::testing::TempDir(), "/", getpid(), "-", name);
  std::remove(path.c_str());
  return path;
}

std::vector<double> Losses(const std::string& path) {
  std::ifstream in(path);
  std::vector<double> out;
  std::string line;
  while (std::getline(in, line)) {
    const size_t at = line.find("\"loss\":");
    if (at == std::string::npos) continue;
    double v = 0;
    const size_t begin = at + 7;
    if (absl::SimpleAtod(
            line.substr(begin, line.find_first_of(",}", begin) - begin), &v))
      out.push_back(v);
  }
  return out;
}

hsdp::train::TrainingOptions Training() {
  hsdp::train::TrainingOptions t;
  t.steps = kSteps;
  t.microbatch_size = 4;
  t.seed = 11;
  t.optimizer.kind = hsdp::train::OptimizerKind::kSgd;
  t.optimizer.lr = 0.1;
  return t;
}

TEST(TaskExampleTest, TrainsShardedAndMatchesItsReference) {
  unsetenv("HSDP_JOB_TOKEN");
  unsetenv("HSDP_JOB_TOKEN_FILE");
  hsdp::coordinator::JobConfig job;
  job.job_id = "task-example";
  job.world_size = kWorld;
  job.mesh = hsdp::MeshShape{1, kWorld};
  hsdp::coordinator::ServerOptions server_options;
  server_options.listen = "127.0.0.1:0";
  server_options.sync_state = false;
  auto server =
      hsdp::coordinator::CoordinatorServer::Start(job, server_options);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string report = FreshFile("task-example-0.jsonl");
  std::vector<absl::Status> results(kWorld);
  std::vector<std::thread> ranks;
  for (int r = 0; r < kWorld; ++r) {
    hsdp::train::WorkerOptions w;
    w.training = Training();
    if (r == 0) w.process.report_file = report;
    w.coordinator = (*server)->address();
    w.job_id = job.job_id;
    w.rank_hint = r;
    w.gloo_hostname = "127.0.0.1";
    w.shared_memory = false;
    w.collective_timeout = absl::Seconds(20);
    w.coordinator_timeout = absl::Seconds(20);
    ranks.emplace_back([w, r, &results] {
      results[r] = hsdp::train::RunTask(std::make_unique<MyTask>(), w);
    });
  }
  for (std::thread& t : ranks) t.join();
  (*server)->Shutdown();
  for (int r = 0; r < kWorld; ++r) ASSERT_TRUE(results[r].ok()) << results[r];

  hsdp::train::ReferenceOptions ref;
  ref.training = Training();
  ref.world_size = kWorld;
  ref.process.report_file = FreshFile("task-example-ref.jsonl");
  ASSERT_TRUE(hsdp::train::RunReference(std::make_unique<MyTask>(), ref).ok());
  const std::vector<double> want = Losses(ref.process.report_file);
  const std::vector<double> got = Losses(report);
  ASSERT_EQ(want.size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(got.size(), want.size());
  for (int s = 0; s < kSteps; ++s) EXPECT_NEAR(got[s], want[s], 1e-6) << s;
  // It learns: the last five steps' mean loss is below the first five's.
  double first = 0, last = 0;
  for (int s = 0; s < 5; ++s) {
    first += want[s];
    last += want[kSteps - 1 - s];
  }
  EXPECT_LT(last, first);
}

}  // namespace
