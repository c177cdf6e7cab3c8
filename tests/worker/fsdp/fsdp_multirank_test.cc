// Multi-rank tests of the sharding engine: ranks are threads talking Gloo over
// loopback TCP.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "hsdp/device_mesh.h"
#include "hsdp/fully_shard.h"
#include "hsdp/models/gpt.h"
#include "tests/worker/fsdp/fsdp_test_util.h"
#include "worker/models/gpt_setup.h"

namespace hsdp::fsdp::testing {
namespace {

constexpr double kParityTolerance = 1e-5;  // fp32 sums in another order

// Mean over ranks of each step's local loss: the global-batch loss (equal local
// batch sizes).
std::vector<double> GlobalLosses(const std::vector<RunResult>& results) {
  std::vector<double> out(results[0].losses.size(), 0.0);
  for (const RunResult& r : results) {
    for (size_t s = 0; s < out.size(); ++s)
      out[s] += r.losses[s] / results.size();
  }
  return out;
}

std::vector<RunResult> TrainOnMesh(comm::MeshShape shape, const StateDict& init,
                                   const RunConfig& config) {
  std::vector<RunResult> results(shape.world_size());
  RunOnMesh(shape, [&](RankContext& ctx) {
    results[ctx.rank] =
        TrainSharded(ctx.comms(), ctx.rank, shape.world_size(), init, config);
  });
  return results;
}

void ExpectMatchesReference(const std::vector<RunResult>& results,
                            const RunResult& reference, double tolerance) {
  const std::vector<double> losses = GlobalLosses(results);
  ASSERT_EQ(losses.size(), reference.losses.size());
  for (size_t s = 0; s < losses.size(); ++s) {
    EXPECT_NEAR(losses[s], reference.losses[s], tolerance) << "step " << s;
  }
  EXPECT_LE(MaxAbsDiff(results[0].params, reference.params), tolerance);
}

class ParityTest : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(ParityTest, MatchesSingleProcessTraining) {
  const comm::MeshShape shape{std::get<0>(GetParam()), std::get<1>(GetParam())};
  RunConfig config;
  const StateDict init = MakeInitialState(config.dims, 1);
  const RunResult reference = TrainReference(init, config);
  // The run must actually train, or parity would be vacuous.
  ASSERT_GT(MaxAbsDiff(reference.params, init), 1e-3);
  ASSERT_NE(reference.losses.front(), reference.losses.back());
  ExpectMatchesReference(TrainOnMesh(shape, init, config), reference,
                         kParityTolerance);
}

INSTANTIATE_TEST_SUITE_P(Meshes, ParityTest,
                         ::testing::Values(std::make_tuple(1, 1),
                                           std::make_tuple(1, 2),
                                           std::make_tuple(2, 1),
                                           std::make_tuple(2, 2),
                                           std::make_tuple(1, 4)),
                         [](const auto& info) {
                           return absl::StrCat(std::get<0>(info.param), "x",
                                               std::get<1>(info.param));
                         });

TEST(ClipGradNormTest, GlobalNormMatchesSingleProcessClipping) {
  RunConfig config;
  config.clip_norm =
      0.05;  // well below the gradient norm of this model: clipping happens
  const StateDict init = MakeInitialState(config.dims, 2);
  const RunResult reference = TrainReference(init, config);
  RunConfig unclipped = config;
  unclipped.clip_norm = 0;
  ASSERT_GT(
      MaxAbsDiff(TrainReference(init, unclipped).params, reference.params),
      1e-6);
  ExpectMatchesReference(TrainOnMesh({2, 2}, init, config), reference,
                         kParityTolerance);
}

// Trains every config on `shape` from `init`: results[config][rank].
std::vector<std::vector<RunResult>> TrainConfigs(
    const comm::MeshShape& shape, const StateDict& init,
    const std::vector<RunConfig>& configs) {
  std::vector<std::vector<RunResult>> results(
      configs.size(), std::vector<RunResult>(shape.world_size()));
  RunOnMesh(shape, [&](RankContext& ctx) {
    for (size_t i = 0; i < configs.size(); ++i) {
      results[i][ctx.rank] = TrainSharded(ctx.comms(), ctx.rank,
                                          shape.world_size(), init, configs[i]);
    }
  });
  return results;
}

// Every rank's losses and the final parameters, bit for bit.
void ExpectSameNumbers(const std::vector<RunResult>& got,
                       const std::vector<RunResult>& want) {
  for (size_t r = 0; r < got.size(); ++r)
    EXPECT_EQ(got[r].losses, want[r].losses) << "rank " << r;
  EXPECT_TRUE(BitwiseEqual(got[0].params, want[0].params));
}

// Every combination of reshard/prefetch/offload gives bitwise identical losses
// and parameters.
TEST(PolicyTest, PolicyNeverChangesTheNumbers) {
  const comm::MeshShape shape{2, 2};
  RunConfig base;
  base.steps = 2;
  base.microbatches = 2;
  base.all_reduce_every_microbatch =
      false;  // HSDP: replicate all-reduce on the last only
  const StateDict init = MakeInitialState(base.dims, 3);
  std::vector<RunConfig> configs;
  for (bool raf : {true, false}) {
    for (bool rab : {true, false}) {
      for (int prefetch : {0, 1, 2}) {
        for (bool offload : {false, true}) {
          RunConfig c = base;
          c.reshard_after_forward = raf;
          c.reshard_after_backward = rab;
          c.prefetch = prefetch;
          c.offload = offload;
          configs.push_back(c);
        }
      }
    }
  }
  const std::vector<std::vector<RunResult>> results =
      TrainConfigs(shape, init, configs);
  for (size_t i = 1; i < configs.size(); ++i) {
    const RunConfig& c = configs[i];
    SCOPED_TRACE(absl::StrCat(
        "raf=", c.reshard_after_forward, " rab=", c.reshard_after_backward,
        " prefetch=", c.prefetch, " offload=", c.offload));
    ExpectSameNumbers(results[i], results[0]);
  }
  // The policies did differ in what they did: keeping params after forward
  // saves all-gathers.
  auto gathers = [](const RunResult& r) {
    int64_t n = 0;
    for (const UnitStats& u : r.stats.units) n += u.all_gathers;
    return n;
  };
  EXPECT_GT(gathers(results[0][0]), gathers(results[configs.size() - 1][0]));
}

// Comm fusion buckets for the test model: 0 (none), the root and the first
// block together (the second block alone), and every unit in one group.
std::vector<int64_t> FusionBuckets(const RunConfig& config) {
  const UnitList units = TestModelUnits(config);
  return {0, units[0].param_bytes() + units[1].param_bytes(),
          TotalParamBytes(units)};
}

// Comm fusion sends several units' bytes in one collective: the same losses
// and parameters, bit for bit, on the shapes where it fuses (shards) and the
// HSDP mesh (whose replicate all-reduces stay per unit), with fewer
// all-gathers and reduce-scatters.
TEST(PolicyTest, CommFusionNeverChangesTheNumbers) {
  RunConfig base;
  base.steps = 2;
  base.microbatches = 2;
  base.all_reduce_every_microbatch = false;
  const std::vector<int64_t> buckets = FusionBuckets(base);
  const StateDict init = MakeInitialState(base.dims, 3);
  for (const comm::MeshShape shape :
       {comm::MeshShape{1, 4}, comm::MeshShape{2, 2}}) {
    std::vector<RunConfig> configs;
    for (bool raf : {true, false}) {
      for (bool sync_every : {true, false}) {
        for (int64_t bucket : buckets) {
          RunConfig c = base;
          c.reshard_after_forward = raf;
          c.sync_every_microbatch = sync_every;
          c.prefetch = raf ? 1 : 0;
          c.comm_fusion_bucket_bytes = bucket;
          configs.push_back(c);
        }
      }
    }
    const std::vector<std::vector<RunResult>> results =
        TrainConfigs(shape, init, configs);
    for (size_t i = 0; i < configs.size(); ++i) {
      const size_t unfused = i - i % buckets.size();
      if (i == unfused) continue;
      const RunConfig& c = configs[i];
      SCOPED_TRACE(absl::StrCat(shape.replicate, "x", shape.shard,
                                " raf=", c.reshard_after_forward,
                                " sync_every=", c.sync_every_microbatch,
                                " bucket=", c.comm_fusion_bucket_bytes));
      ExpectSameNumbers(results[i], results[unfused]);
      const EngineStats& fused = results[i][0].stats;
      const EngineStats& alone = results[unfused][0].stats;
      EXPECT_LT(fused.all_gathers, alone.all_gathers);
      EXPECT_LT(fused.reduce_scatters, alone.reduce_scatters);
      EXPECT_EQ(fused.all_reduces, alone.all_reduces);
      // Every unit's bytes went out, in its own collective or a peer's.
      for (size_t u = 0; u < fused.units.size(); ++u) {
        EXPECT_EQ(fused.units[u].all_gathers + fused.units[u].fused_all_gathers,
                  alone.units[u].all_gathers)
            << "unit " << u;
      }
    }
  }
}

// The fusion bucket changed between steps (as a policy set with hsdpctl
// applies from the next unsealed step): the run's losses and parameters are
// those of a run that never fused.
TEST(PolicyTest, CommFusionChangedMidRunKeepsTheNumbers) {
  RunConfig base;
  base.steps = 4;
  base.microbatches = 2;
  base.sync_every_microbatch = false;
  const std::vector<int64_t> buckets = FusionBuckets(base);
  RunConfig changing = base;
  changing.fusion_bucket_by_step = {buckets[2], 0, buckets[1], buckets[2]};
  const StateDict init = MakeInitialState(base.dims, 13);
  for (const comm::MeshShape shape :
       {comm::MeshShape{1, 2}, comm::MeshShape{2, 2}}) {
    SCOPED_TRACE(absl::StrCat(shape.replicate, "x", shape.shard));
    std::vector<RunResult> plain = TrainOnMesh(shape, init, base);
    std::vector<RunResult> changed = TrainOnMesh(shape, init, changing);
    ExpectSameNumbers(changed, plain);
    EXPECT_LT(changed[0].stats.all_gathers, plain[0].stats.all_gathers);
    EXPECT_NE(plain[0].losses.front(), plain[0].losses.back());
  }
}

// Hierarchical reshard: units kept sharded within their host group after
// forward and gathered over it in backward give the numbers of runs that
// gathered over the whole shard group, bit for bit, on four shards in host
// groups of two, one replica or two, on the segments and the flat path, with
// recompute, prefetch, comm fusion, microbatches with and without syncing,
// and bf16 parameters.
TEST(PolicyTest, ReshardWithinHostNeverChangesTheNumbers) {
  constexpr int kHostGroup = 2;
  RunConfig base;
  base.global_batch = 16;  // two microbatches of one sample on 2x4
  base.steps = 2;
  base.microbatches = 2;
  base.all_reduce_every_microbatch = false;
  const std::vector<int64_t> buckets = FusionBuckets(base);
  std::vector<RunConfig> plain;
  for (bool recompute : {false, true}) {
    for (int prefetch : {0, 1}) {
      RunConfig c = base;
      c.checkpoint = recompute;
      c.prefetch = prefetch;
      c.sync_every_microbatch = prefetch == 0;
      c.comm_fusion_bucket_bytes = recompute ? buckets[2] : 0;
      plain.push_back(c);
    }
  }
  RunConfig bf16 = base;
  bf16.mixed_precision.param_dtype = c10::kBFloat16;
  plain.push_back(bf16);
  std::vector<RunConfig> configs;
  for (const RunConfig& c : plain) {
    configs.push_back(c);
    RunConfig within = c;
    within.within_host_group = kHostGroup;
    configs.push_back(within);
  }
  const StateDict init = MakeInitialState(base.dims, 17);
  for (const comm::MeshShape shape :
       {comm::MeshShape{1, 4}, comm::MeshShape{2, 4}}) {
    // results[flat][config][rank]
    std::vector<std::vector<std::vector<RunResult>>> results(
        2, std::vector<std::vector<RunResult>>(
               configs.size(), std::vector<RunResult>(shape.world_size())));
    RunOnMesh(
        shape,
        [&](RankContext& ctx) {
          FlatOnlyCommunicator shard(&ctx.mesh->shard());
          FlatOnlyCommunicator replicate(&ctx.mesh->replicate());
          FlatOnlyCommunicator host(ctx.mesh->host());
          for (int flat = 0; flat < 2; ++flat) {
            const MeshComms comms =
                flat ? MeshComms{&shard, &replicate, &host} : ctx.comms();
            for (size_t i = 0; i < configs.size(); ++i) {
              results[flat][i][ctx.rank] = TrainSharded(
                  comms, ctx.rank, shape.world_size(), init, configs[i]);
            }
          }
        },
        absl::Seconds(30), /*shared_memory=*/true, kHostGroup);
    for (int flat = 0; flat < 2; ++flat) {
      for (size_t i = 0; i < configs.size(); i += 2) {
        const RunConfig& c = configs[i];
        SCOPED_TRACE(absl::StrCat(
            shape.replicate, "x", shape.shard, flat ? " flat" : " segments",
            " recompute=", c.checkpoint, " prefetch=", c.prefetch,
            " sync_every=", c.sync_every_microbatch,
            " bucket=", c.comm_fusion_bucket_bytes,
            " bf16=", c.mixed_precision.param_dtype.has_value()));
        const std::vector<RunResult>& alone = results[flat][i];
        const std::vector<RunResult>& within = results[flat][i + 1];
        ExpectSameNumbers(within, alone);
        EXPECT_NE(alone[0].losses.front(), alone[0].losses.back());
        // The backward gathers moved to the host group (recompute gathers
        // there too), and the forward ones stayed.
        EXPECT_EQ(alone[0].stats.host_all_gathers, 0);
        EXPECT_GE(within[0].stats.host_all_gathers,
                  int64_t{base.steps} * base.microbatches * base.dims.layers);
        EXPECT_LT(within[0].stats.all_gathers, alone[0].stats.all_gathers);
        EXPECT_EQ(within[0].stats.reduce_scatters,
                  alone[0].stats.reduce_scatters);
        EXPECT_EQ(within[0].stats.all_reduces, alone[0].stats.all_reduces);
      }
    }
  }
}

TEST(GradAccumulationTest, NoSyncMicrobatchesEqualOneLargeBatch) {
  RunConfig config;
  config.microbatches = 4;
  config.sync_every_microbatch = false;
  const StateDict init = MakeInitialState(config.dims, 4);
  RunConfig one_batch = config;
  one_batch.microbatches = 1;
  const RunResult reference = TrainReference(init, one_batch);
  ExpectMatchesReference(TrainOnMesh({1, 2}, init, config), reference,
                         kParityTolerance);
}

TEST(GradAccumulationTest, HsdpAllReduceOnlyOnLastMicrobatch) {
  RunConfig config;
  config.microbatches = 2;
  config.sync_every_microbatch = true;
  config.all_reduce_every_microbatch = false;
  config.reshard_after_backward = false;
  const StateDict init = MakeInitialState(config.dims, 5);
  const RunResult reference = TrainReference(init, config);
  std::vector<RunResult> results = TrainOnMesh({2, 2}, init, config);
  ExpectMatchesReference(results, reference, kParityTolerance);
  // A reduce-scatter per unit per microbatch, but one all-reduce per unit per
  // step, not per microbatch.
  for (const UnitStats& u : results[0].stats.units) {
    EXPECT_EQ(u.reduce_scatters, config.steps * config.microbatches);
    EXPECT_EQ(u.all_reduces, config.steps);
  }
}

// bf16 compute params with fp32 reduction: within bf16 precision of the fp32
// reference. Tolerance: bf16 has an 8-bit mantissa (relative 2^-8 ≈ 4e-3);
// losses ≈ 2.4 → 3e-2 absolute; three AdamW steps of lr 2e-3 move a parameter
// by at most 6e-3 → 1e-2 on parameters.
TEST(MixedPrecisionTest, Bf16ParamsFp32ReduceWithinTolerance) {
  constexpr double kLossTolerance = 3e-2;
  constexpr double kParamTolerance = 1e-2;
  RunConfig config;
  config.mixed_precision.param_dtype = torch::kBFloat16;
  config.mixed_precision.reduce_dtype = torch::kFloat;
  config.mixed_precision.output_dtype = torch::kFloat;
  const StateDict init = MakeInitialState(config.dims, 6);
  RunConfig fp32 = config;
  fp32.mixed_precision = MixedPrecisionPolicy();
  const RunResult reference = TrainReference(init, fp32);
  const std::vector<RunResult> results = TrainOnMesh({1, 2}, init, config);
  const std::vector<double> losses = GlobalLosses(results);
  for (size_t s = 0; s < losses.size(); ++s) {
    EXPECT_NEAR(losses[s], reference.losses[s], kLossTolerance);
  }
  EXPECT_LE(MaxAbsDiff(results[0].params, reference.params), kParamTolerance);
  // It really ran in bf16: not bit-equal to the fp32 run.
  EXPECT_GT(MaxAbsDiff(results[0].params, reference.params), 0.0);
}

TEST(RecomputeTest, RecomputeGivesTheSameGradients) {
  RunConfig config;
  const StateDict init = MakeInitialState(config.dims, 7);
  RunConfig with_recompute = config;
  with_recompute.checkpoint = true;
  with_recompute.prefetch = 1;
  std::vector<RunResult> plain = TrainOnMesh({1, 2}, init, config);
  std::vector<RunResult> recomputed = TrainOnMesh({1, 2}, init, with_recompute);
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(plain[r].losses.size(), recomputed[r].losses.size());
    for (size_t s = 0; s < plain[r].losses.size(); ++s) {
      EXPECT_NEAR(plain[r].losses[s], recomputed[r].losses[s], 1e-7);
    }
  }
  EXPECT_LE(MaxAbsDiff(plain[0].params, recomputed[0].params), 1e-7);
}

TEST(RecomputeTest, ForwardIsRerunInBackward) {
  RunConfig config;
  const StateDict init = MakeInitialState(config.dims, 8);
  RunOnMesh({1, 2}, [&](RankContext& ctx) {
    TinyTransformer model = MakeModel(config.dims, init);
    std::unique_ptr<Engine> engine = MakeEngine(model, ctx.comms(), config);
    int calls = 0;
    auto [tokens, targets] = Batch(config.dims, 0, ctx.rank * 4, 4);
    at::Tensor loss = engine->Root().Forward(tokens, [&](const at::Tensor& t) {
      at::Tensor h = model->Embed(t);
      Block block = model->blocks[0];
      h = Recompute(
          *engine,
          // Runs again in backward, after this lambda returned: capture by
          // value.
          [&calls, &engine, block](const at::Tensor& x) {
            return engine->Unit(1).Forward(
                x, [&calls, block](const at::Tensor& y) mutable {
                  ++calls;
                  return block->forward(y);
                });
          },
          h);
      h = engine->Unit(2).Forward(
          h, [&](const at::Tensor& y) { return model->blocks[1]->forward(y); });
      return model->Head(h).sum();
    });
    EXPECT_EQ(calls, 1);
    loss.backward();
    EXPECT_EQ(calls, 2);  // recomputed once in backward
    for (const auto& [name, p] : engine->NamedParameters()) {
      if (name.rfind("layers.0.", 0) == 0 && p.numel() > 0) {
        EXPECT_TRUE(p.grad().defined()) << name;
      }
    }
    EXPECT_EQ(engine->Stats().unsharded_bytes_alive, 0);
  });
}

TEST(MemoryTest, ShardedBytesPerRankAreOneOverSPlusPadding) {
  RunConfig config;
  const StateDict init = MakeInitialState(config.dims, 9);
  int64_t total_bytes = 0, padding_bound = 0;
  for (const auto& [name, t] : init) {
    total_bytes += t.numel() * 4;
    padding_bound +=
        t.numel() / t.size(0) * 4;  // at most one padding row per parameter
  }
  constexpr int kShards = 4;
  RunOnMesh({1, kShards}, [&](RankContext& ctx) {
    TinyTransformer model = MakeModel(config.dims, init);
    std::unique_ptr<Engine> engine = MakeEngine(model, ctx.comms(), config);
    const EngineStats stats = engine->Stats();
    EXPECT_GE(stats.sharded_bytes * kShards, total_bytes);
    EXPECT_LE(stats.sharded_bytes * kShards,
              total_bytes + kShards * padding_bound);
    EXPECT_EQ(stats.unsharded_bytes_alive, 0);
    int64_t numel = 0;
    for (const UnitLayout& u : engine->Units()) numel += u.numel;
    EXPECT_EQ(numel * 4, total_bytes);
    EXPECT_EQ(engine->Units()[0].name, "root");
    EXPECT_EQ(engine->Units()[1].name, "layers.0");
  });
}

// The transient peak (unsharded params + unsharded grads + flat comm buffers
// alive at once) stays within two of the largest unit plus the root's params
// and grads, which stay unsharded through forward and backward: the comm pool
// never keeps an idle buffer next to a new one, and a unit reshards before
// its reduce-scatter copy-in, so params, grads and the flat buffer of one
// block are never all alive together.
TEST(MemoryTest, TransientPeakIsTwoUnitsPlusRoot) {
  RunConfig config;
  config.steps = 1;
  constexpr int kShards = 2;
  const StateDict init = MakeInitialState(config.dims, 9);
  RunOnMesh({1, kShards}, [&](RankContext& ctx) {
    const EngineStats stats =
        TrainSharded(ctx.comms(), ctx.rank, kShards, init, config).stats;
    // fp32 everywhere: a unit's unsharded (and flat) bytes are S x its shard.
    const int64_t root = stats.units[0].sharded_bytes * kShards;
    int64_t largest = 0;
    for (const UnitStats& u : stats.units)
      largest = std::max(largest, u.sharded_bytes * kShards);
    EXPECT_EQ(stats.peak_transient_bytes, stats.peak_transient_param_bytes +
                                              stats.peak_transient_grad_bytes +
                                              stats.peak_transient_comm_bytes);
    EXPECT_GT(stats.peak_transient_param_bytes, 0);
    EXPECT_LE(stats.peak_transient_comm_bytes, largest);
    EXPECT_LE(stats.peak_transient_bytes, 2 * largest + 2 * root);
    EXPECT_LE(stats.peak_transient_bytes, stats.peak_unsharded_bytes +
                                              stats.peak_unsharded_grad_bytes +
                                              stats.peak_comm_buffer_bytes);
  });
}

TEST(StateDictTest, FullAndShardedRoundTrip) {
  RunConfig config;
  const StateDict init = MakeInitialState(config.dims, 10);
  const StateDict other = MakeInitialState(config.dims, 11);
  RunOnMesh({2, 2}, [&](RankContext& ctx) {
    TinyTransformer model = MakeModel(config.dims, init);
    std::unique_ptr<Engine> engine = MakeEngine(model, ctx.comms(), config);
    absl::StatusOr<StateDict> full = FullStateDict(*engine);
    ASSERT_TRUE(full.ok()) << full.status();
    if (ctx.rank == 0) {
      EXPECT_TRUE(BitwiseEqual(*full, init));
    } else {
      EXPECT_TRUE(full->empty());
    }
    const auto sharded = ShardedStateDict(*engine);
    // Load another model's weights from rank 0, check, then restore the shards.
    absl::Status s =
        LoadFullStateDict(*engine, ctx.rank == 0 ? other : StateDict());
    ASSERT_TRUE(s.ok()) << s;
    full = FullStateDict(*engine);
    ASSERT_TRUE(full.ok());
    if (ctx.rank == 0) {
      EXPECT_TRUE(BitwiseEqual(*full, other));
    }
    ASSERT_TRUE(LoadShardedStateDict(*engine, sharded).ok());
    full = FullStateDict(*engine);
    ASSERT_TRUE(full.ok());
    if (ctx.rank == 0) {
      EXPECT_TRUE(BitwiseEqual(*full, init));
    }
    // A bad dict fails on every rank instead of hanging the others.
    StateDict bad = other;
    bad.erase("head.weight");
    s = LoadFullStateDict(*engine, ctx.rank == 0 ? bad : StateDict());
    EXPECT_FALSE(s.ok());
    if (ctx.rank == 0) {
      EXPECT_NE(s.message().find("head.weight"), std::string::npos) << s;
    }
  });
}

// Rank 1 either dies before the first collective (its sockets close: a fast
// UNAVAILABLE) or never issues it (DEADLINE_EXCEEDED after the collective
// timeout). Either way rank 0's forward fails within the timeout, naming the
// unit, the collective and the communicator, and the engine refuses to go on.
class FailureTest : public ::testing::TestWithParam<bool> {};

TEST_P(FailureTest, PeerFailsWithinTimeoutNamingTheCollective) {
  const bool peer_dies = GetParam();
  constexpr auto kTimeout = absl::Seconds(2);
  constexpr double kSlackSeconds = 2.0;
  RunConfig config;
  const StateDict init = MakeInitialState(config.dims, 12);
  std::string error;
  double seconds = 0;
  RunOnMesh(
      {1, 2},
      [&](RankContext& ctx) {
        TinyTransformer model = MakeModel(config.dims, init);
        std::unique_ptr<Engine> engine = MakeEngine(model, ctx.comms(), config);
        if (ctx.rank == 1) {
          // A stalled peer outlives rank 0's timeout; a dead one leaves at
          // once.
          if (!peer_dies) absl::SleepFor(kTimeout + absl::Seconds(1));
          return;
        }
        auto [tokens, targets] = Batch(config.dims, 0, 0, 4);
        const auto start = std::chrono::steady_clock::now();
        try {
          EngineForward(*engine, model, tokens, false);
          ADD_FAILURE() << "forward succeeded without a peer";
        } catch (const c10::Error& e) {
          error = e.what_without_backtrace();
        }
        seconds = std::chrono::duration<double>(
                      std::chrono::steady_clock::now() - start)
                      .count();
        EXPECT_FALSE(engine->status().ok());
        EXPECT_EQ(engine->status().code(),
                  peer_dies ? absl::StatusCode::kUnavailable
                            : absl::StatusCode::kDeadlineExceeded)
            << engine->status();
        EXPECT_FALSE(
            engine->Apply(MakeSchedule(engine->num_units(), config), 0).ok());
      },
      kTimeout);
  EXPECT_LT(seconds, absl::ToDoubleSeconds(kTimeout) + kSlackSeconds);
  EXPECT_NE(error.find("all-gather of unit root"), std::string::npos) << error;
  EXPECT_NE(error.find("gloo:shard"), std::string::npos) << error;
}

INSTANTIATE_TEST_SUITE_P(Peers, FailureTest, ::testing::Values(true, false),
                         [](const auto& info) {
                           return info.param ? "Dies" : "NeverArrives";
                         });

// The usage the header documents, on the worker's real model: hsdp::models::Gpt
// entering its units through the block runner, 2x2 HSDP with prefetch, against
// plain single-process training of the same model on the global batch.
TEST(GptIntegrationTest, BlockRunnerUsageMatchesPlainTraining) {
  constexpr int kSteps = 3;
  constexpr int kGlobalBatch = 4;
  constexpr uint64_t kSeed = 5;
  absl::StatusOr<models::GptConfig> config =
      models::GptConfigFromDims("32,2,4,16");
  ASSERT_TRUE(config.ok()) << config.status();
  auto batch = [&](int step, int begin, int count) {
    at::Tensor t = torch::empty({count, config->seq_len + 1}, torch::kLong);
    for (int b = 0; b < count; ++b) {
      for (int64_t i = 0; i <= config->seq_len; ++i) {
        t[b][i] = ((begin + b) * 31 + i * 7 + step * 13) % config->vocab_size;
      }
    }
    return std::make_pair(t.narrow(1, 0, config->seq_len).contiguous(),
                          t.narrow(1, 1, config->seq_len).contiguous());
  };
  std::vector<double> reference;
  {
    models::Gpt gpt(*config, kSeed);
    torch::optim::AdamW opt(gpt->parameters());
    for (int step = 0; step < kSteps; ++step) {
      auto [tokens, targets] = batch(step, 0, kGlobalBatch);
      at::Tensor loss = gpt->Loss(tokens, targets);
      loss.backward();
      opt.step();
      opt.zero_grad();
      reference.push_back(loss.item<double>());
    }
  }
  const comm::MeshShape shape{2, 2};
  std::vector<std::vector<double>> losses(shape.world_size());
  RunOnMesh(shape, [&](RankContext& ctx) {
    models::Gpt gpt(*config, kSeed);
    absl::StatusOr<std::unique_ptr<Engine>> sharded =
        models::ShardGpt(gpt, ctx.comms(), EngineOptions());
    ASSERT_TRUE(sharded.ok()) << sharded.status();
    std::unique_ptr<Engine> engine = std::move(*sharded);
    std::vector<std::string> names;
    for (const UnitLayout& u : engine->Units()) names.push_back(u.name);
    EXPECT_EQ(names, gpt->UnitNames());
    torch::optim::AdamW opt(engine->Parameters());
    RunConfig policy;
    policy.prefetch = 1;
    const hsdp::v1::StepSchedule schedule = PlanSchedule(*engine, policy);
    const int local = kGlobalBatch / shape.world_size();
    for (int step = 0; step < kSteps; ++step) {
      ASSERT_TRUE(engine->Apply(schedule, 0).ok());
      // Not a structured binding: the loss lambda captures `targets`.
      const auto data = batch(step, ctx.rank * local, local);
      const at::Tensor& tokens = data.first;
      const at::Tensor& targets = data.second;
      at::Tensor loss = engine->Root().Forward(
          tokens, [&](const at::Tensor& t) { return gpt->Loss(t, targets); });
      loss.backward();
      ASSERT_TRUE(ClipGradNormGlobal(*engine, 1e3).ok());  // a no-op clip
      opt.step();
      opt.zero_grad();
      losses[ctx.rank].push_back(loss.item<double>());
    }
  });
  for (int step = 0; step < kSteps; ++step) {
    double mean = 0;
    for (const auto& rank_losses : losses)
      mean += rank_losses[step] / losses.size();
    EXPECT_NEAR(mean, reference[step], kParityTolerance) << "step " << step;
  }
  EXPECT_NE(reference.front(), reference.back());
}

}  // namespace
}  // namespace hsdp::fsdp::testing
