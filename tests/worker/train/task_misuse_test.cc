// A new task's likeliest mistakes, each a small task: refused in one line that
// says what is wrong (and names the unit where there is one), or trained
// correctly where hsdp supports the pattern; never a LibTorch internal and
// never a silent wrong number. Each runs sharded (1x2, RunTask threads under
// an in-process coordinator) and through RunReference.
#include <torch/torch.h>

#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "hsdp/runner.h"
#include "hsdp/task.h"
#include "hsdp/task_util.h"
#include "hsdp/unit.h"
#include "tests/worker/train/task_cluster.h"

namespace hsdp::train {
namespace {

constexpr int kWorld = 2;
constexpr int kSteps = 3;
constexpr int64_t kFeatures = 6;
constexpr int64_t kClasses = 3;

enum class Misuse {
  kNone,
  kDirectCall,          // blocks[1]->forward(x): bypasses its unit
  kWrongOrder,          // blocks[1] entered before blocks[0]
  kSkipped,             // blocks[1] never entered: supported
  kSkippedOnSomeRanks,  // blocks[1] skipped for some data: supported
  kTwice,               // blocks[0] entered twice: supported
  kUnregisteredModule,  // a Linear built but not registered
  kUnregisteredTensor,  // a requires_grad tensor not registered
  kNonScalarLoss,
  kNanAtStep,  // one microbatch of one step is NaN
  kNondeterministicBatch,
};

// kNanAtStep: the samples of global microbatch kNanSlot of step kNanStep (rank
// 1's only microbatch on 1x2) are NaN.
constexpr int64_t kNanStep = 1;
constexpr int64_t kNanSlot = 1;

class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl() {
    fc = register_module("fc", torch::nn::Linear(kFeatures, kFeatures));
  }
  at::Tensor forward(const at::Tensor& x) { return x + torch::tanh(fc(x)); }
  torch::nn::Linear fc{nullptr};
};

class MisuseTask : public Task {
 public:
  explicit MisuseTask(Misuse misuse) : misuse_(misuse) {}
  std::string Name() const override { return "misuse"; }
  absl::Status Build(const BuildContext& context) override {
    model_ = std::make_shared<torch::nn::Module>("Misuse");
    stem_ = model_->register_module("stem",
                                    torch::nn::Linear(kFeatures, kFeatures));
    for (int i = 0; i < 2; ++i) {
      blocks_.emplace_back(model_->register_module(
          absl::StrCat("blocks_", i), std::make_shared<BlockImpl>()));
    }
    head_ =
        model_->register_module("head", torch::nn::Linear(kFeatures, kClasses));
    // Ranks are threads here: torch's global generator would give each
    // another init.
    InitParameters(*model_, context.seed);
    extra_ = torch::nn::Linear(kFeatures, kFeatures);  // never registered
    scale_ = torch::ones({kFeatures}).requires_grad_();
    return absl::OkStatus();
  }
  std::shared_ptr<torch::nn::Module> Model() override { return model_; }
  int NumUnits() const override { return 2; }
  absl::StatusOr<UnitSpec> BuildUnit(int index) override {
    return blocks_.at(index).Spec(absl::StrCat("blocks.", index));
  }
  absl::StatusOr<Batch> GetBatch(const BatchRequest& r) override {
    at::Tensor x = torch::empty({r.sample_count, kFeatures});
    at::Tensor y = torch::empty({r.sample_count}, torch::kLong);
    for (int64_t b = 0; b < r.sample_count; ++b) {
      const int64_t s = r.first_sample + b + 7 * r.step;
      for (int64_t f = 0; f < kFeatures; ++f)
        x[b][f] = static_cast<float>(((s * 5 + f * 3) % 11) - 5) / 5.0f;
      y[b] = s % kClasses;
    }
    if (misuse_ == Misuse::kNondeterministicBatch) x += 0.01 * ++calls_;
    if (misuse_ == Misuse::kNanAtStep && r.step == kNanStep &&
        r.first_sample == kNanSlot * r.sample_count) {
      x.fill_(std::numeric_limits<float>::quiet_NaN());
    }
    return Batch{x, y};
  }
  absl::StatusOr<at::Tensor> Loss(const Batch& batch) override {
    at::Tensor x = stem_(batch.input);
    switch (misuse_) {
      case Misuse::kDirectCall:
        x = blocks_[0](x);
        x = blocks_[1]->forward(x);
        break;
      case Misuse::kWrongOrder:
        x = blocks_[1](x);
        x = blocks_[0](x);
        break;
      case Misuse::kSkipped:
        x = blocks_[0](x);
        break;
      case Misuse::kSkippedOnSomeRanks:
        // Routed by the data: on 1x2, rank 0 skips the block at step 0 and
        // rank 1 at step 1; both run it at step 2.
        x = blocks_[0](x);
        if (batch.target[0].item<int64_t>() != 0) x = blocks_[1](x);
        break;
      case Misuse::kTwice:
        x = blocks_[0](x);
        x = blocks_[0](x);
        x = blocks_[1](x);
        break;
      case Misuse::kUnregisteredModule:
        x = extra_(blocks_[1](blocks_[0](x)));
        break;
      case Misuse::kUnregisteredTensor:
        x = blocks_[1](blocks_[0](x)) * scale_;
        break;
      default:
        x = blocks_[1](blocks_[0](x));
    }
    namespace F = torch::nn::functional;
    at::Tensor loss =
        misuse_ == Misuse::kNonScalarLoss
            ? F::cross_entropy(
                  head_(x), batch.target,
                  F::CrossEntropyFuncOptions().reduction(torch::kNone))
            : F::cross_entropy(head_(x), batch.target);
    return loss;
  }

