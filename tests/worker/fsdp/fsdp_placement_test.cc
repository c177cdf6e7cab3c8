// Parameter placement (placement.h): weights sharded on dim 1 (sizes no
// group divides), replicated norm parameters and a 0-dim gain, and parameters
// that get a gradient on some ranks only. Sharded training with plain SGD
// against single-process training on the same global batch, gradient by
// gradient, on R x 1, 1 x S and R x S meshes, both collective paths.
#include <torch/torch.h>

#include <cmath>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/worker/fsdp/fsdp_test_util.h"
#include "tests/worker/fsdp/placed_model.h"
#include "tests/worker/fsdp/recording_communicator.h"

namespace hsdp::fsdp::testing {
namespace {

constexpr int kSteps = 3;
constexpr int kGlobalBatch = 24;  // divides every world size x microbatches
constexpr double kLr = 0.3;
constexpr double kTolerance = 2e-6;

using Runner =
    std::function<at::Tensor(int, const at::Tensor&, const TensorFn&)>;

struct Result {
  std::vector<StepGrads> grads;
  StateDict params;
  // Every rank holding a row (or a replicated parameter) holds the same
  // gradient for it, defined or not.
  bool ranks_agree = true;
  EngineStats stats;  // global rank 0's
  std::vector<UnitLayout> units;
};

Result TrainReference(const StateDict& init) {
  Result result;
  PlacedModel model = MakePlacedModel(init);
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(kLr));
  const Runner direct = [](int, const at::Tensor& x, const TensorFn& fn) {
    return fn(x);
  };
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = PlacedBatch(step, 0, kGlobalBatch);
    PlacedLoss(model->forward(x, direct), y).backward();
    result.grads.push_back(CloneGrads(*model));
    sgd.step();
    sgd.zero_grad();
  }
  result.params = CloneParams(*model);
  return result;
}

// This rank's gradient slices into the full tensors of `out`; a slice another
// rank wrote already must agree, and so must whether the gradient is defined.
void PutGradSlices(Engine& engine, StepGrads& out,
                   std::map<std::string, int>& defined, bool& agree,
                   std::mutex& mu) {
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& [name, st] : ShardLayouts(engine)) {
    const at::Tensor& shard = st.local;
    const int has = shard.grad().defined() ? 1 : 0;
    auto [it, fresh] = defined.emplace(name, has);
    if (!fresh && it->second != has) agree = false;
    if (!has) continue;
    if (!out[name].defined())
      out[name] = torch::full(st.global_shape, std::nan(""));
    const int64_t dim = st.global_shape.empty() ? -1 : st.shard_dim;
    at::Tensor target =
        dim < 0 ? out[name]
                : out[name].narrow(dim, st.row_offset, shard.size(dim));
    if (target.numel() == 0) continue;
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
  bool flat = false;  // the flat path (NCCL's) instead of segments
  // HSDP: the non-last microbatches hold the all-reduce back.
  bool all_reduce_every_microbatch = true;
};

