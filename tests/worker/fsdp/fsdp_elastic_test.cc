// Engine::Rebind: a replica dies in the middle of a step's backward, the
// survivors abort their meshes, rebind the engine onto a smaller mesh and
// finish training with the same global batch.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "hsdp/device_mesh.h"
#include "hsdp/fully_shard.h"
#include "tests/worker/fsdp/fsdp_test_util.h"
#include "tests/worker/fsdp/recording_communicator.h"
#include "worker/comm/store/in_memory_store.h"

namespace hsdp::fsdp::testing {
namespace {

constexpr int kGlobalBatch = 8;
constexpr int kSteps = 5;
// Steps 0..kFailStep-1 complete on 2×2; step kFailStep fails mid-backward and
// is retried, with the rest, on 1×2.
constexpr int kFailStep = 2;
constexpr double kLr = 0.05;
constexpr absl::Duration kCollectiveTimeout = absl::Seconds(20);
// The survivors' watchdog aborts this long after their forward: usually they
// are then blocked in the replicate all-reduce of the first unit's backward
// (replica 1 never joins it); if not yet, the backward fails at its next
// collective. Either way the step fails with the engine mid-backward.
constexpr absl::Duration kAbortDelay = absl::Milliseconds(200);
// Single-process fp32 training of the same global batch (as the parity tests).
constexpr double kParityTolerance = 1e-5;

// Per step: this rank's shards (name → clone) after the optimizer step.
using ShardHistory = std::vector<StateDict>;

RunConfig ElasticConfig(int microbatches) {
  RunConfig config;
  config.global_batch = kGlobalBatch;
  config.microbatches = microbatches;
  // Units stay unsharded after forward and gathers are prefetched, so the
  // failed step leaves unsharded units and gathers in flight behind.
  config.reshard_after_forward = false;
  config.prefetch = 1;
  return config;
}

StateDict Snapshot(const Engine& engine) {
  StateDict out;
  for (const auto& [name, t] : engine.NamedParameters()) {
    out[name] = t.detach().clone();
  }
  return out;
}

// Steps [first, last) with plain SGD; rank `dp_rank` of `dp_size` takes its
// slice of each global batch in config.microbatches microbatches.
void TrainSteps(Engine& engine, TinyTransformer& model,
                torch::optim::SGD& optimizer, const RunConfig& config,
                int dp_rank, int dp_size, int first, int last,
                ShardHistory* history) {
  const hsdp::v1::StepSchedule schedule = PlanSchedule(engine, config);
  const int local = config.global_batch / dp_size;
  const int per_mb = local / config.microbatches;
  for (int step = first; step < last; ++step) {
    for (int mb = 0; mb < config.microbatches; ++mb) {
      absl::Status s = engine.Apply(schedule, mb);
      ASSERT_TRUE(s.ok()) << s;
      auto [tokens, targets] =
          Batch(config.dims, step, dp_rank * local + mb * per_mb, per_mb);
      at::Tensor loss =
          Loss(EngineForward(engine, model, tokens, /*checkpoint=*/false),
               targets) /
          config.microbatches;
      loss.backward();
    }
    optimizer.step();
    optimizer.zero_grad();
    history->push_back(Snapshot(engine));
  }
}

std::unique_ptr<comm::DeviceMesh> NewMesh(comm::MeshShape shape, int rank,
                                          comm::Store& store,
                                          const std::string& prefix) {
  comm::GlooDeviceOptions device;
  device.hostname = "127.0.0.1";
  absl::StatusOr<std::unique_ptr<comm::DeviceMesh>> mesh =
      comm::DeviceMesh::CreateGloo(shape, rank, store, prefix, device,
                                   kCollectiveTimeout);
  EXPECT_TRUE(mesh.ok()) << mesh.status();
  return mesh.ok() ? std::move(*mesh) : nullptr;
}

// The engine's communicators over `mesh`: its own (segments path), or with
// `flat` wrappers hiding segment support (NCCL's flat path), owned by
// `holder`.
MeshComms CommsFor(comm::DeviceMesh& mesh, bool flat,
                   std::vector<std::unique_ptr<comm::Communicator>>& holder) {
  if (!flat) return MeshComms{&mesh.shard(), &mesh.replicate()};
  holder.push_back(std::make_unique<FlatOnlyCommunicator>(&mesh.shard()));
  holder.push_back(std::make_unique<FlatOnlyCommunicator>(&mesh.replicate()));
  return MeshComms{holder[holder.size() - 2].get(), holder.back().get()};
}

// Single-process SGD on the global batch.
StateDict TrainSingleProcess(const StateDict& init, const RunConfig& config) {
  TinyTransformer model = MakeModel(config.dims, init);
  torch::optim::SGD optimizer(model->parameters(),
                              torch::optim::SGDOptions(kLr));
  for (int step = 0; step < kSteps; ++step) {
    auto [tokens, targets] = Batch(config.dims, step, 0, config.global_batch);
    Loss(model->forward(tokens), targets).backward();
    optimizer.step();
    optimizer.zero_grad();
  }
  StateDict out;
  for (const auto& item : model->named_parameters()) {
    out[item.key()] = item.value().detach().clone();
  }
  return out;
}

// Param: the flat path (else segments).
class FsdpElasticPathTest : public ::testing::TestWithParam<bool> {};

TEST_P(FsdpElasticPathTest, SurvivorsRebindMidBackwardAndMatchReference) {
  const bool flat = GetParam();
  const RunConfig before = ElasticConfig(/*microbatches=*/2);
  const RunConfig after = ElasticConfig(/*microbatches=*/4);
  const StateDict init = MakeInitialState(before.dims, /*seed=*/7);
  const comm::MeshShape big{/*replicate=*/2, /*shard=*/2};
  const comm::MeshShape small{/*replicate=*/1, /*shard=*/2};

  // Reference: kFailStep steps on 2×2, then (from the gathered state) the
  // rest on 1×2 with twice the microbatches, nothing failing.
  std::vector<ShardHistory> reference(2);
  StateDict handover;
  RunOnMesh(big, [&](RankContext& ctx) {
    TinyTransformer model = MakeModel(before.dims, init);
    std::vector<std::unique_ptr<comm::Communicator>> wrappers;
    std::unique_ptr<Engine> engine =
        MakeEngine(model, CommsFor(*ctx.mesh, flat, wrappers), before);
    torch::optim::SGD optimizer(engine->Parameters(),
                                torch::optim::SGDOptions(kLr));
    ShardHistory history;
    TrainSteps(*engine, model, optimizer, before, ctx.rank, big.world_size(), 0,
               kFailStep, &history);
    absl::StatusOr<StateDict> full = FullStateDict(*engine);
    ASSERT_TRUE(full.ok()) << full.status();
    if (ctx.rank == 0) handover = *full;
    if (ctx.rank < 2) reference[ctx.rank] = std::move(history);
  });
  ASSERT_FALSE(handover.empty());
  RunOnMesh(small, [&](RankContext& ctx) {
    TinyTransformer model = MakeModel(after.dims, handover);
    std::vector<std::unique_ptr<comm::Communicator>> wrappers;
    std::unique_ptr<Engine> engine =
        MakeEngine(model, CommsFor(*ctx.mesh, flat, wrappers), after);
    torch::optim::SGD optimizer(engine->Parameters(),
                                torch::optim::SGDOptions(kLr));
    TrainSteps(*engine, model, optimizer, after, ctx.rank, small.world_size(),
               kFailStep, kSteps, &reference[ctx.rank]);
  });

  // The elastic run.
  std::vector<ShardHistory> elastic(2);
  StateDict elastic_full;
  comm::InMemoryStore new_store;
  // Replica 1 stays (silently) alive until both survivors have aborted, so
  // the survivors' collectives end by their own Abort, not by a closed peer.
  absl::Notification survivor_aborted[2];
  RunOnMesh(
      big,
      [&](RankContext& ctx) {
        TinyTransformer model = MakeModel(before.dims, init);
        std::vector<std::unique_ptr<comm::Communicator>> wrappers;
        std::unique_ptr<Engine> engine =
            MakeEngine(model, CommsFor(*ctx.mesh, flat, wrappers), before);
        torch::optim::SGD optimizer(engine->Parameters(),
                                    torch::optim::SGDOptions(kLr));
        ShardHistory history;
        TrainSteps(*engine, model, optimizer, before, ctx.rank,
                   big.world_size(), 0, kFailStep, &history);
        // Step kFailStep: microbatch 0 completes everywhere (its gradients
        // reach the sharded grads); then replica 1 "dies", and the
        // survivors' microbatch 1 forward completes and its backward is cut
        // off.
        const hsdp::v1::StepSchedule schedule = PlanSchedule(*engine, before);
        const int local = kGlobalBatch / big.world_size();
        const int per_mb = local / before.microbatches;
        for (int mb = 0; mb < before.microbatches; ++mb) {
          if (mb == 1 && ctx.rank >= 2) {
            for (absl::Notification& n : survivor_aborted)
              n.WaitForNotification();
            return;
          }
          absl::Status applied = engine->Apply(schedule, mb);
          ASSERT_TRUE(applied.ok()) << applied;
          auto [tokens, targets] = Batch(
              before.dims, kFailStep, ctx.rank * local + mb * per_mb, per_mb);
          at::Tensor loss =
              Loss(EngineForward(*engine, model, tokens, false), targets) /
              before.microbatches;
          if (mb == 0) {
            loss.backward();
            continue;
          }
          const absl::Time start = absl::Now();
          std::thread watchdog([&] {
            absl::SleepFor(kAbortDelay);
            absl::Status s = ctx.mesh->Abort("replica 1 left");
            EXPECT_TRUE(s.ok()) << s;
            survivor_aborted[ctx.rank].Notify();
          });
          EXPECT_THROW(loss.backward(), c10::Error);
          watchdog.join();
          // Ended by the abort, not by the collective timeout.
          EXPECT_LT(absl::Now() - start, kCollectiveTimeout / 2);
        }  // each microbatch's graph is dropped with its loss
        bool had_grads = false;
        for (const at::Tensor& p : engine->Parameters()) {
          had_grads = had_grads || (p.grad().defined() &&
                                    p.grad().abs().sum().item<double>() > 0);
        }
        EXPECT_TRUE(had_grads);  // microbatch 0's, to be dropped
        EXPECT_FALSE(engine->status().ok());
        {
          // What the failed step left: units unsharded (no reshard after
          // forward), gradients, the all-reduce's buffer.
          const EngineStats left = engine->Stats();
          EXPECT_GT(left.unsharded_bytes_alive, 0);
          EXPECT_GT(left.grad_bytes, 0);
          EXPECT_GT(left.comm_buffer_bytes, 0);
        }

        std::unique_ptr<comm::DeviceMesh> mesh =
            NewMesh(small, ctx.rank, new_store, "elastic-generation-1");
        ASSERT_NE(mesh, nullptr);
        absl::Status rebound = engine->Rebind(CommsFor(*mesh, flat, wrappers));
        ASSERT_TRUE(rebound.ok()) << rebound;
        EXPECT_TRUE(engine->status().ok()) << engine->status();
        const EngineStats stats = engine->Stats();
        EXPECT_EQ(stats.unsharded_bytes_alive, 0);
        EXPECT_EQ(stats.grad_bytes, 0);  // the failed step left no gradient
        for (const at::Tensor& p : engine->Parameters()) {
          EXPECT_FALSE(p.grad().defined());
        }
        // The shards are those of the last completed step.
        EXPECT_TRUE(BitwiseEqual(Snapshot(*engine), history.back()));

        TrainSteps(*engine, model, optimizer, after, ctx.rank,
                   small.world_size(), kFailStep, kSteps, &history);
        absl::StatusOr<StateDict> full = FullStateDict(*engine);
        ASSERT_TRUE(full.ok()) << full.status();
        if (ctx.rank == 0) elastic_full = *full;
        elastic[ctx.rank] = std::move(history);
      },
      kCollectiveTimeout);

  // Same shards, same reduction order (the 1×2 engine after Rebind runs the
  // very collectives a fresh 1×2 engine runs), so bitwise: any leftover of
  // the failed step (a gradient, a partial reduction) would show.
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_EQ(elastic[rank].size(), static_cast<size_t>(kSteps));
    ASSERT_EQ(reference[rank].size(), static_cast<size_t>(kSteps));
    for (int step = 0; step < kSteps; ++step) {
      EXPECT_TRUE(BitwiseEqual(elastic[rank][step], reference[rank][step]))
          << "rank " << rank << " step " << step << " max diff "
          << MaxAbsDiff(elastic[rank][step], reference[rank][step]);
    }
  }
  // And the numbers are those of single-process training on the global
  // batch (the sum order differs: within the parity tests' tolerance).
  ASSERT_FALSE(elastic_full.empty());
  const StateDict single = TrainSingleProcess(init, before);
  EXPECT_LE(MaxAbsDiff(elastic_full, single), kParityTolerance);
  EXPECT_GT(MaxAbsDiff(elastic_full, init), 1e-3);  // it did train
}

INSTANTIATE_TEST_SUITE_P(Paths, FsdpElasticPathTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Flat" : "Segments";
                         });

