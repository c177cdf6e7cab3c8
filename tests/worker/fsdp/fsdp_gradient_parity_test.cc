// Gradient scale: sharded training with plain SGD against single-process
// training on the same global batch, comparing the gradients of every step as
// well as the parameters. AdamW's update does not change when a gradient is
// multiplied by a constant, so the AdamW parity tests cannot see a missing
// 1/microbatches or a replicate all-reduce that sums instead of averaging;
// plain SGD's update is the gradient itself.
#include <torch/torch.h>

#include <algorithm>
#include <iostream>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/worker/fsdp/fsdp_test_util.h"

namespace hsdp::fsdp::testing {
namespace {

constexpr int kSteps = 3;
constexpr int kGlobalBatch = 12;  // divides every dp size x microbatches here
constexpr double kLr = 0.5;
constexpr double kTolerance = 2e-6;

using Grads = std::vector<StateDict>;  // per step, full gradients by name

at::Tensor Loss(const at::Tensor& logits, const at::Tensor& targets) {
  return torch::nn::functional::cross_entropy(
      logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
}

struct Sharded {
  Grads grads;  // assembled from every rank's shard rows
  StateDict params;
  bool replicas_agree = true;
};

// Writes this rank's gradient rows into the full tensors of `out`, or checks
// them against rows another replica wrote first.
void PutRows(Engine& engine, StateDict& out, bool& agree, std::mutex& mu) {
  std::map<std::string, ShardedTensor> layout = ShardedStateDict(engine);
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& [name, shard] : engine.NamedParameters()) {
    const ShardedTensor& st = layout.at(name);
    if (!out.count(name)) {
      out[name] = torch::full(st.global_shape, std::nan(""));
    }
    const int64_t rows = shard.size(0);
    if (rows == 0) continue;
    at::Tensor target = out[name].narrow(0, st.row_offset, rows);
    const at::Tensor grad = shard.grad().defined()
                                ? shard.grad().detach().to(torch::kFloat)
                                : torch::zeros_like(shard);
    if (torch::isnan(target).any().item<bool>()) {
      target.copy_(grad);
    } else if (!torch::equal(target, grad)) {
      agree = false;
    }
  }
}

// `base`: mixed precision and the microbatches' sync mode.
Sharded TrainSgdSharded(comm::MeshShape shape, int microbatches,
                        const StateDict& init, const ModelDims& dims,
                        const GradientReduction& reduction = {},
                        const RunConfig& base = {}) {
  Sharded result;
  result.grads.resize(kSteps);
  std::mutex mu;
  RunConfig config = base;
  config.dims = dims;
  config.microbatches = microbatches;
  config.gradient_reduction = reduction;
  RunOnMesh(shape, [&](RankContext& ctx) {
    TinyTransformer model = MakeModel(dims, init);
    std::unique_ptr<Engine> engine = MakeEngine(model, ctx.comms(), config);
    torch::optim::SGD sgd(engine->Parameters(), torch::optim::SGDOptions(kLr));
    const hsdp::v1::StepSchedule schedule =
        MakeSchedule(engine->num_units(), config);
    const int dp_size = shape.world_size();
    const int local = kGlobalBatch / dp_size;
    const int per_mb = local / microbatches;
    for (int step = 0; step < kSteps; ++step) {
      for (int mb = 0; mb < microbatches; ++mb) {
        ASSERT_TRUE(engine->Apply(schedule, mb).ok());
        auto [tokens, targets] =
            Batch(dims, step, ctx.rank * local + mb * per_mb, per_mb);
        at::Tensor loss =
            Loss(EngineForward(*engine, model, tokens, false), targets) /
            microbatches;
        loss.backward();
      }
      PutRows(*engine, result.grads[step], result.replicas_agree, mu);
      sgd.step();
      sgd.zero_grad();
    }
    absl::StatusOr<StateDict> full = FullStateDict(*engine);
    ASSERT_TRUE(full.ok()) << full.status();
    if (ctx.rank == 0) result.params = *full;
  });
  return result;
}

struct Reference {
  Grads grads;
  StateDict params;
};

// `grad_scale`: what the sharded run's reduction multiplies the
// single-process gradient by (the reference's gradients are scaled to match,
// and its learning rate divided, so both take the same steps).
Reference TrainSgdReference(const StateDict& init, const ModelDims& dims,
                            double grad_scale = 1) {
  Reference result;
  TinyTransformer model = MakeModel(dims, init);
  torch::optim::SGD sgd(model->parameters(),
                        torch::optim::SGDOptions(kLr * grad_scale));
  for (int step = 0; step < kSteps; ++step) {
    auto [tokens, targets] = Batch(dims, step, 0, kGlobalBatch);
    Loss(model->forward(tokens), targets).backward();
    StateDict grads;
    for (const auto& item : model->named_parameters())
      grads[item.key()] = item.value().grad().detach() * grad_scale;
    result.grads.push_back(std::move(grads));
    sgd.step();
    sgd.zero_grad();
  }
  for (const auto& item : model->named_parameters())
    result.params[item.key()] = item.value().detach().clone();
  return result;
}

class GradientParityTest
    : public ::testing::TestWithParam<std::tuple<int, int, int>> {};

TEST_P(GradientParityTest, SgdGradientsAndParametersMatchSingleProcess) {
  at::set_num_threads(1);
  const auto [replicate, shard, microbatches] = GetParam();
  ModelDims dims;
  const StateDict init = MakeInitialState(dims, 3);
  const Reference ref = TrainSgdReference(init, dims);
  const Sharded got =
      TrainSgdSharded({replicate, shard}, microbatches, init, dims);
  EXPECT_TRUE(got.replicas_agree)
      << "replicas of one shard index hold different gradients";
  ASSERT_EQ(got.grads.size(), ref.grads.size());
  for (int step = 0; step < kSteps; ++step) {
    const double diff = MaxAbsDiff(got.grads[step], ref.grads[step]);
    EXPECT_LT(diff, kTolerance) << "gradients of step " << step;
    // The gradients are not all tiny: a wrong scale would show.
    double largest = 0;
    for (const auto& [name, g] : ref.grads[step])
      largest = std::max(largest, g.abs().max().item<double>());
    EXPECT_GT(largest, 100 * kTolerance);
  }
  EXPECT_LT(MaxAbsDiff(got.params, ref.params), kTolerance);
}

// GradientReduction: kSum gives the sum over ranks (world × the average),
// a divide factor the sum over that factor. Gradients (not only the update)
// are compared, each against the single-process gradient times the scale.
class GradientReductionTest
    : public ::testing::TestWithParam<std::tuple<int, int, int>> {};

TEST_P(GradientReductionTest, SumAndDivideFactorScaleTheGradient) {
  at::set_num_threads(1);
  const auto [replicate, shard, microbatches] = GetParam();
  const int world = replicate * shard;
  ModelDims dims;
  const StateDict init = MakeInitialState(dims, 3);
  GradientReduction sum;
  sum.op = comm::ReduceOp::kSum;
  GradientReduction divided;
  divided.divide_factor = 3.0;
  // The microbatch losses are divided by their count either way: a sum over
  // ranks is world × the global batch's mean gradient.
  const std::vector<std::pair<GradientReduction, double>> cases = {
      {sum, static_cast<double>(world)}, {divided, world / 3.0}};
  for (const auto& [reduction, scale] : cases) {
    SCOPED_TRACE(absl::StrCat("scale ", scale));
    const Reference ref = TrainSgdReference(init, dims, scale);
    const Sharded got = TrainSgdSharded({replicate, shard}, microbatches, init,
                                        dims, reduction);
    EXPECT_TRUE(got.replicas_agree);
    for (int step = 0; step < kSteps; ++step) {
      EXPECT_LT(MaxAbsDiff(got.grads[step], ref.grads[step]),
                kTolerance * scale)
          << "gradients of step " << step;
    }
    EXPECT_LT(MaxAbsDiff(got.params, ref.params), kTolerance * scale);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Meshes, GradientReductionTest,
    ::testing::Values(std::make_tuple(1, 1, 1), std::make_tuple(1, 2, 1),
                      std::make_tuple(2, 1, 3), std::make_tuple(2, 2, 3)),
    [](const auto& info) {
      return absl::StrCat(std::get<0>(info.param), "x", std::get<1>(info.param),
                          "_micro", std::get<2>(info.param));
    });

// max |a - b| / max |b| over the gradients of one step.
double RelativeDiff(const StateDict& a, const StateDict& b) {
  double scale = 0;
  for (const auto& [name, t] : b) {
    scale = std::max(scale, t.abs().max().item<double>());
  }
  return MaxAbsDiff(a, b) / scale;
}

// bf16 compute, gradients synchronised only at the last of 6 microbatches.
// With fp32 main gradients, the 6 bf16 gradients accumulate in fp32 before
// the one reduction: the step's gradient equals, within fp32 rounding, the
// run that reduces every microbatch (in fp32) and accumulates the reduced
// shards in fp32. Accumulated in bf16 instead, it is off by bf16 rounding.
TEST(MainGradTest, Fp32MainGradsKeepUnsyncedMicrobatchesAtFp32Precision) {
  constexpr int kMicrobatches = 6;
  const ModelDims dims;
  const StateDict init = MakeInitialState(dims, 31);
  RunConfig bf16;
  bf16.mixed_precision.param_dtype = torch::kBFloat16;
  bf16.mixed_precision.reduce_dtype = torch::kFloat;
  bf16.mixed_precision.output_dtype = torch::kFloat;
  RunConfig every = bf16;  // reduces each microbatch
  RunConfig last_only = bf16;
  last_only.sync_every_microbatch = false;
  RunConfig main_grads = last_only;
  main_grads.mixed_precision.grad_accumulation_dtype = torch::kFloat;
  const comm::MeshShape mesh{1, 2};
  const Sharded synced = TrainSgdSharded(mesh, kMicrobatches, init, dims,
                                         GradientReduction(), every);
  const Sharded fp32 = TrainSgdSharded(mesh, kMicrobatches, init, dims,
                                       GradientReduction(), main_grads);
  const Sharded in_bf16 = TrainSgdSharded(mesh, kMicrobatches, init, dims,
                                          GradientReduction(), last_only);
  // Step 0: the same parameters, so the same bf16 gradients per microbatch.
  const double fp32_error = RelativeDiff(fp32.grads[0], synced.grads[0]);
  const double bf16_error = RelativeDiff(in_bf16.grads[0], synced.grads[0]);
  std::cout << "step 0 gradient vs reducing every microbatch: fp32 main grads "
            << fp32_error << ", bf16 accumulation " << bf16_error
            << " (max |diff| / max |grad|)\n";
  EXPECT_LE(fp32_error, 1e-5);
  EXPECT_GE(bf16_error, 1e-4);  // bf16's 8-bit mantissa: ~4e-3 per add
  EXPECT_GT(bf16_error, 10 * fp32_error);
}

TEST(MainGradTest, NonFloatingAccumulationDtypeIsRefused) {
  torch::nn::Linear model(2, 2);
  EngineOptions options;
  options.mixed_precision.grad_accumulation_dtype = torch::kInt;
  RunOnMesh({1, 1}, [&](RankContext& ctx) {
    absl::StatusOr<std::unique_ptr<Engine>> engine =
        Engine::Create(model.ptr(), ctx.comms(), options);
    ASSERT_FALSE(engine.ok());
    EXPECT_EQ(engine.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(engine.status().message().find("grad_accumulation_dtype"),
              std::string::npos)
        << engine.status();
  });
}

TEST(GradientReductionOptionsTest, NonPositiveDivideFactorIsRefused) {
  torch::nn::Linear model(2, 2);
  GradientReduction reduction;
  reduction.divide_factor = 0.0;
  EngineOptions options;
  options.gradient_reduction = reduction;
  RunOnMesh({1, 1}, [&](RankContext& ctx) {
    absl::StatusOr<std::unique_ptr<Engine>> engine =
        Engine::Create(model.ptr(), ctx.comms(), options);
    ASSERT_FALSE(engine.ok());
    EXPECT_EQ(engine.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(engine.status().message().find("divide_factor"),
              std::string::npos)
        << engine.status();
  });
}

INSTANTIATE_TEST_SUITE_P(
    Meshes, GradientParityTest,
    ::testing::Values(std::make_tuple(1, 2, 1), std::make_tuple(1, 2, 3),
                      std::make_tuple(2, 1, 1), std::make_tuple(2, 1, 3),
                      std::make_tuple(2, 2, 1), std::make_tuple(2, 2, 3)),
    [](const auto& info) {
      return absl::StrCat(std::get<0>(info.param), "x", std::get<1>(info.param),
                          "_micro", std::get<2>(info.param));
    });

}  // namespace
}  // namespace hsdp::fsdp::testing
