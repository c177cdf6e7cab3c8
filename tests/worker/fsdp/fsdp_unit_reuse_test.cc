// A unit entered several times in one forward (one block's weights used at
// several depths, as in ALBERT or Universal Transformers): its gradients are
// summed over the calls and reduced once, and it is gathered again only where
// it was resharded in between; the SGD gradients equal single-process
// training's, with and without activation recompute.
#include <torch/torch.h>

#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/worker/fsdp/fsdp_test_util.h"
#include "tests/worker/fsdp/placed_model.h"

namespace hsdp::fsdp::testing {
namespace {

constexpr int kSteps = 3;
constexpr int kGlobalBatch = 8;
constexpr double kLr = 0.3;
constexpr double kTolerance = 2e-6;
// Block 0 three times, then block 1.
const std::vector<int> kOrder = {0, 0, 0, 1};

struct ReuseRun {
  std::vector<StateDict> grads;  // per step, full gradients (rank 0)
  StateDict params;
  EngineStats stats;  // rank 0, the last step
};

ReuseRun Reference(const StateDict& init) {
  ReuseRun run;
  PlacedModel model = MakePlacedModel(init);
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(kLr));
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = PlacedBatch(step, 0, kGlobalBatch);
    at::Tensor h = x;
    for (int b : kOrder) h = model->blocks->ptr<PlacedBlockImpl>(b)->forward(h);
    PlacedLoss(model->head(h), y).backward();
    StateDict grads;
    // A step without a rare sample leaves the rare parameters without a
    // gradient: zeros here, as in the sharded run's gather below.
    for (const auto& item : model->named_parameters()) {
      const at::Tensor& g = item.value().grad();
      grads[item.key()] =
          g.defined() ? g.detach().clone() : torch::zeros_like(item.value());
    }
    run.grads.push_back(grads);
    sgd.step();
    sgd.zero_grad();
  }
  for (const auto& item : model->named_parameters())
    run.params[item.key()] = item.value().detach().clone();
  return run;
}

ReuseRun Sharded(const StateDict& init, bool reshard_after_forward,
                 bool recompute) {
  ReuseRun run;
  std::mutex mu;
  RunOnMesh({1, 2}, [&](RankContext& ctx) {
    PlacedModel model = MakePlacedModel(init);
    std::unique_ptr<Engine> engine =
        ShardPlacedModel(model, ctx.comms(), TestPlacement());
    torch::optim::SGD sgd(engine->Parameters(), torch::optim::SGDOptions(kLr));
    RunConfig config;
    config.reshard_after_forward = reshard_after_forward;
    const hsdp::v1::StepSchedule schedule = PlanSchedule(*engine, config);
    const int local = kGlobalBatch / 2;
    for (int step = 0; step < kSteps; ++step) {
      engine->ResetStats();
      ASSERT_TRUE(engine->Apply(schedule, 0).ok());
      auto [x, y] = PlacedBatch(step, ctx.rank * local, local);
      // Recompute reruns a call in backward only where its input requires
      // grad (fully_shard.h), the first block's input included.
      if (recompute) x.requires_grad_(true);
      at::Tensor loss = engine->Root().Forward(x, [&](const at::Tensor& in) {
        at::Tensor h = in;
        for (int b : kOrder) {
          std::shared_ptr<PlacedBlockImpl> block =
              model->blocks->ptr<PlacedBlockImpl>(b);
          UnitHandle* unit = &engine->Unit(b + 1);
          const TensorFn enter = [unit, block](const at::Tensor& t) {
            return unit->Forward(
                t, [block](const at::Tensor& u) { return block->forward(u); });
          };
          h = recompute ? Recompute(*engine, enter, h) : enter(h);
        }
        return PlacedLoss(model->head(h), y);
      });
      loss.backward();
      ASSERT_TRUE(engine->status().ok()) << engine->status();
      if (ctx.rank == 0) {
        std::lock_guard<std::mutex> lock(mu);
        run.stats = engine->Stats();
      }
      // The full gradients: gathered as if they were the parameters.
      std::vector<at::Tensor> saved;
      for (const at::Tensor& p : engine->Parameters()) {
        saved.push_back(p.detach().clone());
        torch::NoGradGuard no_grad;
        if (p.grad().defined()) {
          p.copy_(p.grad());
        } else {
          p.zero_();
        }
      }
      absl::StatusOr<StateDict> full = FullStateDict(*engine);
      ASSERT_TRUE(full.ok()) << full.status();
      {
        torch::NoGradGuard no_grad;
        std::vector<at::Tensor> params = engine->Parameters();
        for (size_t i = 0; i < params.size(); ++i) params[i].copy_(saved[i]);
      }
      if (ctx.rank == 0) run.grads.push_back(*full);
      sgd.step();
      sgd.zero_grad();
    }
    absl::StatusOr<StateDict> full = FullStateDict(*engine);
    ASSERT_TRUE(full.ok()) << full.status();
    if (ctx.rank == 0) run.params = *full;
  });
  return run;
}

struct ReuseCase {
  bool reshard_after_forward;
  bool recompute;
  // Block 0's all-gathers per step: three forward calls and its backward.
  int64_t block0_gathers;
};

class UnitReuseTest : public ::testing::TestWithParam<ReuseCase> {};

TEST_P(UnitReuseTest, GradientsSumOverCallsAndReduceOnce) {
  at::set_num_threads(1);
  const ReuseCase c = GetParam();
  const StateDict init = PlacedInit();
  const ReuseRun want = Reference(init);
  const ReuseRun got = Sharded(init, c.reshard_after_forward, c.recompute);
  ASSERT_EQ(got.grads.size(), want.grads.size());
  for (int step = 0; step < kSteps; ++step) {
    SCOPED_TRACE(absl::StrCat("step ", step));
    EXPECT_LT(MaxAbsDiff(got.grads[step], want.grads[step]), kTolerance);
  }
  EXPECT_LT(MaxAbsDiff(got.params, want.params), kTolerance);
  ASSERT_EQ(got.stats.units.size(), 3u);
  EXPECT_EQ(got.stats.units[1].reduce_scatters, 1);
  EXPECT_EQ(got.stats.units[1].all_gathers, c.block0_gathers);
  EXPECT_EQ(got.stats.units[2].reduce_scatters, 1);
}

// Kept after forward: one gather for all three calls and the backward.
// Resharded after each call: three in forward, one for the backward (which
// keeps it until its last call's gradients are in). With recompute, each
// call's recompute gathers again where it finds the unit resharded.
INSTANTIATE_TEST_SUITE_P(
    Policies, UnitReuseTest,
    ::testing::Values(ReuseCase{false, false, 1}, ReuseCase{true, false, 4},
                      ReuseCase{false, true, 1}, ReuseCase{true, true, 4}),
    [](const auto& info) {
      return absl::StrCat(info.param.reshard_after_forward ? "Reshard" : "Keep",
                          info.param.recompute ? "Recompute" : "");
    });

}  // namespace
}  // namespace hsdp::fsdp::testing
