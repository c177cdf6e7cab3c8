// Checkpoints of parameters sharded on dim 1 and replicated (placement.h):
// saved on one mesh, loaded on another mesh and into another placement, with
// AdamW's state; exported whole.
#include <torch/torch.h>

#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/worker/ckpt/ckpt_test_util.h"
#include "tests/worker/fsdp/fsdp_test_util.h"
#include "tests/worker/fsdp/placed_model.h"
#include "worker/ckpt/export.h"
#include "worker/ckpt/state.h"
#include "worker/train/checkpointing.h"

namespace hsdp::ckpt::testing {
namespace {

using fsdp::PlacementFn;
using fsdp::testing::PlacedModel;
using fsdp::testing::RankContext;
using fsdp::testing::StateDict;

constexpr int kGlobalBatch = 12;
constexpr char kPlacedModelName[] = "placed-model";

// One rank's placed model, engine and AdamW.
struct PlacedTrainer {
  PlacedTrainer(RankContext& ctx, const StateDict& init,
                const PlacementFn& placement)
      : ctx(&ctx), model(fsdp::testing::MakePlacedModel(init)) {
    engine = fsdp::testing::ShardPlacedModel(model, ctx.comms(), placement);
    optimizer = std::make_unique<torch::optim::AdamW>(
        engine->Parameters(), torch::optim::AdamWOptions(1e-2));
    schedule = fsdp::testing::PlanSchedule(*engine, fsdp::testing::RunConfig());
  }

  void Step(int step) {
    const int local = kGlobalBatch / ctx->mesh->shape().world_size();
    ASSERT_TRUE(engine->Apply(schedule, 0).ok());
    auto [x, y] = fsdp::testing::PlacedBatch(step, ctx->rank * local, local);
    engine->Root()
        .Forward(x,
                 [&](const at::Tensor& in) {
                   return fsdp::testing::PlacedLoss(
                       model->forward(in,
                                      [&](int b, const at::Tensor& h,
                                          const fsdp::TensorFn& fn) {
                                        return engine->Unit(b + 1).Forward(h,
                                                                           fn);
                                      }),
                       y);
                 })
        .backward();
    optimizer->step();
    optimizer->zero_grad();
  }

  StateDict Full() {
    absl::StatusOr<StateDict> full = fsdp::FullStateDict(*engine);
    EXPECT_TRUE(full.ok()) << full.status();
    return full.ok() ? *full : StateDict();
  }

