// The example mixture of experts: its settings are checked and named, its
// router really leaves experts empty on some ranks while others use them, and
// sharded on 2x2, 1x4 and 4x1 (four RunTask threads under an in-process
// coordinator, plain SGD) its losses match its own single-process reference
// within 1e-5, with no step anywhere near the collective timeout.
#include "moe_task.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "coordinator/server.h"
#include "gtest/gtest.h"
#include "worker/train/runner.h"
#include "worker/train/training_options.h"

namespace moe {
namespace {

using hsdp::train::ReferenceOptions;
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

std::string FreshFile(const std::string& name) {
  const std::string path =
      absl::StrCat(::testing::TempDir(), "/", getpid(), "-", name);
  std::remove(path.c_str());
  return path;
}

// The numeric value of `key` on each report line that has it.
std::vector<double> Field(const std::string& path, const std::string& key) {
  std::ifstream in(path);
  std::vector<double> out;
  std::string line;
  const std::string needle = absl::StrCat("\"", key, "\":");
  while (std::getline(in, line)) {
    const size_t at = line.find(needle);
    if (at == std::string::npos || line.find("\"rank\":-1") == 0) continue;
    const size_t begin = at + needle.size();
    double v = 0;
    EXPECT_TRUE(absl::SimpleAtod(
        line.substr(begin, line.find_first_of(",}", begin) - begin), &v))
        << line;
    out.push_back(v);
  }
  return out;
}

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
  unsetenv("HSDP_JOB_TOKEN");
  unsetenv("HSDP_JOB_TOKEN_FILE");
  const MeshCase& c = GetParam();
  const int replicate = c.replicate;
  const int shard = c.shard;
  const std::string job_id = absl::StrCat("moe-test-", CaseName(c));
  hsdp::coordinator::JobConfig job;
  job.job_id = job_id;
  job.world_size = kWorld;
  job.mesh = hsdp::MeshShape{replicate, shard};
  hsdp::coordinator::ServerOptions server_options;
  server_options.listen = "127.0.0.1:0";
  server_options.sync_state = false;
  auto server =
      hsdp::coordinator::CoordinatorServer::Start(job, server_options);
  ASSERT_TRUE(server.ok()) << server.status();

  std::vector<std::string> reports;
  std::vector<absl::Status> results(kWorld);
  std::vector<std::thread> ranks;
  for (int r = 0; r < kWorld; ++r) {
    reports.push_back(FreshFile(absl::StrCat(job_id, "-rank-", r, ".jsonl")));
    hsdp::train::WorkerOptions w;
    w.training = Training(c);
    w.process.report_file = reports.back();
    w.task_args.model = kModelName;
    w.coordinator = (*server)->address();
    w.job_id = job_id;
    w.rank_hint = r;
    w.gloo_hostname = "127.0.0.1";
    w.shared_memory = false;
    w.collective_timeout = absl::Seconds(30);
    w.coordinator_timeout = absl::Seconds(30);
    ranks.emplace_back(
        [w, r, &results] { results[r] = hsdp::train::RunTask(MakeTask(), w); });
  }
  for (std::thread& t : ranks) t.join();
  (*server)->Shutdown();
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(results[r].ok()) << "rank " << r << ": " << results[r];
  }

  ReferenceOptions ref;
  ref.training = Training(c);
  ref.world_size = kWorld;
  ref.microbatches = 1;
  ref.process.report_file = FreshFile(absl::StrCat(job_id, "-ref.jsonl"));
  ASSERT_TRUE(hsdp::train::RunReference(MakeTask(), ref).ok());
  const std::vector<double> expected = Field(ref.process.report_file, "loss");
  ASSERT_EQ(expected.size(), static_cast<size_t>(kSteps));
  // It learns: the last three steps' mean loss is below the first three's.
  EXPECT_LT(expected[kSteps - 1] + expected[kSteps - 2] + expected[kSteps - 3],
            expected[0] + expected[1] + expected[2]);

  for (int r = 0; r < kWorld; ++r) {
    const std::vector<double> got = Field(reports[r], "loss");
    ASSERT_EQ(got.size(), static_cast<size_t>(kSteps)) << "rank " << r;
    for (int s = 0; s < kSteps; ++s) {
      EXPECT_NEAR(got[s], expected[s], kTolerance)
          << "rank " << r << " step " << s;
    }
    for (double seconds : Field(reports[r], "step_seconds"))
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
