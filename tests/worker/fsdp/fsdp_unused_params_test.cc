// Parameters and units that get no gradient on some ranks: a mixture of
// experts whose router (the token id) leaves experts empty on some ranks, in
// the four shapes a model can take:
//  - experts inside one unit per layer (some of the unit's parameters get no
//    gradient on some ranks);
//  - one unit per expert, entered only where it has tokens (a unit some ranks
//    skip in forward);
//  - one unit per expert, always entered but its output used only where it
//    has tokens (a unit some ranks never reach in backward);
//  - one block unit called three times per forward (weight reuse).
// Every rank must run the same collectives (no hang) and every parameter must
// get the gradient single-process training gives it, with plain SGD so a wrong
// scale or a dropped contribution shows. Expert 8 is never routed to: its
// gradient stays undefined, as in single-process training.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "hsdp/fully_shard.h"
#include "tests/worker/fsdp/fsdp_test_util.h"
#include "tests/worker/fsdp/recording_communicator.h"

namespace hsdp::fsdp::testing {
namespace {

constexpr int64_t kVocab = 16;
constexpr int64_t kDim = 6;  // 6 rows: uneven over 4 shards
constexpr int64_t kExperts = 9;
constexpr int64_t kRoutedExperts = 8;  // expert 8 never gets a token
constexpr int64_t kLayers = 2;
constexpr int64_t kSeq = 4;
constexpr int kGlobalBatch = 8;
constexpr int kSteps = 3;
constexpr int kSharedCalls = 3;
constexpr double kLr = 0.5;
constexpr double kTolerance = 2e-6;
// No step comes anywhere near the collective timeout (a hang would).
constexpr double kMaxStepSeconds = 5;
// Comm fusion buckets: two experts' bytes, and every unit in one group.
constexpr int64_t kPairs = 2 * (kDim * kDim + kDim) * 4;
constexpr int64_t kAll = int64_t{1} << 30;

enum class Shape { kExpertsInUnit, kExpertUnits, kUnreachedUnits, kShared };

std::string ShapeName(Shape shape) {
  switch (shape) {
    case Shape::kExpertsInUnit:
      return "ExpertsInUnit";
    case Shape::kExpertUnits:
      return "ExpertUnits";
    case Shape::kUnreachedUnits:
      return "UnreachedUnits";
    case Shape::kShared:
      return "SharedBlock";
  }
  return "";
}

class MoeImpl : public torch::nn::Module {
 public:
  MoeImpl() {
    embed = register_module("embed", torch::nn::Embedding(kVocab, kDim));
    for (int64_t l = 0; l < kLayers; ++l) {
      torch::nn::ModuleList experts;
      for (int64_t e = 0; e < kExperts; ++e)
        experts->push_back(torch::nn::Linear(kDim, kDim));
      layers.push_back(register_module(absl::StrCat("layers_", l), experts));
    }
    shared = register_module("shared", torch::nn::Linear(kDim, kDim));
    head = register_module("head", torch::nn::Linear(kDim, kVocab));
  }
  torch::nn::Linear Expert(int64_t layer, int64_t e) {
    return layers[layer]->ptr<torch::nn::LinearImpl>(e);
  }

