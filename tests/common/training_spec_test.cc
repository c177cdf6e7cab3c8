#include "common/training_spec.h"

#include "gtest/gtest.h"

namespace hsdp {
namespace {

hsdp::v1::TrainingSpec Spec() {
  hsdp::v1::TrainingSpec s;
  s.set_task("gpt-tiny");
  s.set_task_version(2);
  s.set_steps(20);
  s.mutable_optimizer()->set_kind(hsdp::v1::OPTIMIZER_KIND_ADAMW);
  s.mutable_optimizer()->set_lr(0.003);
  (*s.mutable_task_options())["tie_embeddings"] = "true";
  s.set_param_dtype("fp32");
  return s;
}

TEST(TrainingSpecTest, EqualSpecsAgree) {
  EXPECT_TRUE(CompareTrainingSpecs(Spec(), Spec()).ok());
}

TEST(TrainingSpecTest, FirstDifferenceIsNamedWithBothValues) {
  hsdp::v1::TrainingSpec other = Spec();
  other.mutable_optimizer()->set_lr(0.001);
  absl::Status s = CompareTrainingSpecs(other, Spec());
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(std::string(s.message()),
            "training setting optimizer.lr differs: this worker has 0.001, the "
            "job has 0.003");

  other = Spec();
  other.set_param_dtype("bf16");
  s = CompareTrainingSpecs(other, Spec());
  EXPECT_EQ(std::string(s.message()),
            "training setting param_dtype differs: this worker has \"bf16\", "
            "the job has \"fp32\"");

  other = Spec();
  other.set_cpu_offload(true);
  s = CompareTrainingSpecs(other, Spec());
  EXPECT_EQ(std::string(s.message()),
            "training setting cpu_offload differs: this worker has true, the "
            "job has false");

  other = Spec();
  (*other.mutable_task_options())["tie_embeddings"] = "false";
  s = CompareTrainingSpecs(other, Spec());
  EXPECT_EQ(std::string(s.message()),
            "training setting task_options.tie_embeddings differs: this "
            "worker has false, the job has true");

  // A key on one side only; and the sides named as the caller asks.
  other = Spec();
  (*other.mutable_task_options())["blocks"] = "3";
  s = CompareTrainingSpecs(other, Spec(), "the run", "the reference");
  EXPECT_EQ(std::string(s.message()),
            "training setting task_options.blocks differs: the run has 3, "
            "the reference has (unset)");
}

}  // namespace
}  // namespace hsdp
