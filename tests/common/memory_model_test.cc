#include "common/memory_model.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace hsdp {
namespace {

// Root 400 bytes and three blocks of 100: sharded over S = 2 that is 200 + 3 *
// 50 = 350 bytes of shards, 700 of AdamW state, 350 of sharded gradients.
UnitList Units() {
  UnitList units;
  for (int64_t bytes : {400, 100, 100, 100}) {
    hsdp::v1::UnitInfo u;
    u.set_name(units.empty() ? "root"
                             : "layers." + std::to_string(units.size() - 1));
    u.set_param_bytes(bytes);
    units.push_back(u);
  }
  return units;
}

MemoryModel::Options Mesh(int shard, int replicate = 1,
                          CommPath path = CommPath::kSegments) {
  MemoryModel::Options o;
  o.shard_size = shard;
  o.replicate_size = replicate;
  o.comm_path = path;
  return o;
}

// The planner's default schedule for Units(), written out: the root kept,
// blocks resharded, depth-1 prefetch in execution order (forward root, 1, 2,
// 3; backward root, 3, 2, 1).
hsdp::v1::StepSchedule DefaultSchedule(int microbatches = 1,
                                       bool sync_every = true) {
  hsdp::v1::StepSchedule s;
  const std::vector<std::vector<int>> fwd = {{1}, {2}, {3}, {}};
  const std::vector<std::vector<int>> bwd = {{3}, {}, {1}, {2}};
  for (int i = 0; i < 4; ++i) {
    auto* u = s.add_units();
    u->set_unit_index(i);
    u->set_reshard_after_forward(i != 0);
    u->set_reshard_after_backward(i != 0);
    for (int j : fwd[i]) u->add_forward_prefetch(j);
    for (int j : bwd[i]) u->add_backward_prefetch(j);
  }
  for (int k = 0; k < microbatches; ++k) {
    const bool last = k == microbatches - 1;
    auto* mb = s.add_microbatches();
    mb->set_requires_grad_sync(last || sync_every);
    mb->set_requires_all_reduce(last || sync_every);
    mb->set_is_last_backward(last);
  }
  return s;
}

TEST(MemoryModelTest, SteadyIsShardsOptimizerAndShardedGrads) {
  const MemoryBreakdown steady = MemoryModel(Units(), Mesh(2)).Steady();
  EXPECT_EQ(steady.shards, 350);
  EXPECT_EQ(steady.optimizer_state, 700);
  EXPECT_EQ(steady.sharded_grads, 350);
  EXPECT_EQ(steady.Total(), 1400);
}

// Replicated parameters are whole on every rank, with their optimizer state
// and gradients, and never gathered: 40 of layers.0's 100 bytes make its
// shard 30 + 40 on S = 2, and its gather 60.
TEST(MemoryModelTest, ReplicatedBytesAreHeldWhole) {
  UnitList units = Units();
  units[1].set_replicated_bytes(40);
  const MemoryModel model(units, Mesh(2));
  const MemoryBreakdown steady = model.Steady();
  EXPECT_EQ(steady.shards, 350 - 50 + 70);
  EXPECT_EQ(steady.optimizer_state, 2 * steady.shards);
  EXPECT_EQ(steady.sharded_grads, steady.shards);
  // Every gathered byte is 40 fewer at the default schedule's peak
  // (layers.1 and layers.0 unsharded, layers.0 not among the gradients yet).
  const MemoryBreakdown peak = model.PredictPeak(DefaultSchedule(), 0);
  EXPECT_EQ(peak.unsharded_params, 600 - 40);
}

// The peak is at layers.1's pre-backward: the root (unsharded all step),
// layers.1 and its prefetched layers.0 unsharded (600); the gradients of the
// root (alive through backward), layers.2 (its reduce-scatter in flight,
// sending from the gradient) and layers.1 (600); the reduce-scatter's scratch
// for the peer's half of layers.2 (50).
TEST(MemoryModelTest, DefaultScheduleHandComputed) {
  const MemoryModel model(Units(), Mesh(2));
  MemoryBreakdown peak = model.PredictPeak(DefaultSchedule(), 0);
  EXPECT_EQ(peak.unsharded_params, 600);
  EXPECT_EQ(peak.unsharded_grads, 600);
  EXPECT_EQ(peak.comm_buffers, 50);
  EXPECT_EQ(peak.activations, 0);
  EXPECT_EQ(peak.Total(), 2650);
  // 300 bytes of activations, 75 per unit: layers.2's are gone by then.
  peak = model.PredictPeak(DefaultSchedule(), 300);
  EXPECT_EQ(peak.activations, 225);
  EXPECT_EQ(peak.Total(), 2875);
}

// Hierarchical reshard on S = 4 in host groups of 2: each block keeps 2 of
// its 4 shards (50 bytes) from its forward until it is gathered again. With
// activations large enough to put the peak at layers.2's pre-backward
// (25000 per unit, none released yet): the root, layers.2 (prefetched
// there) and layers.1 unsharded (600), plus layers.0's host shard (50); the
// gradients of the root and layers.2 (500) either way.
TEST(MemoryModelTest, HostShardsLiveFromForwardToTheirGather) {
  const MemoryModel model(Units(), Mesh(4));
  hsdp::v1::StepSchedule within = DefaultSchedule();
  within.set_post_forward_group_size(2);
  const MemoryBreakdown plain = model.PredictPeak(DefaultSchedule(), 100000);
  const MemoryBreakdown host = model.PredictPeak(within, 100000);
  EXPECT_EQ(plain.activations, 100000);
  EXPECT_EQ(host.activations, 100000);
  EXPECT_EQ(plain.unsharded_params, 600);
  EXPECT_EQ(host.unsharded_params, 650);
  EXPECT_EQ(plain.unsharded_grads, 500);
  EXPECT_EQ(host.unsharded_grads, 500);
  // A group size that does not divide the shard group is not modelled.
  within.set_post_forward_group_size(3);
  EXPECT_EQ(model.PredictPeak(within, 100000).Total(), plain.Total());
}

TEST(MemoryModelTest, KeepingUnitsRaisesThePeakAtTheBoundary) {
  const MemoryModel model(Units(), Mesh(2));
  hsdp::v1::StepSchedule keep = DefaultSchedule();
  for (auto& u : *keep.mutable_units()) {
    u.set_reshard_after_forward(false);
    u.clear_backward_prefetch();
  }
  // Every unit unsharded when forward ends, plus the root's and layers.2's
  // gradients at layers.2's pre-backward: 700 + 500 + 1400, and activations.
  const MemoryBreakdown peak = model.PredictPeak(keep, 300);
  EXPECT_EQ(peak.unsharded_params, 700);
  EXPECT_EQ(peak.unsharded_grads, 500);
  EXPECT_EQ(peak.activations, 300);
  EXPECT_EQ(peak.Total(), 2900);
  EXPECT_GT(peak.Total(), model.PredictPeak(DefaultSchedule(), 300).Total());
}

// Without sync every unit's unsharded gradient survives into the next
// microbatch: the second backward holds all of them (700).
TEST(MemoryModelTest, NoSyncMicrobatchesAccumulateUnshardedGradients) {
  const MemoryModel model(Units(), Mesh(2));
  const MemoryBreakdown peak =
      model.PredictPeak(DefaultSchedule(2, /*sync_every=*/false), 0);
  EXPECT_EQ(peak.unsharded_grads, 700);
  EXPECT_EQ(peak.Total(), 2750);
  // Syncing every microbatch keeps it at the one-microbatch peak.
  EXPECT_EQ(model.PredictPeak(DefaultSchedule(2, true), 0).Total(), 2650);
}

// Comm fusion of layers.1 and layers.2 (default schedule otherwise): layers.1
// is gathered with layers.2 in forward and, at the root's backward prefetch,
// layers.1 with layers.2 in backward; the group's reduce-scatter waits for
// layers.1's backward, so at layers.0's pre-backward the root, layers.0, and
// layers.1 and 2 (in flight, sending from the gradients) hold gradients (700),
// the root and layers.0 are unsharded (500), and the scratch holds both
// members' peer halves (100).
TEST(MemoryModelTest, FusionKeepsAGroupsGradientsUntilItsLastMember) {
  const MemoryModel model(Units(), Mesh(2));
  hsdp::v1::StepSchedule fused = DefaultSchedule();
  hsdp::v1::FusionGroup* group = fused.add_fusion_groups();
  group->add_units(2);
  group->add_units(3);
  const MemoryBreakdown peak = model.PredictPeak(fused, 0);
  EXPECT_EQ(peak.unsharded_params, 500);
  EXPECT_EQ(peak.unsharded_grads, 700);
  EXPECT_EQ(peak.comm_buffers, 100);
  EXPECT_EQ(peak.Total(), 2700);
  EXPECT_GT(peak.Total(), model.PredictPeak(DefaultSchedule(), 0).Total());
  // One shard: nothing to gather or fuse.
  const MemoryModel single(Units(), Mesh(1));
  EXPECT_EQ(single.PredictPeak(fused, 0).Total(),
            single.PredictPeak(DefaultSchedule(), 0).Total());
  // The flat path with more than two shards reduce-scatters per unit, as the
  // engine does: the gradients peak as without fusion.
  const MemoryModel flat(Units(), Mesh(4, 1, CommPath::kFlat));
  EXPECT_EQ(flat.PredictPeak(fused, 0).unsharded_grads,
            flat.PredictPeak(DefaultSchedule(), 0).unsharded_grads);
}

TEST(MemoryModelTest, TransportsAndMeshes) {
  // HSDP: the reduce-scatter also needs the reduced chunk to all-reduce.
  EXPECT_EQ(MemoryModel(Units(), Mesh(2, 2))
                .PredictPeak(DefaultSchedule(), 0)
                .comm_buffers,
            100);
  // Flat path (NCCL): the gradients go into the staging buffer at once, and
  // one largest unit's buffer stays for reuse.
  const MemoryBreakdown flat = MemoryModel(Units(), Mesh(2, 1, CommPath::kFlat))
                                   .PredictPeak(DefaultSchedule(), 0);
  EXPECT_EQ(flat.comm_buffers, 400);
  EXPECT_EQ(flat.unsharded_grads, 500);
  EXPECT_EQ(flat.Total(), 2900);
  // One shard: the parameters are their shards, nothing to move.
  const MemoryBreakdown single =
      MemoryModel(Units(), Mesh(1)).PredictPeak(DefaultSchedule(), 0);
  EXPECT_EQ(single.unsharded_params, 0);
  EXPECT_EQ(single.comm_buffers, 0);
  EXPECT_EQ(single.shards, 700);
}

TEST(MemoryModelTest, EmptyScheduleMeansEngineDefaults) {
  const MemoryModel model(Units(), Mesh(2));
  // No prefetch, everything resharded (the root too): less than the default
  // plan's peak, more than the steady state.
  const int64_t peak = model.PredictPeak(hsdp::v1::StepSchedule(), 0).Total();
  EXPECT_GT(peak, model.Steady().Total());
  EXPECT_LE(peak, model.PredictPeak(DefaultSchedule(), 0).Total());
}

TEST(MemoryModelTest, BreakdownTotalAndText) {
  MemoryBreakdown b;
  b.shards = 1 << 20;
  b.other = 1 << 20;
  EXPECT_EQ(b.Total(), 2 << 20);
  EXPECT_NE(b.ToString().find("total 2.00 MiB"), std::string::npos)
      << b.ToString();
  EXPECT_NE(b.ToString().find("other 1.00"), std::string::npos);
}

}  // namespace
}  // namespace hsdp