  RankContext* ctx;
  PlacedModel model;
  std::unique_ptr<fsdp::Engine> engine;
  std::unique_ptr<torch::optim::AdamW> optimizer;
  hsdp::v1::StepSchedule schedule;
};

absl::Status Save(PlacedTrainer& t, CheckpointSaver& saver, int64_t step,
                  RankBarrier& barrier) {
  absl::Status s = saver.Prepare(step);
  barrier.Wait();
  if (!s.ok()) return s;
  std::vector<LocalTensor> tensors =
      train::ParamTensors(*t.engine, train::CheckpointUse::kSave);
  std::map<std::string, int64_t> steps;
  absl::StatusOr<std::vector<LocalTensor>> state =
      OptimizerShards(*t.optimizer, tensors, &steps);
  if (!state.ok()) return state.status();
  tensors.insert(tensors.end(), state->begin(), state->end());
  Metadata base;
  base.next_step = step + 1;
  base.model_name = kPlacedModelName;
  base.optimizer = OptimizerType(*t.optimizer);
  return saver.Save(step, tensors, std::move(steps), std::move(base));
}

absl::Status Load(PlacedTrainer& t, const std::string& root) {
  absl::StatusOr<FoundCheckpoint> found = FindLatestCheckpoint(root);
  if (!found.ok()) return found.status();
  absl::StatusOr<Metadata> m = ReadMetadata(found->dir);
  if (!m.ok()) return m.status();
  const std::vector<LocalTensor> params =
      train::ParamTensors(*t.engine, train::CheckpointUse::kLoad);
  absl::Status s =
      CheckModel(*m, found->dir, kPlacedModelName, params, *t.optimizer);
  if (!s.ok()) return s;
  return LoadShards(found->dir, *m, params, *t.optimizer);
}

// Trains 2 steps on `mesh` with the test placement and saves; returns the
// parameters at the save and after one more step.
struct Saved {
  StateDict at_save;
  StateDict after_next_step;
};

Saved TrainAndSave(comm::MeshShape mesh, const std::string& root) {
  Saved saved;
  const StateDict init = fsdp::testing::PlacedInit();
  RankBarrier barrier(mesh.world_size());
  std::mutex mu;
  fsdp::testing::RunOnMesh(mesh, [&](RankContext& ctx) {
    PlacedTrainer t(ctx, init, fsdp::testing::TestPlacement());
    t.Step(0);
    t.Step(1);
    CheckpointSaver saver(SaverOptionsFor(ctx, root, /*async=*/false, 0));
    const absl::Status s = Save(t, saver, 1, barrier);
    ASSERT_TRUE(s.ok()) << s;
    ASSERT_TRUE(saver.Wait().ok());
    const StateDict at_save = t.Full();
    t.Step(2);
    const StateDict after = t.Full();
    std::lock_guard<std::mutex> lock(mu);
    if (ctx.rank == 0) {
      saved.at_save = at_save;
      saved.after_next_step = after;
    }
  });
  return saved;
}

// Loads the newest checkpoint of `root` on `mesh` with `placement`; returns
// the parameters as loaded and after the same next step.
Saved LoadAndStep(comm::MeshShape mesh, const std::string& root,
                  const PlacementFn& placement) {
  Saved loaded;
  const StateDict init = fsdp::testing::PlacedInit();
  std::mutex mu;
  fsdp::testing::RunOnMesh(mesh, [&](RankContext& ctx) {
    PlacedTrainer t(ctx, init, placement);
    const absl::Status s = Load(t, root);
    ASSERT_TRUE(s.ok()) << s;
    const StateDict at_load = t.Full();
    t.Step(2);
    const StateDict after = t.Full();
    std::lock_guard<std::mutex> lock(mu);
    if (ctx.rank == 0) {
      loaded.at_save = at_load;
      loaded.after_next_step = after;
    }
  });
  return loaded;
}

TEST(CkptPlacementTest, LoadsOnAnotherMeshAndIntoAnotherPlacement) {
  at::set_num_threads(1);
  const std::string root = TempDir("placement");
  const Saved saved = TrainAndSave({2, 2}, root);
  ASSERT_FALSE(saved.at_save.empty());

  // The metadata: version 2 (a shard dim and a 0-dim tensor), the dims as
  // placed, each replicated parameter written once.
  absl::StatusOr<FoundCheckpoint> found = FindLatestCheckpoint(root);
  ASSERT_TRUE(found.ok()) << found.status();
  absl::StatusOr<Metadata> m = ReadMetadata(found->dir);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->format_version, 2);
  std::map<std::string, const TensorEntry*> entries;
  for (const TensorEntry& e : m->tensors) entries[e.name] = &e;
  EXPECT_EQ(entries.at("blocks.0.up.weight")->shard_dim, 1);
  EXPECT_EQ(entries.at("blocks.0.down.weight")->shard_dim, 1);
  EXPECT_EQ(entries.at("blocks.0.up.bias")->shard_dim, 0);
  EXPECT_EQ(entries.at("optimizer/exp_avg/blocks.0.up.weight")->shard_dim, 1);
  EXPECT_EQ(entries.at("blocks.1.norm.weight")->chunks.size(), 1u);
  EXPECT_TRUE(entries.at("blocks.1.gain")->shape.empty());

  // Exported whole: every parameter as it was at the save.
  for (const auto& [name, want] : saved.at_save) {
    absl::StatusOr<at::Tensor> full =
        ReadFullTensor(found->dir, *m, *entries.at(name));
    ASSERT_TRUE(full.ok()) << name << ": " << full.status();
    EXPECT_TRUE(torch::equal(*full, want)) << name;
  }

  // The same placement on 1 x 3 (shards cut elsewhere), and dim 0 everywhere
  // on 1 x 2 (every dim-1 tensor cut across its rows): the parameters as
  // saved, and the next step as the saving mesh took it (AdamW's state came
  // back too).
  for (const auto& [mesh, placement, what] :
       std::vector<std::tuple<comm::MeshShape, PlacementFn, std::string>>{
           {{1, 3}, fsdp::testing::TestPlacement(), "1x3, same placement"},
           {{1, 2}, fsdp::testing::DimZeroPlacement(), "1x2, dim 0"}}) {
    SCOPED_TRACE(what);
    const Saved loaded = LoadAndStep(mesh, root, placement);
    EXPECT_TRUE(fsdp::testing::BitwiseEqual(loaded.at_save, saved.at_save));
    EXPECT_LT(fsdp::testing::MaxAbsDiff(loaded.after_next_step,
                                        saved.after_next_step),
              1e-6);
  }
}

}  // namespace
}  // namespace hsdp::ckpt::testing