 private:
  const Misuse misuse_;
  int calls_ = 0;
  std::shared_ptr<torch::nn::Module> model_;
  torch::nn::Linear stem_{nullptr}, head_{nullptr}, extra_{nullptr};
  std::vector<Unit<BlockImpl>> blocks_;
  at::Tensor scale_;
};

TrainingOptions Training() {
  TrainingOptions t;
  t.steps = kSteps;
  t.microbatch_size = 2;
  t.seed = 3;
  t.optimizer.kind = OptimizerKind::kSgd;
  t.optimizer.lr = 0.1;
  return t;
}

struct Outcome {
  absl::Status sharded;  // rank 0's
  absl::Status reference;
  std::vector<double> sharded_losses;
  std::vector<double> reference_losses;
};

Outcome RunMisuse(Misuse misuse, const std::string& name,
                  TrainingOptions training = Training()) {
  Outcome out;
  const testing::TaskMaker make = [misuse] {
    return std::make_unique<MisuseTask>(misuse);
  };
  const testing::ClusterRun run = testing::RunCluster(
      absl::StrCat("misuse-", name), MeshShape{1, kWorld}, make, training, {},
      [misuse](coordinator::JobConfig& job) {
        // Without forward prefetch: a prefetched unit's parameters are being
        // gathered when the next module runs, so a direct call of it would
        // read them (possibly before they arrived) instead of failing. The
        // Unit<> wrapper is what makes that call impossible to get wrong.
        if (misuse == Misuse::kDirectCall)
          job.policy.set_forward_prefetch_depth(0);
      });
  if (run.results.empty()) return out;
  out.sharded = run.results[0];
  out.sharded_losses = testing::ReportField(run.reports[0], "loss");
  const std::string ref = testing::FreshFile(absl::StrCat(name, "-ref.jsonl"));
  out.reference = testing::RunTaskReference(make, training, kWorld, ref);
  out.reference_losses = testing::ReportField(ref, "loss");
  return out;
}

void ExpectRefused(const absl::Status& s, const std::string& needle) {
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find(needle), std::string::npos) << s;
  EXPECT_EQ(s.message().find('\n'), std::string::npos) << s;
}

