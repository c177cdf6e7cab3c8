// The example mixture of experts: its settings are checked and named, its
// router really leaves experts empty on some ranks while others use them, and
// sharded on 2x2, 1x4 and 4x1 (four RunTask threads under an in-process
// coordinator, plain SGD) its losses match its own single-process reference
// within 1e-5, with no step anywhere near the collective timeout.
#include "moe_task.h"

#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "hsdp/runner.h"
#include "tests/worker/train/task_cluster.h"
#include "worker/train/task_units.h"
#include "worker/train/training_options.h"

namespace moe {
namespace {

using hsdp::train::TaskArgs;
using hsdp::train::TrainingOptions;

constexpr int kSteps = 10;
constexpr int kWorld = 4;
constexpr int kMicrobatchSize = 2;  // 16 tokens over 8 experts
constexpr uint64_t kSeed = 5;
constexpr double kTolerance = 1e-5;
// Far below the collective timeout (30 s here): a rank left out of a
// collective would wait for all of it.
constexpr double kMaxStepSeconds = 5;

std::unique_ptr<hsdp::train::Task> MakeTask() {
  absl::StatusOr<std::unique_ptr<MoeTask>> task = MoeTask::Create(TaskArgs());
  EXPECT_TRUE(task.ok()) << task.status();
  return task.ok() ? std::move(*task) : nullptr;
}

// How one mesh test runs: the mesh and the gradient reduction.
struct MeshCase {
  int replicate;
  int shard;
  std::string grad_reduce = "avg";
  double grad_divide_factor = 0;
};

TrainingOptions Training(const MeshCase& c = {2, 2}) {
  TrainingOptions t;
  t.steps = kSteps;
  t.microbatch_size = kMicrobatchSize;
  t.seed = kSeed;
  t.optimizer.kind = hsdp::train::OptimizerKind::kSgd;
  t.grad_reduce = c.grad_reduce;
  t.grad_divide_factor = c.grad_divide_factor;
  // The same step size whatever the reduction's scale (SGD's update is the
  // gradient times the rate).
  t.optimizer.lr = 0.2 / hsdp::train::ReferenceGradScale(t, kWorld);
  return t;
}

using hsdp::train::testing::FreshFile;
using hsdp::train::testing::ReportField;

TEST(MoeTaskTest, BadSettingsAreRefusedNamingThem) {
  std::vector<std::pair<TaskArgs, std::string>> cases(4);
  cases[0].first.model = "gpt-tiny";
  cases[0].second = "--model gpt-tiny";
  cases[1].first.data = "corpus.txt";
  cases[1].second = "--data corpus.txt";
  cases[2].first.options = {{"depth", "3"}};
  cases[2].second = "--task-option depth";
  cases[3].first.options = {{"experts", "0"}};
  cases[3].second = "--task-option experts=0";
  for (const auto& [args, needle] : cases) {
    absl::StatusOr<std::unique_ptr<MoeTask>> task = MoeTask::Create(args);
    ASSERT_FALSE(task.ok()) << needle;
    EXPECT_EQ(task.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(task.status().message().find(needle), std::string::npos)
        << task.status();
  }
}

// The case this example exists for: in some step an expert has tokens on one
// rank and none on another.
TEST(MoeTaskTest, SomeExpertsAreEmptyOnSomeRanksOnly) {
  std::unique_ptr<hsdp::train::Task> task = MakeTask();
  ASSERT_TRUE(task->Build(hsdp::train::BuildContext{c10::kCPU, kSeed}).ok());
  const MoeConfig config;
  int partly_used = 0;
  for (int step = 0; step < kSteps; ++step) {
    std::vector<std::set<int64_t>> used(kWorld);
    for (int r = 0; r < kWorld; ++r) {
      absl::StatusOr<hsdp::train::Batch> batch =
          task->GetBatch({step, r * kMicrobatchSize, kMicrobatchSize, kSeed});
      ASSERT_TRUE(batch.ok());
      const at::Tensor tokens = batch->input.reshape({-1});
      for (int64_t i = 0; i < tokens.numel(); ++i)
        used[r].insert(ExpertOf(tokens[i].item<int64_t>(), config.experts));
    }
    for (int64_t e = 0; e < config.experts; ++e) {
      int ranks = 0;
      for (const auto& u : used) ranks += u.count(e) ? 1 : 0;
      if (ranks > 0 && ranks < kWorld) ++partly_used;
    }
  }
  EXPECT_GT(partly_used, kSteps);
}

// The placement reaches the units: each layer's biases (the router's one and
// every expert's hidden + dim) are held whole on every rank.
TEST(MoeTaskTest, BiasesAreReplicatedAndTheRouterShardedOnDim1) {
  std::unique_ptr<hsdp::train::Task> task = MakeTask();
  ASSERT_TRUE(task->Build(hsdp::train::BuildContext{c10::kCPU, kSeed}).ok());
  const MoeConfig config;
  absl::StatusOr<std::vector<hsdp::fsdp::UnitLayout>> units =
      hsdp::train::DescribeTaskUnits(*task, hsdp::fsdp::EngineOptions());
  ASSERT_TRUE(units.ok()) << units.status();
  ASSERT_EQ(units->size(), static_cast<size_t>(config.layers + 1));
  const int64_t layer_biases =
      1 + config.experts * (config.hidden + config.dim);
  EXPECT_EQ((*units)[1].replicated_bytes, layer_biases * 4);
  EXPECT_EQ((*units)[0].replicated_bytes, config.vocab * 4);  // head.bias
  const at::Tensor router = torch::empty({1, config.dim});
  const std::optional<hsdp::fsdp::ParamPlacement> placement =
      task->Placement("layers_0.router.weight", router);
  ASSERT_TRUE(placement.has_value());
  EXPECT_EQ(placement->shard_dim, 1);
}

std::string CaseName(const MeshCase& c) {
  std::string name =
      absl::StrCat(c.replicate, "x", c.shard, "_", c.grad_reduce);
  if (c.grad_divide_factor > 0)
    name =
        absl::StrCat(name, "_divide", static_cast<int>(c.grad_divide_factor));
  return name;
}

class MoeMeshTest : public ::testing::TestWithParam<MeshCase> {};

TEST_P(MoeMeshTest, ShardedMatchesSingleProcessReference) {
  const MeshCase& c = GetParam();
  hsdp::train::TaskArgs args;
  args.model = kModelName;
  const hsdp::train::testing::ClusterRun run = hsdp::train::testing::RunCluster(
      absl::StrCat("moe-test-", CaseName(c)),
      hsdp::MeshShape{c.replicate, c.shard}, MakeTask, Training(c), args);
  ASSERT_EQ(run.results.size(), static_cast<size_t>(kWorld));
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(run.results[r].ok()) << "rank " << r << ": " << run.results[r];
  }
  const std::string ref =
      FreshFile(absl::StrCat("moe-test-", CaseName(c), "-ref.jsonl"));
  ASSERT_TRUE(
      hsdp::train::testing::RunTaskReference(MakeTask, Training(c), kWorld, ref)
          .ok());
  const std::vector<double> expected = ReportField(ref, "loss");
  ASSERT_EQ(expected.size(), static_cast<size_t>(kSteps));
  // It learns: the last three steps' mean loss is below the first three's.
  EXPECT_LT(expected[kSteps - 1] + expected[kSteps - 2] + expected[kSteps - 3],
            expected[0] + expected[1] + expected[2]);

  for (int r = 0; r < kWorld; ++r) {
    const std::vector<double> got = ReportField(run.reports[r], "loss");
    ASSERT_EQ(got.size(), static_cast<size_t>(kSteps)) << "rank " << r;
    for (int s = 0; s < kSteps; ++s) {
      EXPECT_NEAR(got[s], expected[s], kTolerance)
          << "rank " << r << " step " << s;
    }
    for (double seconds : ReportField(run.reports[r], "step_seconds"))
      EXPECT_LT(seconds, kMaxStepSeconds) << "rank " << r;
  }
}

// Every mesh shape with the mean; on 2x2 also the sum and a divide factor.
INSTANTIATE_TEST_SUITE_P(Meshes, MoeMeshTest,
                         ::testing::Values(MeshCase{2, 2}, MeshCase{1, 4},
                                           MeshCase{4, 1},
                                           MeshCase{2, 2, "sum"},
                                           MeshCase{2, 2, "avg", 16}),
                         [](const auto& info) { return CaseName(info.param); });

}  // namespace
}  // namespace moe
