// The example ResNet task: its settings are checked and named, it trains, and
// sharded on a 2x2 mesh (four RunTask threads under an in-process coordinator)
// its losses match its own single-process reference.
#include "resnet_task.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "coordinator/server.h"
#include "gtest/gtest.h"
#include "hsdp/runner.h"

namespace resnet {
namespace {

using hsdp::train::ReferenceOptions;
using hsdp::train::TrainingOptions;

// Enough steps of batches of 8 noisy images for the loss to fall through the
// noise: the last quarter's mean below the first quarter's.
constexpr int kSteps = 24;
constexpr char kJob[] = "resnet-test";

std::unique_ptr<hsdp::train::Task> MakeTask() {
  absl::StatusOr<std::unique_ptr<ResNetTask>> task = ResNetTask::Create(
      {{"channels", "8"}, {"blocks", "3"}, {"image_size", "6"}});
  EXPECT_TRUE(task.ok()) << task.status();
  return task.ok() ? std::move(*task) : nullptr;
}

// Plain SGD: unlike AdamW its update is proportional to the gradient, so a
// wrong gradient scale (a sum where a mean belongs) changes the losses.
TrainingOptions Training() {
  TrainingOptions t;
  t.steps = kSteps;
  t.microbatch_size = 2;
  t.seed = 7;
  t.optimizer.kind = hsdp::train::OptimizerKind::kSgd;
  t.optimizer.lr = 0.1;
  return t;
}

// Per process: several builds may run this test at once.
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
    const size_t begin = at + 7;
    double v = 0;
    EXPECT_TRUE(absl::SimpleAtod(
        line.substr(begin, line.find_first_of(",}", begin) - begin), &v))
        << line;
    out.push_back(v);
  }
  return out;
}

TEST(ResNetTaskTest, BadSettingsAreRefusedNamingThem) {
  struct Case {
    std::map<std::string, std::string> options;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {{{"depth", "3"}},
       "--task-option depth: not an option of this task (it has channels, "
       "blocks, image_size, classes, groups)"},
      {{{"channels", "-8"}},
       "--task-option channels=-8: want an integer in [1, 4096]"},
      {{{"blocks", "three"}},
       "--task-option blocks=three: want an integer in [1, 4096]"},
      {{{"channels", "6"}, {"groups", "4"}},
       "--task-option groups=4: must divide channels=6"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<std::unique_ptr<ResNetTask>> task =
        ResNetTask::Create(c.options);
    ASSERT_FALSE(task.ok()) << c.needle;
    EXPECT_EQ(task.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(task.status().message(), c.needle) << task.status();
  }
  // The defaults build, and the help names every option with its default.
  EXPECT_TRUE(ResNetTask::Create(std::map<std::string, std::string>()).ok());
  const std::string help = ResNetTask::Options().Help();
  for (const char* want :
       {"channels=INT in [1, 4096] (default 8)", "blocks=INT", "image_size",
        "classes", "groups=INT in [1, 4096] (default 2)"}) {
    EXPECT_NE(help.find(want), std::string::npos) << want << "\n" << help;
  }
}

TEST(ResNetTaskTest, ShardedTwoByTwoMatchesSingleProcessReference) {
  unsetenv("HSDP_JOB_TOKEN");
  unsetenv("HSDP_JOB_TOKEN_FILE");
  constexpr int kWorld = 4;
  hsdp::coordinator::JobConfig job;
  job.job_id = kJob;
  job.world_size = kWorld;
  job.mesh = hsdp::MeshShape{2, 2};
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
    reports.push_back(FreshFile(absl::StrCat("resnet-rank-", r, ".jsonl")));
    hsdp::train::WorkerOptions w;
    w.training = Training();
    w.process.report_file = reports.back();
    w.task_args.model = kModelName;
    w.task_args.options = {
        {"channels", "8"}, {"blocks", "3"}, {"image_size", "6"}};
    w.coordinator = (*server)->address();
    w.job_id = kJob;
    w.rank_hint = r;
    w.gloo_hostname = "127.0.0.1";
    // One process: the ranks are threads, which shared memory does not need.
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
  ref.training = Training();
  ref.world_size = kWorld;
  ref.microbatches = 1;
  ref.process.report_file = FreshFile("resnet-reference.jsonl");
  ASSERT_TRUE(hsdp::train::RunReference(MakeTask(), ref).ok());
  const std::vector<double> expected = Losses(ref.process.report_file);
  ASSERT_EQ(expected.size(), static_cast<size_t>(kSteps));
  const auto quarter_mean = [&](int first) {
    double sum = 0;
    for (int s = first; s < first + kSteps / 4; ++s) sum += expected[s];
    return sum / (kSteps / 4);
  };
  EXPECT_LT(quarter_mean(kSteps - kSteps / 4), quarter_mean(0));  // it learns

  for (int r = 0; r < kWorld; ++r) {
    const std::vector<double> got = Losses(reports[r]);
    ASSERT_EQ(got.size(), static_cast<size_t>(kSteps)) << "rank " << r;
    for (int s = 0; s < kSteps; ++s) {
      EXPECT_NEAR(got[s], expected[s], 1e-5) << "rank " << r << " step " << s;
    }
  }
}

}  // namespace
}  // namespace resnet