TEST(FsdpElasticTest, RebindRefusesAnotherShardGroup) {
  const RunConfig config = ElasticConfig(/*microbatches=*/1);
  const StateDict init = MakeInitialState(config.dims, /*seed=*/7);
  RunOnMesh({/*replicate=*/1, /*shard=*/2}, [&](RankContext& ctx) {
    TinyTransformer model = MakeModel(config.dims, init);
    std::unique_ptr<Engine> engine = MakeEngine(model, ctx.comms(), config);
    const StateDict shards = Snapshot(*engine);
    // The replicate communicator of a 1×2 mesh is a group of one.
    absl::Status s = engine->Rebind(MeshComms{&ctx.mesh->replicate(), nullptr});
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_NE(s.message().find("rank 0 of 1"), absl::string_view::npos) << s;
    EXPECT_NE(s.message().find(absl::StrCat("rank ", ctx.rank, " of 2")),
              absl::string_view::npos)
        << s;
    EXPECT_EQ(engine->Rebind(MeshComms{}).code(),
              absl::StatusCode::kInvalidArgument);
    // Nothing changed: the engine still trains on its own mesh.
    torch::optim::SGD optimizer(engine->Parameters(),
                                torch::optim::SGDOptions(kLr));
    ShardHistory history;
    TrainSteps(*engine, model, optimizer, config, ctx.rank, 2, 0, 1, &history);
    EXPECT_TRUE(engine->status().ok()) << engine->status();
    EXPECT_FALSE(BitwiseEqual(history.back(), shards));
  });
}

}  // namespace
}  // namespace hsdp::fsdp::testing