Result TrainSharded(comm::MeshShape mesh, const StateDict& init,
                    const Variant& v) {
  Result result;
  result.grads.resize(kSteps);
  std::vector<std::map<std::string, int>> defined(kSteps);
  std::mutex mu;
  RunOnMesh(mesh, [&](RankContext& ctx) {
    PlacedModel model = MakePlacedModel(init);
    FlatOnlyCommunicator flat_shard(&ctx.mesh->shard());
    FlatOnlyCommunicator flat_replicate(&ctx.mesh->replicate());
    const MeshComms comms =
        v.flat ? MeshComms{&flat_shard, &flat_replicate} : ctx.comms();
    std::unique_ptr<Engine> engine =
        ShardPlacedModel(model, comms, TestPlacement());
    torch::optim::SGD sgd(engine->Parameters(), torch::optim::SGDOptions(kLr));
    RunConfig config;
    config.microbatches = v.microbatches;
    config.all_reduce_every_microbatch = v.all_reduce_every_microbatch;
    const hsdp::v1::StepSchedule schedule = PlanSchedule(*engine, config);
    const int local = kGlobalBatch / mesh.world_size();
    const int per_mb = local / v.microbatches;
    const Runner enter = [&engine](int block, const at::Tensor& x,
                                   const TensorFn& fn) {
      return engine->Unit(block + 1).Forward(x, fn);
    };
    for (int step = 0; step < kSteps; ++step) {
      for (int mb = 0; mb < v.microbatches; ++mb) {
        const absl::Status applied = engine->Apply(schedule, mb);
        ASSERT_TRUE(applied.ok()) << applied;
        auto [x, y] = PlacedBatch(step, ctx.rank * local + mb * per_mb, per_mb);
        at::Tensor loss = engine->Root().Forward(x, [&](const at::Tensor& in) {
          return PlacedLoss(model->forward(in, enter), y);
        });
        (loss / v.microbatches).backward();
      }
      PutGradSlices(*engine, result.grads[step], defined[step],
                    result.ranks_agree, mu);
      sgd.step();
      sgd.zero_grad();
    }
    absl::StatusOr<StateDict> full = FullStateDict(*engine);
    ASSERT_TRUE(full.ok()) << full.status();
    if (ctx.rank == 0) {
      result.params = *full;
      result.stats = engine->Stats();
      result.units = engine->Units();
    }
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

class PlacementParityTest : public ::testing::TestWithParam<comm::MeshShape> {};

TEST_P(PlacementParityTest, SgdGradientsMatchSingleProcess) {
  at::set_num_threads(1);
  const comm::MeshShape mesh = GetParam();
  const StateDict init = PlacedInit();
  const Result want = TrainReference(init);
  // Every parameter trains in the reference, the rare ones included.
  for (const auto& [name, g] : want.grads[0]) EXPECT_TRUE(g.defined()) << name;
  // ... while on every mesh of more than one rank some rank has no sample of
  // the rare branch in some step: its rare parameters get no gradient there.
  if (mesh.world_size() > 1) {
    const int local = kGlobalBatch / mesh.world_size();
    int ranks_without = 0;
    for (int step = 0; step < kSteps; ++step) {
      for (int r = 0; r < mesh.world_size(); ++r) {
        bool any = false;
        for (int s = r * local; s < (r + 1) * local; ++s)
          any = any || IsRareSample(step, s);
        ranks_without += any ? 0 : 1;
      }
    }
    EXPECT_GT(ranks_without, 0);
  }
  const Result got = TrainSharded(mesh, init, Variant());
  EXPECT_TRUE(got.ranks_agree);
  for (int step = 0; step < kSteps; ++step)
    ExpectSameGradients(got.grads[step], want.grads[step], step);
  EXPECT_LT(MaxAbsDiff(got.params, want.params), kTolerance);
}

// R x 1 (replicas only), 1 x S (shards only, S = 3 divides no dim) and R x S.
INSTANTIATE_TEST_SUITE_P(
    Meshes, PlacementParityTest,
    ::testing::Values(comm::MeshShape{1, 1}, comm::MeshShape{2, 1},
                      comm::MeshShape{1, 2}, comm::MeshShape{1, 3},
                      comm::MeshShape{1, 4}, comm::MeshShape{2, 2}),
    [](const auto& info) {
      return absl::StrCat(info.param.replicate, "x", info.param.shard);
    });

// Microbatches (HSDP holding the replicated gradients back from the
// replicate all-reduce too) and the flat path.
TEST(PlacementVariantsTest, MicrobatchesAndFlatPath) {
  at::set_num_threads(1);
  const StateDict init = PlacedInit();
  const Result want = TrainReference(init);
  for (const Variant& v : {Variant{2, false, false}, Variant{2, true, false},
                           Variant{1, true, true}}) {
    SCOPED_TRACE(absl::StrCat("microbatches ", v.microbatches, " flat ", v.flat,
                              " all-reduce every microbatch ",
                              v.all_reduce_every_microbatch));
    const Result got = TrainSharded({2, 2}, init, v);
    EXPECT_TRUE(got.ranks_agree);
    for (int step = 0; step < kSteps; ++step)
      ExpectSameGradients(got.grads[step], want.grads[step], step);
    EXPECT_LT(MaxAbsDiff(got.params, want.params), kTolerance);
  }
}

// The layout each placement gives: slices along the shard dim (padded like
// dim 0), replicated parameters whole and never gathered, their gradients in
// one all-reduce per unit and synchronising microbatch.
TEST(PlacementLayoutTest, ShardsAlongTheirDimAndReplicatesWhole) {
  at::set_num_threads(1);
  const StateDict init = PlacedInit();
  std::mutex mu;
  std::map<int, std::map<std::string, ShardedTensor>> layouts;
  EngineStats stats;
  std::vector<UnitLayout> units;
  RunOnMesh({1, 3}, [&](RankContext& ctx) {
    PlacedModel model = MakePlacedModel(init);
    std::unique_ptr<Engine> engine =
        ShardPlacedModel(model, ctx.comms(), TestPlacement());
    const hsdp::v1::StepSchedule schedule = PlanSchedule(*engine, RunConfig());
    ASSERT_TRUE(engine->Apply(schedule, 0).ok());
    auto [x, y] = PlacedBatch(0, ctx.rank * 8, 8);
    engine->Root()
        .Forward(x,
                 [&](const at::Tensor& in) {
                   return PlacedLoss(
                       model->forward(
                           in,
                           [&](int b, const at::Tensor& h, const TensorFn& fn) {
                             return engine->Unit(b + 1).Forward(h, fn);
                           }),
                       y);
                 })
        .backward();
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& [name, st] : ShardLayouts(*engine))
      layouts[ctx.rank][name] = st;
    if (ctx.rank == 0) {
      stats = engine->Stats();
      units = engine->Units();
    }
  });
  // blocks.0.up.weight [7, 5] on dim 1 over 3 ranks: 2, 2, 1 columns.
  for (int r = 0; r < 3; ++r) {
    const ShardedTensor& up = layouts[r].at("blocks.0.up.weight");
    EXPECT_EQ(up.shard_dim, 1);
    EXPECT_EQ(up.local.sizes(), (std::vector<int64_t>{7, r < 2 ? 2 : 1}));
    EXPECT_EQ(up.row_offset, 2 * r);
    EXPECT_TRUE(torch::equal(
        up.local,
        init.at("blocks.0.up.weight").narrow(1, 2 * r, r < 2 ? 2 : 1)));
    const ShardedTensor& down = layouts[r].at("blocks.1.down.weight");
    EXPECT_EQ(down.shard_dim, 1);  // -1 of a 2-dim weight
    const ShardedTensor& gain = layouts[r].at("blocks.1.gain");
    EXPECT_TRUE(gain.replicated);
    EXPECT_EQ(gain.local.dim(), 0);
    const ShardedTensor& norm = layouts[r].at("blocks.0.norm.weight");
    EXPECT_TRUE(norm.replicated);
    EXPECT_EQ(norm.local.sizes(), (std::vector<int64_t>{kPlacedHidden}));
    const ShardedTensor& bias = layouts[r].at("blocks.0.up.bias");
    EXPECT_FALSE(bias.replicated);
    EXPECT_EQ(bias.shard_dim, 0);
  }
  // Replicated parameters: 7 + 7 (norm) + 1 (gain) + 5 (rare_bias) floats per
  // block, whole in every rank's shard bytes.
  const int64_t replicated = (7 + 7 + 1 + 5) * 4;
  ASSERT_EQ(units.size(), 3u);
  EXPECT_EQ(units[1].replicated_bytes, replicated);
  EXPECT_EQ(units[0].replicated_bytes, 0);
  // Two gathers (forward, and backward after the reshard) and one
  // reduce-scatter per unit, and per block one all-reduce of its replicated
  // gradients (a 1 x S mesh has no replicate all-reduce).
  ASSERT_EQ(stats.units.size(), 3u);
  for (int u = 1; u < 3; ++u) {
    EXPECT_EQ(stats.units[u].all_gathers, 2);
    EXPECT_EQ(stats.units[u].reduce_scatters, 1);
    EXPECT_EQ(stats.units[u].all_reduces, 1);
  }
  EXPECT_EQ(stats.units[0].all_reduces, 0);
}

TEST(PlacementRefusalTest, NamesTheParameter) {
  at::set_num_threads(1);
  RunOnMesh({1, 2}, [&](RankContext& ctx) {
    {
      PlacedModel model = MakePlacedModel(PlacedInit());
      std::unique_ptr<Engine> engine =
          Engine::Create(model.ptr(), ctx.comms(), EngineOptions()).value();
      UnitOptions unit;
      unit.placement = [](const std::string& fqn, const at::Tensor&) {
        ParamPlacement p;
        p.shard_dim = absl::EndsWith(fqn, "up.weight") ? 2 : 0;
        p.replicated = absl::EndsWith(fqn, "gain");
        return std::optional<ParamPlacement>(p);
      };
      const absl::StatusOr<int> index =
          engine->FullyShard({model->blocks[0]}, "blocks.0", unit);
      ASSERT_FALSE(index.ok());
      EXPECT_EQ(index.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_NE(index.status().message().find("blocks.0.up.weight"),
                std::string::npos)
          << index.status();
      EXPECT_NE(index.status().message().find("shard dim 2"), std::string::npos)
          << index.status();
    }
    {
      PlacedModel model = MakePlacedModel(PlacedInit());
      std::unique_ptr<Engine> engine =
          Engine::Create(model.ptr(), ctx.comms(), EngineOptions()).value();
      // The default placement leaves the 0-dim gain unshardable.
      const absl::StatusOr<int> index =
          engine->FullyShard({model->blocks[0]}, "blocks.0");
      ASSERT_FALSE(index.ok());
      EXPECT_NE(index.status().message().find("blocks.0.gain"),
                std::string::npos)
          << index.status();
      EXPECT_NE(index.status().message().find("replicated"), std::string::npos)
          << index.status();
    }
  });
}

}  // namespace
}  // namespace hsdp::fsdp::testing
