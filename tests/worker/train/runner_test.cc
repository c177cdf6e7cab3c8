// The runner without a coordinator: the single-process reference over the
// built-in GPT task, training options and their checks.
#include "hsdp/runner.h"

#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "gtest/gtest.h"
#include "hsdp/models/builtin_tasks.h"
#include "hsdp/worker_main.h"
#include "worker/train/training_options.h"

namespace hsdp::train {
namespace {

std::vector<double> Losses(const std::string& path) {
  std::ifstream in(path);
  std::vector<double> out;
  std::string line;
  while (std::getline(in, line)) {
    const size_t at = line.find("\"loss\":");
    EXPECT_NE(at, std::string::npos) << line;
    const size_t begin = at + 7;
    double v = 0;
    EXPECT_TRUE(
        absl::SimpleAtod(line.substr(begin, line.find(',', begin) - begin), &v))
        << line;
    out.push_back(v);
  }
  return out;
}

std::unique_ptr<Task> Gpt(const std::string& dims = "32,1,2,16") {
  TaskArgs args;
  args.model = "gpt-tiny";
  args.dims = dims;
  absl::StatusOr<std::unique_ptr<Task>> task = models::MakeBuiltinTask(args);
  EXPECT_TRUE(task.ok()) << task.status();
  return std::move(*task);
}

ReferenceOptions Small(const std::string& report) {
  ReferenceOptions o;
  o.training.steps = 4;
  o.training.microbatch_size = 2;
  o.process.report_file = report;
  return o;
}

std::string FreshFile(const std::string& name) {
  const std::string path = ::testing::TempDir() + "/" + name;
  std::remove(path.c_str());
  return path;
}

TEST(ReferenceTest, SameGlobalBatchWhetherSplitByRanksOrMicrobatches) {
  const std::string a = FreshFile("ref-ranks.jsonl"),
                    b = FreshFile("ref-micro.jsonl");
  // 2 ranks x 1 microbatch and 1 rank x 2 microbatches read the same global
  // sample indices.
  ReferenceOptions ranks = Small(a);
  ranks.world_size = 2;
  ReferenceOptions micro = Small(b);
  micro.microbatches = 2;
  ASSERT_TRUE(RunReference(Gpt(), ranks).ok());
  ASSERT_TRUE(RunReference(Gpt(), micro).ok());
  std::vector<double> la = Losses(a), lb = Losses(b);
  ASSERT_EQ(la.size(), 4u);
  ASSERT_EQ(lb.size(), 4u);
  for (size_t i = 0; i < la.size(); ++i)
    EXPECT_DOUBLE_EQ(la[i], lb[i]) << "step " << i;
  EXPECT_LT(la.back(), la.front());
}

TEST(ReferenceTest, SgdTiedEmbeddingsAndCosineScheduleTrain) {
  const std::string path = FreshFile("ref-sgd.jsonl");
  ReferenceOptions o = Small(path);
  o.training.steps = 6;
  o.training.optimizer.kind = OptimizerKind::kSgd;
  o.training.optimizer.lr = 0.5;
  o.training.optimizer.momentum = 0.9;
  o.training.lr_schedule.warmup_steps = 2;
  o.training.lr_schedule.cosine = true;
  o.training.clip_grad_norm = 1.0;
  TaskArgs args;
  args.model = "gpt-tiny";
  args.dims = "32,1,2,16";
  args.options["tie_embeddings"] = "true";
  auto task = models::MakeBuiltinTask(args);
  ASSERT_TRUE(task.ok()) << task.status();
  ASSERT_TRUE(RunReference(std::move(*task), o).ok());
  std::vector<double> losses = Losses(path);
  ASSERT_EQ(losses.size(), 6u);
  for (double l : losses) EXPECT_TRUE(std::isfinite(l));
  EXPECT_LT(losses.back(), losses.front());
}

TEST(ReferenceTest, BadTaskArgumentsAreErrorsNamingThem) {
  TaskArgs args;
  args.model = "gpt-nope";
  auto unknown = models::MakeBuiltinTask(args);
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(unknown.status().message().find("gpt-nope"), std::string::npos);
  args.model = "gpt-tiny";
  args.options["colour"] = "blue";
  auto option = models::MakeBuiltinTask(args);
  EXPECT_EQ(option.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(option.status().message().find("colour"), std::string::npos);
}

// WorkerMain on `args` (after the program name): its exit code and stderr.
std::pair<int, std::string> Main(std::vector<std::string> args) {
  args.insert(args.begin(), "hsdp-worker");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  ::testing::internal::CaptureStderr();
  const int code = WorkerMain(static_cast<int>(argv.size()), argv.data(),
                              models::MakeBuiltinTask);
  return {code, ::testing::internal::GetCapturedStderr()};
}

TEST(WorkerMainTest, ReferenceWithoutWorldSizeAndBadOnNonFiniteAreRefused) {
  constexpr int kExitUsage = 2;
  auto [code, err] = Main({"--reference", "--steps", "1"});
  EXPECT_EQ(code, kExitUsage);
  EXPECT_TRUE(absl::StrContains(err, "--reference needs --world-size N"))
      << err;
  std::tie(code, err) = Main({"--on-nonfinite", "ignore"});
  EXPECT_EQ(code, kExitUsage);
  EXPECT_TRUE(absl::StrContains(
      err, "--on-nonfinite: 'ignore' is not stop or skip-step"))
      << err;
  // With it, the reference runs.
  const std::string report = FreshFile("main-ref.jsonl");
  std::tie(code, err) =
      Main({"--reference", "--world-size", "2", "--steps", "1", "--model",
            "gpt-tiny", "--dims", "32,1,2,16", "--microbatch-size", "1",
            "--report-file", report});
  EXPECT_EQ(code, 0) << err;
  EXPECT_EQ(Losses(report).size(), 1u);
}

TEST(TrainingOptionsTest, LearningRateScheduleWarmsUpThenDecays) {
  LrScheduleOptions constant;
  EXPECT_DOUBLE_EQ(constant.LearningRate(0.1, 0, 10), 0.1);
  EXPECT_DOUBLE_EQ(constant.LearningRate(0.1, 9, 10), 0.1);
  LrScheduleOptions cosine;
  cosine.warmup_steps = 4;
  cosine.cosine = true;
  cosine.min_lr = 0.01;
  EXPECT_DOUBLE_EQ(cosine.LearningRate(0.1, 0, 14), 0.025);
  EXPECT_DOUBLE_EQ(cosine.LearningRate(0.1, 3, 14), 0.1);
  EXPECT_DOUBLE_EQ(cosine.LearningRate(0.1, 4, 14), 0.1);
  EXPECT_NEAR(cosine.LearningRate(0.1, 13, 14), 0.01, 1e-12);
  double previous = 1;
  for (int s = 4; s < 14; ++s) {
    const double lr = cosine.LearningRate(0.1, s, 14);
    EXPECT_LE(lr, previous);
    previous = lr;
  }
}

TEST(TrainingOptionsTest, InvalidValuesNameTheFlag) {
  struct Case {
    std::function<void(TrainingOptions&)> mutate;
    std::string flag;
  };
  const std::vector<Case> cases = {
      {[](TrainingOptions& t) { t.optimizer.lr = 0; }, "--lr"},
      {[](TrainingOptions& t) { t.microbatch_size = 0; }, "--microbatch-size"},
      {[](TrainingOptions& t) { t.param_dtype = "fp16"; }, "--param-dtype"},
      {[](TrainingOptions& t) { t.reduce_dtype = "int8"; }, "--reduce-dtype"},
      {[](TrainingOptions& t) { t.grad_accumulation_dtype = "fp16"; },
       "--grad-accumulation-dtype"},
      {[](TrainingOptions& t) { t.optimizer.momentum = 0.5; }, "--momentum"},
      {[](TrainingOptions& t) { t.optimizer.weight_decay = -1; },
       "--weight-decay"},
      {[](TrainingOptions& t) { t.lr_schedule.min_lr = 1; }, "--min-lr"},
      {[](TrainingOptions& t) { t.clip_grad_norm = -2; }, "--clip-grad-norm"},
  };
  for (const Case& c : cases) {
    TrainingOptions t;
    c.mutate(t);
    absl::Status s = ValidateTrainingOptions(t);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.flag;
    EXPECT_EQ(s.message().rfind(c.flag, 0), 0u) << s;
  }
  EXPECT_TRUE(ValidateTrainingOptions(TrainingOptions()).ok());
}

TEST(TrainingOptionsTest, ProtoCarriesEverySetting) {
  TrainingOptions t;
  t.optimizer.kind = OptimizerKind::kSgd;
  t.optimizer.momentum = 0.9;
  t.param_dtype = "bf16";
  t.recompute_units = "layers.*";
  TaskArgs args;
  args.dims = "32,1,2,16";
  args.options["tie_embeddings"] = "true";
  t.on_nonfinite = NonFiniteAction::kSkipStep;
  hsdp::v1::TrainingSpec spec = ToProto(t, args, "gpt-tiny", 2);
  EXPECT_EQ(spec.task(), "gpt-tiny");
  EXPECT_EQ(spec.on_nonfinite(), "skip-step");
  EXPECT_EQ(spec.task_version(), 2);
  EXPECT_EQ(spec.optimizer().kind(), hsdp::v1::OPTIMIZER_KIND_SGD);
  EXPECT_DOUBLE_EQ(spec.optimizer().momentum(), 0.9);
  EXPECT_DOUBLE_EQ(spec.optimizer().weight_decay(), 0.0);
  EXPECT_EQ(spec.reduce_dtype(), "fp32");  // bf16 compute, fp32 reduce
  EXPECT_EQ(spec.grad_accumulation_dtype(), "bf16");  // the param dtype
  EXPECT_EQ(spec.recompute_units(), "layers.*");
  EXPECT_EQ(spec.task_options().at("tie_embeddings"), "true");
  t.optimizer.kind = OptimizerKind::kAdamW;
  t.optimizer.momentum = 0;
  EXPECT_DOUBLE_EQ(ToProto(t, args, "x", 1).optimizer().weight_decay(), 0.01);
}

}  // namespace
}  // namespace hsdp::train