  torch::nn::Embedding embed{nullptr};
  std::vector<torch::nn::ModuleList> layers;
  torch::nn::Linear shared{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Moe);

// Enters unit `unit` (or, for the reference, just runs fn).
using Runner =
    std::function<at::Tensor(int unit, const at::Tensor& x, const TensorFn&)>;

// Unit indices: root 0; then per shape the layers, the experts in forward
// order, or the shared block.
int ExpertUnit(int64_t layer, int64_t e) {
  return 1 + static_cast<int>(layer * kExperts + e);
}

at::Tensor Forward(Moe& model, Shape shape, const at::Tensor& tokens,
                   const Runner& run) {
  const at::Tensor flat_tokens = tokens.reshape({-1});
  at::Tensor h = model->embed->forward(flat_tokens);
  const at::Tensor route = flat_tokens.remainder(kRoutedExperts);
  if (shape == Shape::kShared) {
    std::shared_ptr<torch::nn::LinearImpl> block = model->shared.ptr();
    for (int i = 0; i < kSharedCalls; ++i) {
      h = run(1, h, [block](const at::Tensor& x) {
        return torch::tanh(block->forward(x));
      });
    }
    return model->head(h);
  }
  for (int64_t l = 0; l < kLayers; ++l) {
    auto layer_fn = [&model, &route, shape, l,
                     &run](const at::Tensor& x) -> at::Tensor {
      at::Tensor y = torch::zeros_like(x);
      for (int64_t e = 0; e < kExperts; ++e) {
        const at::Tensor idx = (route == e).nonzero().reshape({-1});
        std::shared_ptr<torch::nn::LinearImpl> expert =
            model->Expert(l, e).ptr();
        auto expert_fn = [expert](const at::Tensor& in) {
          return expert->forward(in);
        };
        if (shape == Shape::kExpertsInUnit) {
          if (idx.numel() > 0)
            y = y.index_add(0, idx, expert_fn(x.index_select(0, idx)));
        } else if (shape == Shape::kExpertUnits) {
          if (idx.numel() > 0) {
            y = y.index_add(
                0, idx,
                run(ExpertUnit(l, e), x.index_select(0, idx), expert_fn));
          }
        } else {  // kUnreachedUnits: entered always, used where routed to
          at::Tensor out = run(ExpertUnit(l, e), x, expert_fn);
          if (idx.numel() > 0)
            y = y.index_add(0, idx, out.index_select(0, idx));
        }
      }
      return x + torch::tanh(y);
    };
    h = shape == Shape::kExpertsInUnit
            ? run(1 + static_cast<int>(l), h, layer_fn)
            : layer_fn(h);
  }
  return model->head(h);
}

// Sample s of step `step` routes all its tokens to the experts of one pair,
// (s / 2 + step) % 4: on 2 ranks each sees two pairs, on 4 ranks one.
std::pair<at::Tensor, at::Tensor> MoeBatch(int step, int begin, int count) {
  at::Tensor tokens = torch::empty({count, kSeq}, torch::kLong);
  at::Tensor targets = torch::empty({count, kSeq}, torch::kLong);
  auto tok = tokens.accessor<int64_t, 2>();
  auto tgt = targets.accessor<int64_t, 2>();
  for (int b = 0; b < count; ++b) {
    const int64_t sample = begin + b;
    const int64_t pair = (sample / 2 + step) % 4;
    for (int64_t t = 0; t < kSeq; ++t) {
      tok[b][t] = 2 * pair + t % 2 + 8 * ((t / 2 + sample) % 2);
      tgt[b][t] = (tok[b][t] * 3 + 1 + sample) % kVocab;
    }
  }
  return {tokens, targets};
}

at::Tensor MoeLoss(const at::Tensor& logits, const at::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits, targets.reshape({-1}));
}

struct Result {
  std::vector<StepGrads> grads;
  StateDict params;
  bool ranks_agree = true;
  double slowest_step_seconds = 0;
};

// The initial weights, drawn once on the calling thread (ranks are threads:
// they copy these rather than share torch's global generator).
StateDict MoeInit() {
  torch::manual_seed(11);
  Moe model;
  StateDict init;
  for (const auto& item : model->named_parameters())
    init[item.key()] = item.value().detach().clone();
  return init;
}

Moe MakeMoe(const StateDict& init) {
  Moe model;
  torch::NoGradGuard no_grad;
  for (auto& item : model->named_parameters())
    item.value().copy_(init.at(item.key()));
  return model;
}

Result TrainReference(Shape shape, const StateDict& init) {
  Result result;
  Moe model = MakeMoe(init);
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(kLr));
  const Runner direct = [](int, const at::Tensor& x, const TensorFn& fn) {
    return fn(x);
  };
  for (int step = 0; step < kSteps; ++step) {
    auto [tokens, targets] = MoeBatch(step, 0, kGlobalBatch);
    MoeLoss(Forward(model, shape, tokens, direct), targets).backward();
    result.grads.push_back(CloneGrads(*model));
    sgd.step();
    sgd.zero_grad();
  }
  result.params = CloneParams(*model);
  return result;
}

std::unique_ptr<Engine> ShardMoe(Moe& model, Shape shape, MeshComms comms) {
  absl::StatusOr<std::unique_ptr<Engine>> engine =
      Engine::Create(model.ptr(), comms, EngineOptions());
  EXPECT_TRUE(engine.ok()) << engine.status();
  for (int64_t l = 0; l < kLayers; ++l) {
    if (shape == Shape::kExpertsInUnit) {
      EXPECT_TRUE(
          (*engine)
              ->FullyShard({model->layers[l].ptr()}, absl::StrCat("layers.", l))
              .ok());
    } else if (shape != Shape::kShared) {
      for (int64_t e = 0; e < kExperts; ++e) {
        EXPECT_TRUE((*engine)
                        ->FullyShard({model->Expert(l, e).ptr()},
                                     absl::StrCat("layers.", l, ".expert.", e))
                        .ok());
      }
    }
  }
  if (shape == Shape::kShared) {
    EXPECT_TRUE((*engine)->FullyShard({model->shared.ptr()}, "shared").ok());
  }
  EXPECT_TRUE((*engine)->FullyShardRoot().ok());
  return std::move(*engine);
}

// This rank's gradient rows into the full tensors of `out`; a row another rank
// wrote already must agree, and so must whether the gradient is defined.
void PutGradRows(Engine& engine, StepGrads& out,
                 std::map<std::string, int>& defined, bool& agree,
                 std::mutex& mu) {
  const std::map<std::string, ShardedTensor> layout = ShardedStateDict(engine);
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& [name, shard] : engine.NamedParameters()) {
    const ShardedTensor& st = layout.at(name);
    const int has = shard.grad().defined() ? 1 : 0;
    auto [it, fresh] = defined.emplace(name, has);
    if (!fresh && it->second != has) agree = false;
    if (!has) continue;
    if (!out[name].defined())
      out[name] = torch::full(st.global_shape, std::nan(""));
    const int64_t rows = shard.size(0);
    if (rows == 0) continue;
    at::Tensor target = out[name].narrow(0, st.row_offset, rows);
    const at::Tensor grad = shard.grad().detach();
    if (torch::isnan(target).any().item<bool>()) {
      target.copy_(grad);
    } else if (!torch::equal(target, grad)) {
      agree = false;
    }
  }
}

