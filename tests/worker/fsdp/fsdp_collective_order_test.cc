// Collective order under test: the engine runs the production planner's
// schedules through recording communicators, and each test asserts what a
// schedule field makes the engine issue, and when, relative to unit compute.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "coordinator/planner.h"
#include "tests/worker/fsdp/fsdp_test_util.h"
#include "tests/worker/fsdp/recording_communicator.h"

namespace hsdp::fsdp::testing {
namespace {

using v1::StepSchedule;

// Four blocks: prefetch depth 2 and kept units in the middle have room.
constexpr int kLayers = 4;
constexpr int kUnits = kLayers + 1;

struct Recorded {
  StepSchedule schedule;
  std::vector<CollectiveEvent> events;  // of the recorded (second) step
  std::string text;
  EngineStats stats;  // of the recorded step
};

// Trains two steps of `config` on `shape` through recording communicators and
// returns rank 0's record of the second one (the first warms up: the
// optimizer state, the buffer pool). `flat` takes the engine's flat path.
Recorded Record(comm::MeshShape shape, RunConfig config, bool flat = false) {
  config.dims.layers = kLayers;
  config.steps = 2;
  const StateDict init = MakeInitialState(config.dims, 30);
  Recorded out;
  RunOnMesh(
      shape,
      [&](RankContext& ctx) {
        CollectiveLog log;
        RecordingCommunicator shard(&ctx.mesh->shard(), &log, !flat);
        RecordingCommunicator replicate(&ctx.mesh->replicate(), &log, !flat);
        std::unique_ptr<RecordingCommunicator> host;
        if (ctx.mesh->host() != nullptr) {
          host = std::make_unique<RecordingCommunicator>(
              ctx.mesh->host(), &log, !flat, EventKind::kHostAllGather);
        }
        TinyTransformer model = MakeModel(config.dims, init);
        std::unique_ptr<Engine> engine = MakeEngine(
            model, MeshComms{&shard, &replicate, host.get()}, config);
        torch::optim::AdamW optimizer(engine->Parameters());
        const StepSchedule schedule = PlanSchedule(*engine, config);
        const int local = config.global_batch / shape.world_size();
        const int per_mb = local / config.microbatches;
        for (int step = 0; step < config.steps; ++step) {
          engine->ResetStats();
          log.Clear();
          log.set_engine(engine.get());
          for (int mb = 0; mb < config.microbatches; ++mb) {
            ASSERT_TRUE(engine->Apply(schedule, mb).ok());
            log.set_microbatch(mb);
            log.set_phase(Phase::kForward);
            auto [tokens, targets] = Batch(
                config.dims, step, ctx.rank * local + mb * per_mb, per_mb);
            at::Tensor logits = EngineForward(*engine, model, tokens,
                                              /*checkpoint=*/false, &log);
            at::Tensor loss = Loss(logits, targets);
            log.set_phase(Phase::kBackward);
            loss.backward();
          }
          optimizer.step();
          optimizer.zero_grad();
        }
        if (ctx.rank == 0) {
          out.schedule = schedule;
          out.events = log.events();
          out.text = log.ToString();
          out.stats = engine->Stats();
        }
      },
      absl::Seconds(30), /*shared_memory=*/true, config.within_host_group);
  return out;
}

// A comm fusion bucket that groups the root with block 1 and the other
// blocks in pairs (the blocks are of one size, the root smaller).
int64_t PairBucket() {
  RunConfig config;
  config.dims.layers = kLayers;
  const UnitList units = TestModelUnits(config);
  EXPECT_LT(units[0].param_bytes(), units[1].param_bytes());
  return 2 * units[1].param_bytes();
}

int Find(const Recorded& r, EventKind kind, int unit, int mb, Phase phase) {
  for (size_t i = 0; i < r.events.size(); ++i) {
    const CollectiveEvent& e = r.events[i];
    if (e.kind == kind && e.unit == unit && e.microbatch == mb &&
        e.phase == phase) {
      return static_cast<int>(i);
    }
  }
  return -1;
}

int64_t Count(const Recorded& r, EventKind kind, int mb = -1, int unit = -1,
              int phase = -1) {
  int64_t n = 0;
  for (const CollectiveEvent& e : r.events) {
    if (e.kind == kind && (mb < 0 || e.microbatch == mb) &&
        (unit < 0 || e.unit == unit) &&
        (phase < 0 || e.phase == static_cast<Phase>(phase))) {
      ++n;
    }
  }
  return n;
}

constexpr int kFwd = static_cast<int>(Phase::kForward);
constexpr int kBwd = static_cast<int>(Phase::kBackward);

// Every collective is attributed to a unit.
void ExpectAttributed(const Recorded& r) {
  for (const CollectiveEvent& e : r.events) {
    if (e.is_collective()) {
      EXPECT_GE(e.unit, 0) << r.text;
    }
  }
}

// Depth d: every unit the schedule lists is gathered before the listing unit's
// compute begins, forward and backward — so before it ends.
TEST(CollectiveOrderTest, PrefetchIssuesTheListedGathersBeforeComputeEnds) {
  for (int depth : {1, 2}) {
    RunConfig config;
    config.prefetch = depth;
    const Recorded r = Record({1, 2}, config);
    SCOPED_TRACE(absl::StrCat("depth ", depth, ": ", r.text));
    ExpectAttributed(r);
    int checked = 0;
    for (int i = 0; i < kUnits; ++i) {
      const v1::UnitSchedule& u = r.schedule.units(i);
      EXPECT_EQ(u.forward_prefetch_size(), std::min(depth, kUnits - 1 - i));
      for (int j : u.forward_prefetch()) {
        const int gather =
            Find(r, EventKind::kAllGather, j, 0, Phase::kForward);
        ASSERT_GE(gather, 0) << "unit " << j;
        EXPECT_LT(gather,
                  Find(r, EventKind::kComputeBegin, i, 0, Phase::kForward))
            << "forward: unit " << i << " prefetches " << j;
        ++checked;
      }
      for (int j : u.backward_prefetch()) {
        const int gather =
            Find(r, EventKind::kAllGather, j, 0, Phase::kBackward);
        ASSERT_GE(gather, 0) << "unit " << j;
        EXPECT_LT(gather,
                  Find(r, EventKind::kComputeBegin, i, 0, Phase::kBackward))
            << "backward: unit " << i << " prefetches " << j;
        ++checked;
      }
    }
    // Forward: depth per unit, clipped; backward: the same over the blocks.
    EXPECT_EQ(checked, 2 * (depth == 1 ? 4 : 7));
    // The root's backward list starts with the last block.
    EXPECT_EQ(r.schedule.units(0).backward_prefetch(0), kLayers);
  }
}

// Without prefetch each unit is gathered only after the previous one's
// compute: the assertion above can fail.
TEST(CollectiveOrderTest, WithoutPrefetchGathersWaitForTheUnit) {
  RunConfig config;
  config.prefetch = 0;
  const Recorded r = Record({1, 2}, config);
  SCOPED_TRACE(r.text);
  for (int i = 1; i + 1 < kUnits; ++i) {
    EXPECT_GT(Find(r, EventKind::kAllGather, i + 1, 0, Phase::kForward),
              Find(r, EventKind::kComputeEnd, i, 0, Phase::kForward));
  }
  for (int i = kUnits - 1; i > 1; --i) {
    EXPECT_GT(Find(r, EventKind::kAllGather, i - 1, 0, Phase::kBackward),
              Find(r, EventKind::kComputeEnd, i, 0, Phase::kBackward));
  }
}

// The root rule: one all-gather of the root per step, in forward; backward
// finds it unsharded.
TEST(CollectiveOrderTest, RootIsGatheredOncePerStep) {
  RunConfig config;
  config.prefetch = 1;
  const Recorded r = Record({1, 2}, config);
  EXPECT_EQ(Count(r, EventKind::kAllGather, 0, 0), 1) << r.text;
  EXPECT_EQ(Count(r, EventKind::kAllGather, 0, 0, kFwd), 1) << r.text;
}

TEST(CollectiveOrderTest, ReshardAfterForwardOffIssuesNoBackwardGather) {
  RunConfig config;
  config.prefetch = 1;
  config.reshard_after_forward = false;
  Recorded r = Record({1, 2}, config);
  EXPECT_EQ(Count(r, EventKind::kAllGather, -1, -1, kBwd), 0) << r.text;
  EXPECT_EQ(Count(r, EventKind::kAllGather), kUnits) << r.text;
  // On: every block is gathered again in backward (not the root).
  config.reshard_after_forward = true;
  r = Record({1, 2}, config);
  for (int i = 1; i < kUnits; ++i) {
    EXPECT_EQ(Count(r, EventKind::kAllGather, 0, i, kBwd), 1)
        << "unit " << i << ": " << r.text;
  }
}

// reshard_after_backward decides whether the second microbatch's forward
// gathers a block again; at one microbatch it changes nothing (the last
// backward reshards everything).
TEST(CollectiveOrderTest, ReshardAfterBackwardActsBetweenMicrobatchesOnly) {
  RunConfig config;
  config.prefetch = 1;
  config.microbatches = 2;
  config.reshard_after_backward = true;
  Recorded r = Record({1, 2}, config);
  EXPECT_EQ(Count(r, EventKind::kAllGather, 1, -1, kFwd), kUnits - 1) << r.text;
  config.reshard_after_backward = false;
  r = Record({1, 2}, config);
  EXPECT_EQ(Count(r, EventKind::kAllGather, 1, -1, kFwd), 0) << r.text;
  // Either way nothing stays unsharded after the step.
  EXPECT_EQ(r.stats.unsharded_bytes_alive, 0);
  config.microbatches = 1;
  const Recorded one_off = Record({1, 2}, config);
  config.reshard_after_backward = true;
  const Recorded one_on = Record({1, 2}, config);
  EXPECT_EQ(Count(one_on, EventKind::kAllGather),
            Count(one_off, EventKind::kAllGather));
}

TEST(CollectiveOrderTest, NoSyncMicrobatchIssuesNoReduceScatter) {
  RunConfig config;
  config.microbatches = 2;
  config.sync_every_microbatch = false;
  Recorded r = Record({1, 2}, config);
  EXPECT_FALSE(r.schedule.microbatches(0).requires_grad_sync());
  EXPECT_EQ(Count(r, EventKind::kReduceScatter, 0), 0) << r.text;
  EXPECT_EQ(Count(r, EventKind::kReduceScatter, 1), kUnits) << r.text;
  // Every reduce-scatter is issued in backward, after its unit's compute.
  for (int i = 0; i < kUnits; ++i) {
    EXPECT_GT(Find(r, EventKind::kReduceScatter, i, 1, Phase::kBackward),
              Find(r, EventKind::kComputeEnd, i, 1, Phase::kBackward))
        << "unit " << i << ": " << r.text;
  }
  config.sync_every_microbatch = true;
  r = Record({1, 2}, config);
  EXPECT_EQ(Count(r, EventKind::kReduceScatter, 0), kUnits) << r.text;
}

TEST(CollectiveOrderTest, HsdpAllReduceOnlyWhereTheScheduleAsks) {
  RunConfig config;
  config.microbatches = 2;
  config.sync_every_microbatch = true;
  config.all_reduce_every_microbatch = false;
  Recorded r = Record({2, 2}, config);
  EXPECT_FALSE(r.schedule.microbatches(0).requires_all_reduce());
  EXPECT_TRUE(r.schedule.microbatches(1).requires_all_reduce());
  EXPECT_EQ(Count(r, EventKind::kAllReduce, 0), 0) << r.text;
  EXPECT_EQ(Count(r, EventKind::kAllReduce, 1), kUnits) << r.text;
  EXPECT_EQ(r.stats.all_reduces, kUnits);
  // Each unit's all-reduce follows its reduce-scatter.
  for (int i = 0; i < kUnits; ++i) {
    EXPECT_GT(Find(r, EventKind::kAllReduce, i, 1, Phase::kBackward),
              Find(r, EventKind::kReduceScatter, i, 1, Phase::kBackward));
  }
  config.all_reduce_every_microbatch = true;
  r = Record({2, 2}, config);
  EXPECT_EQ(Count(r, EventKind::kAllReduce, 0), kUnits) << r.text;
  // One replica: nothing to all-reduce with, whatever the flags say.
  r = Record({1, 2}, config);
  EXPECT_TRUE(r.schedule.microbatches(0).requires_all_reduce());
  EXPECT_EQ(Count(r, EventKind::kAllReduce), 0) << r.text;
}

// Per step, on both paths and meshes, the recorded collectives, the engine's
// counters and what the schedule implies (coordinator::CountCollectives) are
// the same numbers.
TEST(CollectiveOrderTest, CountsPerStepEqualWhatTheScheduleImplies) {
  struct Case {
    const char* name;
    RunConfig config;
  };
  std::vector<Case> cases;
  RunConfig base;
  base.prefetch = 1;
  cases.push_back({"default", base});
  RunConfig keep = base;
  keep.reshard_after_forward = false;
  cases.push_back({"keep", keep});
  RunConfig accumulate = base;
  accumulate.microbatches = 2;
  accumulate.sync_every_microbatch = false;
  accumulate.reshard_after_backward = false;
  cases.push_back({"accumulate", accumulate});
  RunConfig every = base;
  every.microbatches = 2;
  every.prefetch = 2;
  every.all_reduce_every_microbatch = false;
  cases.push_back({"sync every, all-reduce last", every});
  // Comm fusion: in pairs of units, and all in one group, with the policies
  // above.
  const int64_t pairs = PairBucket();
  for (size_t i = 0, n = cases.size(); i < n; ++i) {
    RunConfig fused = cases[i].config;
    fused.comm_fusion_bucket_bytes = i % 2 == 0 ? pairs : int64_t{1} << 40;
    cases.push_back({i % 2 == 0 ? "fused in pairs" : "all fused", fused});
  }
  for (const Case& c : cases) {
    for (bool flat : {false, true}) {
      const Recorded r = Record({2, 2}, c.config, flat);
      SCOPED_TRACE(
          absl::StrCat(c.name, flat ? " flat" : " segments", ": ", r.text));
      ExpectAttributed(r);
      const coordinator::CollectiveCounts want =
          coordinator::CountCollectives(r.schedule, /*replicate_size=*/2);
      EXPECT_EQ(Count(r, EventKind::kAllGather), want.all_gathers);
      EXPECT_EQ(Count(r, EventKind::kReduceScatter), want.reduce_scatters);
      EXPECT_EQ(Count(r, EventKind::kAllReduce), want.all_reduces);
      EXPECT_EQ(r.stats.all_gathers, want.all_gathers);
      EXPECT_EQ(r.stats.reduce_scatters, want.reduce_scatters);
      EXPECT_EQ(r.stats.all_reduces, want.all_reduces);
      if (c.config.comm_fusion_bucket_bytes > 0) {
        EXPECT_GT(r.schedule.fusion_groups_size(), 0);
      }
    }
  }
}

// Comm fusion in pairs ({root, 1}, {2, 3}, {4} alone, no prefetch): a
// group's first member to need a gather gathers every member the pass still
// needs, in one collective it issues; the group reduce-scatters once, after
// the backward of its last member (in backward order) and issued by it.
TEST(CollectiveOrderTest, FusionGathersAGroupOnceAndReducesAfterItsLast) {
  RunConfig config;
  config.comm_fusion_bucket_bytes = PairBucket();
  const Recorded r = Record({1, 2}, config);
  SCOPED_TRACE(r.text);
  ExpectAttributed(r);
  ASSERT_EQ(r.schedule.fusion_groups_size(), 2);
  EXPECT_EQ(std::vector<int>(r.schedule.fusion_groups(0).units().begin(),
                             r.schedule.fusion_groups(0).units().end()),
            (std::vector<int>{0, 1}));
  EXPECT_EQ(std::vector<int>(r.schedule.fusion_groups(1).units().begin(),
                             r.schedule.fusion_groups(1).units().end()),
            (std::vector<int>{2, 3}));
  // Forward: the root gathers block 1 with it, block 2 gathers block 3.
  EXPECT_EQ(Count(r, EventKind::kAllGather, 0, -1, kFwd), 3);
  for (int unit : {0, 2, 4})
    EXPECT_EQ(Count(r, EventKind::kAllGather, 0, unit, kFwd), 1) << unit;
  EXPECT_LT(Find(r, EventKind::kAllGather, 2, 0, Phase::kForward),
            Find(r, EventKind::kComputeBegin, 2, 0, Phase::kForward));
  // Backward (the root kept unsharded): block 4 alone, block 3 gathers 2;
  // block 1 alone (the root is not sharded).
  EXPECT_EQ(Count(r, EventKind::kAllGather, 0, -1, kBwd), 3);
  for (int unit : {4, 3, 1})
    EXPECT_EQ(Count(r, EventKind::kAllGather, 0, unit, kBwd), 1) << unit;
  // Reduce-scatters: block 4; {2, 3} after block 2's backward, from block 2;
  // {root, 1} at the end of backward, from the root.
  EXPECT_EQ(Count(r, EventKind::kReduceScatter), 3);
  for (int unit : {4, 2, 0})
    EXPECT_EQ(Count(r, EventKind::kReduceScatter, 0, unit), 1) << unit;
  EXPECT_GT(Find(r, EventKind::kReduceScatter, 2, 0, Phase::kBackward),
            Find(r, EventKind::kComputeEnd, 2, 0, Phase::kBackward));
  EXPECT_GT(Find(r, EventKind::kReduceScatter, 0, 0, Phase::kBackward),
            Find(r, EventKind::kComputeEnd, 0, 0, Phase::kBackward));
  // The members' bytes went out in their peers' collectives.
  EXPECT_EQ(r.stats.units[1].fused_all_gathers, 1);
  EXPECT_EQ(r.stats.units[3].fused_all_gathers, 1);
  EXPECT_EQ(r.stats.units[2].fused_all_gathers, 1);
  EXPECT_EQ(r.stats.units[1].fused_reduce_scatters, 1);
  EXPECT_EQ(r.stats.units[3].fused_reduce_scatters, 1);
  EXPECT_EQ(r.stats.units[4].fused_all_gathers +
                r.stats.units[4].fused_reduce_scatters,
            0);
  EXPECT_EQ(r.stats.unsharded_bytes_alive, 0);
}

// Hierarchical reshard on four shards in host groups of two, alone and with
// every unit in one fusion group: forward gathers over the shard group as
// before; each block (resharded after forward, with its host shard kept)
// gathers over the host group in backward, alone, before its backward
// compute; no backward all-gather crosses the shard group. The counts are the
// planner's.
TEST(CollectiveOrderTest, WithinHostReshardGathersBackwardOverTheHostGroup) {
  for (bool flat : {false, true}) {
    for (int64_t bucket : {int64_t{0}, int64_t{1} << 40}) {
      RunConfig config;
      config.within_host_group = 2;
      config.comm_fusion_bucket_bytes = bucket;
      const Recorded r = Record({1, 4}, config, flat);
      SCOPED_TRACE(absl::StrCat(flat ? "flat" : "segments", " bucket ", bucket,
                                ": ", r.text));
      ExpectAttributed(r);
      EXPECT_EQ(r.schedule.post_forward_group_size(), 2);
      const coordinator::CollectiveCounts want =
          coordinator::CountCollectives(r.schedule, /*replicate_size=*/1);
      EXPECT_EQ(want.host_all_gathers, kLayers);
      EXPECT_EQ(Count(r, EventKind::kHostAllGather), want.host_all_gathers);
      EXPECT_EQ(Count(r, EventKind::kAllGather), want.all_gathers);
      EXPECT_EQ(Count(r, EventKind::kAllGather, -1, -1, kBwd), 0);
      EXPECT_EQ(Count(r, EventKind::kAllGather), bucket > 0 ? 1 : kUnits);
      for (int unit = 1; unit <= kLayers; ++unit) {
        EXPECT_EQ(Count(r, EventKind::kHostAllGather, 0, unit, kBwd), 1)
            << unit;
        EXPECT_LT(Find(r, EventKind::kHostAllGather, unit, 0, Phase::kBackward),
                  Find(r, EventKind::kComputeBegin, unit, 0, Phase::kBackward))
            << unit;
      }
      EXPECT_EQ(r.stats.host_all_gathers, want.host_all_gathers);
      EXPECT_EQ(r.stats.all_gathers, want.all_gathers);
      EXPECT_EQ(r.stats.unsharded_bytes_alive, 0);
    }
  }
}

// On the flat path (NCCL's) with more than two shards the reduce-scatters
// stay per unit (a ring's summation order may depend on the packing); the
// all-gathers still fuse.
TEST(CollectiveOrderTest, FlatPathBeyondTwoShardsFusesOnlyAllGathers) {
  RunConfig config;
  config.comm_fusion_bucket_bytes = int64_t{1} << 40;
  const Recorded flat = Record({1, 4}, config, /*flat=*/true);
  SCOPED_TRACE(flat.text);
  EXPECT_EQ(Count(flat, EventKind::kReduceScatter), kUnits);
  // Forward: one gather of everything; backward: the blocks in one.
  EXPECT_EQ(Count(flat, EventKind::kAllGather), 2);
  const Recorded segments = Record({1, 4}, config);
  EXPECT_EQ(Count(segments, EventKind::kReduceScatter), 1) << segments.text;
  EXPECT_EQ(Count(segments, EventKind::kAllGather), 2) << segments.text;
}

}  // namespace
}  // namespace hsdp::fsdp::testing
