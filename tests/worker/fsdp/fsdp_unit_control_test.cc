// Per-unit control outside the schedule:
//  - UnitHandle::Unshard / Reshard: an evaluation pass over the plain,
//    unwrapped modules between training steps, with every unit gathered by
//    hand (async), gives the single-process model's outputs, and training
//    afterwards is bitwise the same as without it;
//  - UnitOptions::unshard_in_backward = false on an embedding unit: one
//    all-gather less per microbatch, the same numbers bit for bit.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "hsdp/fully_shard.h"
#include "tests/worker/fsdp/fsdp_test_util.h"

namespace hsdp::fsdp::testing {
namespace {

constexpr int kSteps = 3;
constexpr int kGlobalBatch = 8;
constexpr double kTolerance = 2e-6;

struct EvalRun {
  std::vector<double> losses;           // rank 0
  std::vector<at::Tensor> eval_logits;  // rank 0, after each step
};

// TinyTransformer training on `shape`; after each step, with `evaluate`, every
// unit is gathered by hand and the plain model's forward (no unit entered)
// computes logits of a fixed evaluation batch.
EvalRun TrainWithEvaluation(comm::MeshShape shape, const StateDict& init,
                            bool evaluate) {
  EvalRun result;
  std::mutex mu;
  RunConfig config;
  RunOnMesh(shape, [&](RankContext& ctx) {
    TinyTransformer model = MakeModel(config.dims, init);
    std::unique_ptr<Engine> engine = MakeEngine(model, ctx.comms(), config);
    torch::optim::SGD sgd(engine->Parameters(), torch::optim::SGDOptions(0.5));
    const hsdp::v1::StepSchedule schedule = PlanSchedule(*engine, config);
    const int local = kGlobalBatch / shape.world_size();
    const auto eval_batch = Batch(config.dims, 100, 0, 2);
    for (int step = 0; step < kSteps; ++step) {
      ASSERT_TRUE(engine->Apply(schedule, 0).ok());
      auto [tokens, targets] =
          Batch(config.dims, step, ctx.rank * local, local);
      at::Tensor loss =
          Loss(EngineForward(*engine, model, tokens, false), targets);
      loss.backward();
      sgd.step();
      sgd.zero_grad();
      if (ctx.rank == 0) result.losses.push_back(loss.item<double>());
      if (!evaluate) continue;
      std::vector<UnshardHandle> pending;
      for (int u = 0; u < engine->num_units(); ++u) {
        absl::StatusOr<UnshardHandle> h =
            engine->Unit(u).Unshard(/*async_op=*/true);
        ASSERT_TRUE(h.ok()) << h.status();
        pending.push_back(*h);
      }
      for (UnshardHandle& h : pending) ASSERT_TRUE(h.Wait().ok());
      at::Tensor logits;
      {
        torch::NoGradGuard no_grad;
        logits = model->forward(eval_batch.first);
      }
      for (int u = 0; u < engine->num_units(); ++u)
        ASSERT_TRUE(engine->Unit(u).Reshard().ok());
      if (ctx.rank == 0) {
        std::lock_guard<std::mutex> lock(mu);
        result.eval_logits.push_back(logits.clone());
      }
    }
  });
  return result;
}

TEST(UnitControlTest, ManualUnshardServesAnEvaluationPassBetweenSteps) {
  at::set_num_threads(1);
  RunConfig config;
  const StateDict init = MakeInitialState(config.dims, 5);
  // The single-process model after each SGD step, on the same batches.
  TinyTransformer ref = MakeModel(config.dims, init);
  torch::optim::SGD sgd(ref->parameters(), torch::optim::SGDOptions(0.5));
  const auto eval_batch = Batch(config.dims, 100, 0, 2);
  std::vector<at::Tensor> want;
  for (int step = 0; step < kSteps; ++step) {
    auto [tokens, targets] = Batch(config.dims, step, 0, kGlobalBatch);
    Loss(ref->forward(tokens), targets).backward();
    sgd.step();
    sgd.zero_grad();
    torch::NoGradGuard no_grad;
    want.push_back(ref->forward(eval_batch.first));
  }
  for (comm::MeshShape shape :
       {comm::MeshShape{1, 2}, comm::MeshShape{2, 2}, comm::MeshShape{1, 4}}) {
    SCOPED_TRACE(absl::StrCat(shape.replicate, "x", shape.shard));
    const EvalRun with = TrainWithEvaluation(shape, init, true);
    const EvalRun without = TrainWithEvaluation(shape, init, false);
    ASSERT_EQ(with.eval_logits.size(), static_cast<size_t>(kSteps));
    for (int step = 0; step < kSteps; ++step) {
      EXPECT_LT(
          (with.eval_logits[step] - want[step]).abs().max().item<double>(),
          kTolerance)
          << "step " << step;
    }
    EXPECT_EQ(with.losses, without.losses);  // bitwise
  }
}

TEST(UnitControlTest, UnshardOutsideAForwardDuringBackwardIsRefused) {
  at::set_num_threads(1);
  RunConfig config;
  const StateDict init = MakeInitialState(config.dims, 5);
  RunOnMesh({1, 2}, [&](RankContext& ctx) {
    TinyTransformer model = MakeModel(config.dims, init);
    std::unique_ptr<Engine> engine = MakeEngine(model, ctx.comms(), config);
    ASSERT_TRUE(engine->Apply(PlanSchedule(*engine, config), 0).ok());
    auto [tokens, targets] = Batch(config.dims, 0, ctx.rank * 2, 2);
    at::Tensor loss =
        Loss(EngineForward(*engine, model, tokens, false), targets);
    absl::Status inside;
    // A hook on a block parameter's gradient runs inside backward.
    model->blocks[0]->parameters()[0].register_hook([&](const at::Tensor& g) {
      inside = engine->Unit(1).Unshard().status();
      return g;
    });
    loss.backward();
    EXPECT_EQ(inside.code(), absl::StatusCode::kFailedPrecondition) << inside;
    EXPECT_NE(inside.message().find("layers.0"), std::string::npos) << inside;
  });
}

// An embedding as its own unit, then a projection unit, then the root's head.
class EmbedNetImpl : public torch::nn::Module {
 public:
  EmbedNetImpl() {
    embed = register_module("embed", torch::nn::Embedding(11, 6));
    proj = register_module("proj", torch::nn::Linear(6, 6));
    head = register_module("head", torch::nn::Linear(6, 11));
  }
  torch::nn::Embedding embed{nullptr};
  torch::nn::Linear proj{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(EmbedNet);

struct EmbedRun {
  std::vector<double> losses;
  StateDict params;
  int64_t embed_gathers = 0;
};

EmbedRun TrainEmbedNet(comm::MeshShape shape, const StateDict& init,
                       bool unshard_in_backward, int microbatches) {
  EmbedRun result;
  std::mutex mu;
  RunOnMesh(shape, [&](RankContext& ctx) {
    EmbedNet model;
    {
      torch::NoGradGuard no_grad;
      for (auto& item : model->named_parameters())
        item.value().copy_(init.at(item.key()));
    }
    auto created = Engine::Create(model.ptr(), ctx.comms(), EngineOptions());
    ASSERT_TRUE(created.ok());
    std::unique_ptr<Engine> engine = std::move(*created);
    UnitOptions embed_options;
    embed_options.reshard_after_forward = true;
    embed_options.unshard_in_backward = unshard_in_backward;
    ASSERT_TRUE(
        engine->FullyShard({model->embed.ptr()}, "embed", embed_options).ok());
    ASSERT_TRUE(engine->FullyShard({model->proj.ptr()}, "proj").ok());
    ASSERT_TRUE(engine->FullyShardRoot().ok());
    torch::optim::SGD sgd(engine->Parameters(), torch::optim::SGDOptions(0.5));
    RunConfig config;
    config.microbatches = microbatches;
    const hsdp::v1::StepSchedule schedule = PlanSchedule(*engine, config);
    const int local = kGlobalBatch / shape.world_size();
    const int per_mb = local / microbatches;
    ModelDims dims;
    for (int step = 0; step < kSteps; ++step) {
      double step_loss = 0;
      for (int mb = 0; mb < microbatches; ++mb) {
        ASSERT_TRUE(engine->Apply(schedule, mb).ok());
        auto [tokens, targets] =
            Batch(dims, step, ctx.rank * local + mb * per_mb, per_mb);
        at::Tensor loss =
            engine->Root().Forward(tokens, [&](const at::Tensor& t) {
              at::Tensor h = engine->Unit(1).Forward(
                  t, [&](const at::Tensor& x) { return model->embed(x); });
              h = engine->Unit(2).Forward(h, [&](const at::Tensor& x) {
                return torch::tanh(model->proj(x));
              });
              return Loss(model->head(h), targets) / microbatches;
            });
        loss.backward();
        step_loss += loss.item<double>();
      }
      sgd.step();
      sgd.zero_grad();
      if (ctx.rank == 0) result.losses.push_back(step_loss);
    }
    absl::StatusOr<StateDict> full = FullStateDict(*engine);
    ASSERT_TRUE(full.ok());
    std::lock_guard<std::mutex> lock(mu);
    if (ctx.rank == 0) {
      result.params = *full;
      result.embed_gathers = engine->Stats().units[1].all_gathers;
    }
  });
  return result;
}

TEST(UnitControlTest, EmbeddingWithoutBackwardGatherKeepsTheNumbers) {
  at::set_num_threads(1);
  EmbedNet init_model;
  StateDict init;
  for (const auto& item : init_model->named_parameters())
    init[item.key()] = item.value().detach().clone();
  for (int microbatches : {1, 2}) {
    for (comm::MeshShape shape :
         {comm::MeshShape{1, 2}, comm::MeshShape{2, 2}}) {
      SCOPED_TRACE(absl::StrCat(shape.replicate, "x", shape.shard, " micro ",
                                microbatches));
      const EmbedRun gathered = TrainEmbedNet(shape, init, true, microbatches);
      const EmbedRun skipped = TrainEmbedNet(shape, init, false, microbatches);
      EXPECT_EQ(gathered.losses, skipped.losses);  // bitwise
      EXPECT_TRUE(BitwiseEqual(gathered.params, skipped.params));
      // Forward and backward gathers, then only the forward ones.
      EXPECT_EQ(gathered.embed_gathers, 2 * kSteps * microbatches);
      EXPECT_EQ(skipped.embed_gathers, kSteps * microbatches);
    }
  }
}

}  // namespace
}  // namespace hsdp::fsdp::testing