struct Variant {
  int microbatches = 1;
  int prefetch = 0;
  bool flat = false;  // the flat path (NCCL's) instead of segments
  // Non-last microbatches: reduce-scatter, all-reduce (HSDP) or neither.
  bool sync_every_microbatch = true;
  bool all_reduce_every_microbatch = true;
  // Policy.comm_fusion_bucket_bytes (0: none).
  int64_t fusion_bucket = 0;
};

Result TrainSharded(Shape shape, comm::MeshShape mesh, const StateDict& init,
                    const Variant& v) {
  Result result;
  result.grads.resize(kSteps);
  std::vector<std::map<std::string, int>> defined(kSteps);
  std::mutex mu;
  RunOnMesh(mesh, [&](RankContext& ctx) {
    Moe model = MakeMoe(init);
    FlatOnlyCommunicator flat_shard(&ctx.mesh->shard());
    FlatOnlyCommunicator flat_replicate(&ctx.mesh->replicate());
    const MeshComms comms =
        v.flat ? MeshComms{&flat_shard, &flat_replicate} : ctx.comms();
    std::unique_ptr<Engine> engine = ShardMoe(model, shape, comms);
    torch::optim::SGD sgd(engine->Parameters(), torch::optim::SGDOptions(kLr));
    RunConfig config;
    config.microbatches = v.microbatches;
    config.prefetch = v.prefetch;
    config.sync_every_microbatch = v.sync_every_microbatch;
    config.all_reduce_every_microbatch = v.all_reduce_every_microbatch;
    config.comm_fusion_bucket_bytes = v.fusion_bucket;
    const hsdp::v1::StepSchedule schedule = PlanSchedule(*engine, config);
    if (v.fusion_bucket == kAll) {
      EXPECT_EQ(schedule.fusion_groups_size(), 1);
    }
    const int local = kGlobalBatch / mesh.world_size();
    const int per_mb = local / v.microbatches;
    const Runner enter = [&engine](int unit, const at::Tensor& x,
                                   const TensorFn& fn) {
      return engine->Unit(unit).Forward(x, fn);
    };
    for (int step = 0; step < kSteps; ++step) {
      const auto begin = std::chrono::steady_clock::now();
      for (int mb = 0; mb < v.microbatches; ++mb) {
        const absl::Status applied = engine->Apply(schedule, mb);
        ASSERT_TRUE(applied.ok()) << applied;
        auto [tokens, targets] =
            MoeBatch(step, ctx.rank * local + mb * per_mb, per_mb);
        at::Tensor loss =
            engine->Root().Forward(tokens, [&](const at::Tensor& t) {
              return MoeLoss(Forward(model, shape, t, enter), targets);
            });
        (loss / v.microbatches).backward();
      }
      const double seconds = std::chrono::duration<double>(
                                 std::chrono::steady_clock::now() - begin)
                                 .count();
      PutGradRows(*engine, result.grads[step], defined[step],
                  result.ranks_agree, mu);
      {
        std::lock_guard<std::mutex> lock(mu);
        result.slowest_step_seconds =
            std::max(result.slowest_step_seconds, seconds);
      }
      sgd.step();
      sgd.zero_grad();
    }
    absl::StatusOr<StateDict> full = FullStateDict(*engine);
    ASSERT_TRUE(full.ok()) << full.status();
    if (ctx.rank == 0) result.params = *full;
  });
  return result;
}