void ExpectMatchesReference(const Outcome& o) {
  ASSERT_TRUE(o.sharded.ok()) << o.sharded;
  ASSERT_TRUE(o.reference.ok()) << o.reference;
  ASSERT_EQ(o.sharded_losses.size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(o.reference_losses.size(), static_cast<size_t>(kSteps));
  for (int s = 0; s < kSteps; ++s)
    EXPECT_NEAR(o.sharded_losses[s], o.reference_losses[s], 1e-6) << s;
}

TEST(TaskMisuseTest, CorrectTaskMatchesItsReference) {
  ExpectMatchesReference(RunMisuse(Misuse::kNone, "none"));
}

// Calling a Unit<> enters its unit also when its activations are recomputed
// in backward: the block's forward runs again inside the unit.
TEST(TaskMisuseTest, RecomputedUnitsMatchTheReference) {
  TrainingOptions t = Training();
  t.recompute_units = "blocks.*";
  ExpectMatchesReference(RunMisuse(Misuse::kNone, "recompute", t));
  ExpectMatchesReference(RunMisuse(Misuse::kTwice, "recompute-twice", t));
}

TEST(TaskMisuseTest, DirectCallNamesTheUnit) {
  const Outcome o = RunMisuse(Misuse::kDirectCall, "direct");
  ExpectRefused(o.sharded, "most likely unit blocks.1");
  ExpectRefused(o.sharded, "used outside its forward");
  // Unsharded the call computes, but the forward never entered blocks.1 and
  // autograd reaches its parameters.
  ExpectRefused(o.reference,
                "step 0: unit blocks.1's parameters were used outside its "
                "forward");
}

TEST(TaskMisuseTest, WrongOrderNamesBothUnits) {
  const Outcome o = RunMisuse(Misuse::kWrongOrder, "order");
  ExpectRefused(o.sharded, "unit blocks.0 was entered after unit blocks.1");
  ExpectRefused(o.reference,
                "step 0: unit blocks.0 was entered after unit blocks.1");
}

TEST(TaskMisuseTest, SkippedUnitTrainsCorrectly) {
  ExpectMatchesReference(RunMisuse(Misuse::kSkipped, "skipped"));
}

// The data decides: on some ranks the unit runs, on others it is skipped; its
// parameters get the gradient of the ranks that ran it, averaged over all.
TEST(TaskMisuseTest, UnitSkippedOnSomeRanksTrainsCorrectly) {
  ExpectMatchesReference(
      RunMisuse(Misuse::kSkippedOnSomeRanks, "skipped-some"));
}

TEST(TaskMisuseTest, UnitEnteredTwiceTrainsCorrectly) {
  ExpectMatchesReference(RunMisuse(Misuse::kTwice, "twice"));
}

TEST(TaskMisuseTest, UnregisteredSubmoduleIsRefused) {
  const Outcome o = RunMisuse(Misuse::kUnregisteredModule, "module");
  ExpectRefused(o.sharded, "not a parameter registered under Task::Model()");
  ExpectRefused(o.reference, "not a parameter registered under Task::Model()");
}

TEST(TaskMisuseTest, UnregisteredTensorIsRefused) {
  const Outcome o = RunMisuse(Misuse::kUnregisteredTensor, "tensor");
  ExpectRefused(o.sharded, "a tensor of shape [6]");
  ExpectRefused(o.reference, "a tensor of shape [6]");
}

TEST(TaskMisuseTest, NonScalarLossIsRefused) {
  const Outcome o = RunMisuse(Misuse::kNonScalarLoss, "nonscalar");
  for (const absl::Status& s : {o.sharded, o.reference}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("a scalar"), std::string::npos) << s;
  }
}

TEST(TaskMisuseTest, NanAtAStepStopsNamingStepRankAndMicrobatch) {
  const Outcome o = RunMisuse(Misuse::kNanAtStep, "nan");
  const std::string line = absl::StrCat("step ", kNanStep,
                                        ": the loss is nan on rank 1, "
                                        "microbatch 0");
  for (const absl::Status& s : {o.sharded, o.reference}) {
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find(line), std::string::npos) << s;
    EXPECT_EQ(s.message().find('\n'), std::string::npos) << s;
  }
  // The steps before it were trained and reported; the NaN step never was.
  EXPECT_EQ(o.sharded_losses.size(), static_cast<size_t>(kNanStep));
  EXPECT_EQ(o.reference_losses.size(), static_cast<size_t>(kNanStep));
}

TEST(TaskMisuseTest, NondeterministicBatchIsRefused) {
  const Outcome o = RunMisuse(Misuse::kNondeterministicBatch, "batch");
  ExpectRefused(o.sharded, "pure function of the request");
  ExpectRefused(o.reference, "pure function of the request");
}

TEST(TaskMisuseTest, RecomputeGlobMatchingNoUnitIsRefused) {
  TrainingOptions t = Training();
  t.recompute_units = "layers.*";
  const Outcome o = RunMisuse(Misuse::kNone, "glob", t);
  for (const absl::Status& s : {o.sharded, o.reference}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("--recompute-units 'layers.*' matches none"),
              std::string::npos)
        << s;
    EXPECT_NE(s.message().find("blocks.0, blocks.1"), std::string::npos) << s;
  }
}

}  // namespace
}  // namespace hsdp::train
