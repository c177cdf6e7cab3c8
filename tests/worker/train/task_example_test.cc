// The usage example of hsdp/task.h, compiled and trained: a task
// written as that comment says builds against the public headers, trains
// sharded on 1x2 under an in-process coordinator and matches its
// single-process reference. task_example_in_sync checks that the code
// between the markers is the comment's, line for line.
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "hsdp/runner.h"
#include "hsdp/task.h"
#include "hsdp/task_util.h"
#include "hsdp/unit.h"
#include "tests/worker/train/task_cluster.h"

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
    at::Tensor x = torch::empty({r.sample_count, 16});
    for (int64_t b = 0; b < r.sample_count; ++b) {
      x[b].normal_(0, 1, hsdp::train::SampleGenerator(
                             r.seed, r.step, r.first_sample + b));
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
  namespace t = hsdp::train::testing;
  const t::TaskMaker make = [] { return std::make_unique<MyTask>(); };
  const t::ClusterRun run = t::RunCluster(
      "task-example", hsdp::MeshShape{1, kWorld}, make, Training());
  ASSERT_EQ(run.results.size(), static_cast<size_t>(kWorld));
  for (const absl::Status& s : run.results) ASSERT_TRUE(s.ok()) << s;
  const std::string ref = t::FreshFile("task-example-ref.jsonl");
  ASSERT_TRUE(t::RunTaskReference(make, Training(), kWorld, ref).ok());
  const std::vector<double> want = t::ReportField(ref, "loss");
  const std::vector<double> got = t::ReportField(run.reports[0], "loss");
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