void ExpectSameGradients(const StepGrads& got, const StepGrads& want,
                         int step) {
  for (const auto& [name, g] : want) {
    SCOPED_TRACE(absl::StrCat("step ", step, ", ", name));
    auto it = got.find(name);
    const bool got_defined = it != got.end() && it->second.defined();
    ASSERT_EQ(got_defined, g.defined());
    if (!g.defined()) continue;
    EXPECT_LT((it->second - g).abs().max().item<double>(), kTolerance);
  }
}

class UnusedParamsTest
    : public ::testing::TestWithParam<std::tuple<Shape, comm::MeshShape>> {};

TEST_P(UnusedParamsTest, SgdGradientsMatchSingleProcess) {
  at::set_num_threads(1);
  const auto [shape, mesh] = GetParam();
  const StateDict init = MoeInit();
  const Result want = TrainReference(shape, init);
  // The routing really leaves experts without a gradient in the reference.
  if (shape != Shape::kShared) {
    EXPECT_FALSE(want.grads[0].at("layers_0.8.weight").defined());
    EXPECT_TRUE(want.grads[0].at("layers_0.0.weight").defined());
  }
  const Result got = TrainSharded(shape, mesh, init, Variant());
  EXPECT_TRUE(got.ranks_agree);
  EXPECT_LT(got.slowest_step_seconds, kMaxStepSeconds);
  for (int step = 0; step < kSteps; ++step)
    ExpectSameGradients(got.grads[step], want.grads[step], step);
  EXPECT_LT(MaxAbsDiff(got.params, want.params), kTolerance);
}

// R x 1 (replicas only), 1 x S (shards only) and R x S.
INSTANTIATE_TEST_SUITE_P(
    Meshes, UnusedParamsTest,
    ::testing::Combine(
        ::testing::Values(Shape::kExpertsInUnit, Shape::kExpertUnits,
                          Shape::kUnreachedUnits, Shape::kShared),
        ::testing::Values(comm::MeshShape{1, 1}, comm::MeshShape{2, 1},
                          comm::MeshShape{4, 1}, comm::MeshShape{1, 2},
                          comm::MeshShape{1, 4}, comm::MeshShape{2, 2})),
    [](const auto& info) {
      const comm::MeshShape& mesh = std::get<1>(info.param);
      return absl::StrCat(ShapeName(std::get<0>(info.param)), "_",
                          mesh.replicate, "x", mesh.shard);
    });

// Microbatches (the flags accumulate across reductions, also while HSDP
// holds shard-reduced gradients back from the all-reduce), prefetch (gathers
// issued ahead for a unit this rank then skips), the flat path, and comm
// fusion (a group's members skipped, not reached or called again on some
// ranks: the same fused collectives everywhere).
TEST(UnusedParamsVariantsTest, MicrobatchesPrefetchFlatPathAndFusion) {
  at::set_num_threads(1);
  const StateDict init = MoeInit();
  const std::vector<Variant> variants = {
      {2, 0, false, true, true},         {2, 0, false, true, false},
      {2, 0, false, false, false},       {1, 1, false, true, true},
      {2, 1, true, true, false},         {1, 0, true, true, true},
      {1, 0, false, true, true, kPairs}, {2, 1, false, true, false, kAll},
      {2, 0, false, false, false, kAll}, {2, 1, true, true, false, kPairs},
      {1, 0, true, true, true, kAll}};
  for (Shape shape : {Shape::kExpertsInUnit, Shape::kExpertUnits,
                      Shape::kUnreachedUnits, Shape::kShared}) {
    const Result want = TrainReference(shape, init);
    for (const Variant& v : variants) {
      SCOPED_TRACE(absl::StrCat(
          ShapeName(shape), " micro ", v.microbatches, " prefetch ", v.prefetch,
          " flat ", v.flat, " sync ", v.sync_every_microbatch, " all-reduce ",
          v.all_reduce_every_microbatch, " fusion ", v.fusion_bucket));
      const Result got = TrainSharded(shape, {2, 2}, init, v);
      EXPECT_TRUE(got.ranks_agree);
      for (int step = 0; step < kSteps; ++step)
        ExpectSameGradients(got.grads[step], want.grads[step], step);
      EXPECT_LT(MaxAbsDiff(got.params, want.params), kTolerance);
    }
  }
}

// Comm fusion over four shards, every unit in one group and in pairs: ranks
// that skip, do not reach or reuse different members still issue the same
// fused collectives, and every gradient is the single-process one.
TEST(UnusedParamsVariantsTest, FusionOverFourShards) {
  at::set_num_threads(1);
  const StateDict init = MoeInit();
  for (Shape shape : {Shape::kExpertsInUnit, Shape::kExpertUnits,
                      Shape::kUnreachedUnits, Shape::kShared}) {
    const Result want = TrainReference(shape, init);
    for (int64_t bucket : {kPairs, kAll}) {
      SCOPED_TRACE(absl::StrCat(ShapeName(shape), " fusion ", bucket));
      Variant v;
      v.fusion_bucket = bucket;
      const Result got = TrainSharded(shape, {1, 4}, init, v);
      EXPECT_TRUE(got.ranks_agree);
      EXPECT_LT(got.slowest_step_seconds, kMaxStepSeconds);
      for (int step = 0; step < kSteps; ++step)
        ExpectSameGradients(got.grads[step], want.grads[step], step);
      EXPECT_LT(MaxAbsDiff(got.params, want.params), kTolerance);
    }
  }
}

}  // namespace
}  // namespace hsdp::fsdp::testing
