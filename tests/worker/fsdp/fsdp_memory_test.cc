// The memory meter (worker/fsdp/memory_meter.h), the engine's accounting in
// the memory model's categories, the model's prediction against the
// measurement, and the planner's memory budget closing the loop in-process.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/memory_model.h"
#include "coordinator/planner.h"
#include "tests/worker/fsdp/fsdp_test_util.h"
#include "worker/fsdp/memory_meter.h"
#include "worker/fsdp/planner_units.h"

namespace hsdp::fsdp::testing {
namespace {

constexpr int64_t kMiB = 1 << 20;
const c10::Device kCpu(c10::kCPU);

TEST(MemoryMeterTest, CountsEveryTensorOfThisThreadWhereverItIsFreed) {
  InstallCountingCpuAllocator();
  ASSERT_TRUE(CountingCpuAllocatorInstalled());
  ScopedMemoryTally tally;
  const int64_t before = MeterCurrentBytes(kCpu).value();
  ResetMeterPeak(kCpu);
  {
    at::Tensor t = at::empty({kMiB}, at::kByte);
    EXPECT_EQ(MeterCurrentBytes(kCpu).value(), before + kMiB);
    // Another rank thread counts apart.
    std::thread other([] {
      ScopedMemoryTally theirs;
      at::Tensor big = at::empty({4 * kMiB}, at::kByte);
      EXPECT_EQ(MeterCurrentBytes(kCpu).value(), 4 * kMiB);
    });
    other.join();
    EXPECT_EQ(MeterCurrentBytes(kCpu).value(), before + kMiB);
    // Freed on another thread: given back to this thread's tally.
    std::thread freer([t = std::move(t)]() mutable { t.reset(); });
    freer.join();
  }
  EXPECT_EQ(MeterCurrentBytes(kCpu).value(), before);
  EXPECT_EQ(MeterPeakBytes(kCpu).value(), before + kMiB);
  ResetMeterPeak(kCpu);
  EXPECT_EQ(MeterPeakBytes(kCpu).value(), before);
  // Storage the engine frees and refills goes through it too.
  at::Tensor u = at::empty({256}, at::kFloat);
  EXPECT_EQ(MeterCurrentBytes(kCpu).value(), before + 1024);
}

TEST(MemoryMeterTest, MeasuredPeakFallsBackToTheEnginesAccounting) {
  EngineStats stats;
  stats.peak_memory.shards = 100;
  stats.peak_memory.activations = 50;
  stats.measured_peak_bytes = -1;
  EXPECT_EQ(MeasuredPeakBytes(stats), 150);
  stats.measured_peak_bytes = 400;
  EXPECT_EQ(MeasuredPeakBytes(stats), 400);
}

// Blocks whose parameters outweigh the activations of a small batch, so the
// parameter-state terms the planner chooses between dominate the peak.
ModelDims BigDims() {
  ModelDims dims;
  dims.d_model = 64;
  dims.hidden = 256;
  dims.layers = 4;
  return dims;
}

constexpr int kShards = 2;

// One rank's sharded model, stepping with given schedules. Build it after the
// rank's ScopedMemoryTally.
struct Rank {
  Rank(const RunConfig& config, const StateDict& init, MeshComms comms)
      : config(config),
        model(MakeModel(config.dims, init)),
        engine(MakeEngine(model, comms, config)),
        optimizer(engine->Parameters()) {}

  EngineStats Step(const v1::StepSchedule& schedule, int step, int rank,
                   int batch) {
    engine->ResetStats();
    const int micro = std::max(1, schedule.microbatches_size());
    for (int mb = 0; mb < micro; ++mb) {
      EXPECT_TRUE(engine->Apply(schedule, mb).ok());
      auto [tokens, targets] =
          Batch(config.dims, step, (rank * micro + mb) * batch, batch);
      (Loss(EngineForward(*engine, model, tokens, false), targets) / micro)
          .backward();
    }
    const EngineStats stats = engine->Stats();  // before the optimizer step
    optimizer.step();
    optimizer.zero_grad();
    return stats;
  }

  RunConfig config;
  TinyTransformer model;
  std::unique_ptr<Engine> engine;
  torch::optim::AdamW optimizer;
};

TEST(EngineMemoryTest, ActivationsAndPeakMeasuredAndPredicted) {
  InstallCountingCpuAllocator();
  RunConfig config;
  config.dims = BigDims();
  config.prefetch = 1;
  const StateDict init = MakeInitialState(config.dims, 40);
  std::vector<EngineStats> small(kShards), large(kShards);
  std::vector<int64_t> predicted(kShards);
  RunOnMesh({1, kShards}, [&](RankContext& ctx) {
    ScopedMemoryTally tally;
    Rank r(config, init, ctx.comms());
    const v1::StepSchedule schedule = PlanSchedule(*r.engine, config);
    r.Step(schedule, 0, ctx.rank, 2);  // creates the optimizer state
    small[ctx.rank] = r.Step(schedule, 1, ctx.rank, 2);
    large[ctx.rank] = r.Step(schedule, 2, ctx.rank, 8);
    const MemoryModel model(PlannerUnits(*r.engine),
                            MemoryModel::Options{kShards, 1});
    predicted[ctx.rank] =
        model.PredictPeak(schedule, small[ctx.rank].activation_bytes).Total();
  });
  for (int rank = 0; rank < kShards; ++rank) {
    const EngineStats& s = small[rank];
    SCOPED_TRACE(absl::StrCat(
        "rank ", rank, ": accounting ", s.peak_memory.ToString(), "; measured ",
        s.measured_peak_bytes, ", predicted ", predicted[rank]));
    ASSERT_GT(s.activation_bytes, 0);
    // Four times the batch: about four times the activations (attention and
    // the head grow with it; a little is per step, not per sample).
    const double growth =
        static_cast<double>(large[rank].activation_bytes) / s.activation_bytes;
    EXPECT_GT(growth, 3.0);
    EXPECT_LT(growth, 4.5);
    // The measurement sees at least what the engine holds all step long plus
    // the optimizer state; the accounting's steady parts are exact.
    EXPECT_GE(s.measured_peak_bytes, s.peak_memory.shards +
                                         s.peak_memory.optimizer_state +
                                         s.peak_memory.sharded_grads);
    EXPECT_EQ(s.peak_memory.shards, s.sharded_bytes);
    EXPECT_EQ(s.peak_memory.activations, s.activation_bytes);
    EXPECT_EQ(MeasuredPeakBytes(s), s.measured_peak_bytes);
    // The model, fed the measured activations, predicts the measured peak
    // within 10% (what it does not model: autograd's temporaries in backward,
    // the batch itself).
    EXPECT_NEAR(static_cast<double>(predicted[rank]),
                static_cast<double>(s.measured_peak_bytes),
                0.10 * s.measured_peak_bytes);
  }
}

// Comm fusion, every unit in one group: the larger buffers (one scratch for
// every unit's peer halves) and the gradients the group holds until its last
// member's backward are in the engine's accounting, and the memory model,
// fed the measured activations, predicts the fused step's measured peak as
// it does an unfused one's. Over Gloo TCP, whose reduce-scatter takes a
// scratch buffer.
TEST(EngineMemoryTest, FusionBuffersCountedAndPredicted) {
  InstallCountingCpuAllocator();
  RunConfig config;
  config.dims = BigDims();
  config.prefetch = 1;
  RunConfig fused = config;
  fused.comm_fusion_bucket_bytes = int64_t{1} << 30;
  const StateDict init = MakeInitialState(config.dims, 42);
  std::vector<EngineStats> plain(kShards), all(kShards);
  std::vector<int64_t> predicted_plain(kShards), predicted_fused(kShards);
  RunOnMesh(
      {1, kShards},
      [&](RankContext& ctx) {
        ScopedMemoryTally tally;
        Rank r(config, init, ctx.comms());
        const v1::StepSchedule alone = PlanSchedule(*r.engine, config);
        const v1::StepSchedule together = PlanSchedule(*r.engine, fused);
        EXPECT_EQ(together.fusion_groups_size(), 1);
        r.Step(alone, 0, ctx.rank, 2);  // creates the optimizer state
        plain[ctx.rank] = r.Step(alone, 1, ctx.rank, 2);
        all[ctx.rank] = r.Step(together, 2, ctx.rank, 2);
        const MemoryModel model(PlannerUnits(*r.engine),
                                MemoryModel::Options{kShards, 1});
        predicted_plain[ctx.rank] =
            model.PredictPeak(alone, plain[ctx.rank].activation_bytes).Total();
        predicted_fused[ctx.rank] =
            model.PredictPeak(together, all[ctx.rank].activation_bytes).Total();
      },
      absl::Seconds(30), /*shared_memory=*/false);
  for (int rank = 0; rank < kShards; ++rank) {
    const EngineStats& p = plain[rank];
    const EngineStats& f = all[rank];
    SCOPED_TRACE(absl::StrCat(
        "rank ", rank, ": fused ", f.peak_memory.ToString(), ", measured ",
        f.measured_peak_bytes, ", predicted ", predicted_fused[rank],
        "; alone ", p.peak_memory.ToString(), ", measured ",
        p.measured_peak_bytes, ", predicted ", predicted_plain[rank]));
    EXPECT_LT(f.all_gathers, p.all_gathers);
    EXPECT_EQ(f.reduce_scatters, 1);
    EXPECT_GT(f.peak_comm_buffer_bytes, p.peak_comm_buffer_bytes);
    EXPECT_GT(f.peak_memory.comm_buffers, p.peak_memory.comm_buffers);
    EXPECT_GT(f.peak_memory.unsharded_grads, p.peak_memory.unsharded_grads);
    EXPECT_GT(f.measured_peak_bytes, p.measured_peak_bytes);
    EXPECT_GT(predicted_fused[rank], predicted_plain[rank]);
    EXPECT_NEAR(static_cast<double>(predicted_fused[rank]),
                static_cast<double>(f.measured_peak_bytes),
                0.10 * f.measured_peak_bytes);
  }
}

// Hierarchical reshard on four shards in host groups of two: each block
// keeps half of its gathered parameters (its host shard) from its forward to
// its backward. The engine counts them with the unsharded parameters, whose
// peak lies between the fully resharded and the never resharded plans', and
// the memory model, fed the measured activations, predicts the
// measured peak as it does the others'.
TEST(EngineMemoryTest, HostShardsCountedAndPredicted) {
  InstallCountingCpuAllocator();
  constexpr int kHostShards = 4;
  constexpr int kHostGroup = 2;
  RunConfig config;
  config.dims = BigDims();
  RunConfig within = config;
  within.within_host_group = kHostGroup;
  RunConfig kept = config;
  kept.reshard_after_forward = false;
  const StateDict init = MakeInitialState(config.dims, 43);
  struct Peaks {
    EngineStats stats;
    int64_t predicted = 0;
  };
  std::vector<std::vector<Peaks>> out(3, std::vector<Peaks>(kHostShards));
  RunOnMesh(
      {1, kHostShards},
      [&](RankContext& ctx) {
        ScopedMemoryTally tally;
        Rank r(config, init, ctx.comms());
        const MemoryModel model(PlannerUnits(*r.engine),
                                MemoryModel::Options{kHostShards, 1});
        const v1::StepSchedule schedules[3] = {PlanSchedule(*r.engine, config),
                                               PlanSchedule(*r.engine, within),
                                               PlanSchedule(*r.engine, kept)};
        EXPECT_EQ(schedules[1].post_forward_group_size(), kHostGroup);
        r.Step(schedules[0], 0, ctx.rank, 2);  // creates the optimizer state
        for (int i = 0; i < 3; ++i) {
          Peaks& p = out[i][ctx.rank];
          p.stats = r.Step(schedules[i], 1 + i, ctx.rank, 2);
          p.predicted =
              model.PredictPeak(schedules[i], p.stats.activation_bytes).Total();
        }
      },
      absl::Seconds(30), /*shared_memory=*/false, kHostGroup);
  for (int rank = 0; rank < kHostShards; ++rank) {
    const Peaks& full = out[0][rank];
    const Peaks& host = out[1][rank];
    const Peaks& none = out[2][rank];
    SCOPED_TRACE(absl::StrCat(
        "rank ", rank, ": within host ", host.stats.peak_memory.ToString(),
        ", measured ", host.stats.measured_peak_bytes, ", predicted ",
        host.predicted, "; resharded ", full.stats.peak_memory.ToString(),
        ", measured ", full.stats.measured_peak_bytes, ", predicted ",
        full.predicted));
    EXPECT_EQ(host.stats.host_all_gathers, config.dims.layers);
    EXPECT_EQ(full.stats.host_all_gathers, 0);
    EXPECT_EQ(host.stats.unsharded_bytes_alive, 0);
    EXPECT_GT(host.stats.peak_unsharded_bytes, full.stats.peak_unsharded_bytes);
    EXPECT_LT(host.stats.peak_unsharded_bytes, none.stats.peak_unsharded_bytes);
    EXPECT_GT(host.predicted, full.predicted);
    EXPECT_LT(host.predicted, none.predicted);
    EXPECT_NEAR(static_cast<double>(host.predicted),
                static_cast<double>(host.stats.measured_peak_bytes),
                0.10 * host.stats.measured_peak_bytes);
  }
}

// The planner's memory budget, closed in-process: measured peaks fed back into
// the planner (max over ranks, as the coordinator does) bring every peak under
// a budget between the all-resharded and the none-resharded peaks within a few
// steps, with fewer all-gathers than all-resharded; a budget lowered below the
// peak it settled at is met too.
TEST(EngineMemoryTest, MemoryBudgetHoldsWithMeasuredPeaks) {
  InstallCountingCpuAllocator();
  constexpr int kBatch = 2;
  constexpr int kSettleSteps = 3;
  constexpr int kCheckedSteps = 4;
  RunConfig config;
  config.dims = BigDims();
  config.prefetch = 1;
  const StateDict init = MakeInitialState(config.dims, 41);
  int64_t shared_peaks[kShards] = {0, 0};
  int64_t shared_activations[kShards] = {0, 0};
  struct Outcome {
    int64_t least = 0, most = 0, budget = 0, lower = 0;
    int64_t least_gathers = 0;
    std::vector<int64_t> peaks, lowered_peaks, gathers;
  } out;
  RunOnMesh({1, kShards}, [&](RankContext& ctx) {
    ScopedMemoryTally tally;
    Rank r(config, init, ctx.comms());
    coordinator::Planner planner(PlannerUnits(*r.engine), kShards);
    auto barrier = [&] {
      ASSERT_TRUE(ctx.mesh->shard().Barrier()->Wait().ok());
    };
    int64_t step = 0;
    // Runs the planner's schedule for `policy` once and feeds the max over
    // ranks of the measured peak back; returns it and the all-gathers.
    auto run = [&](const v1::Policy& policy) {
      const v1::StepSchedule schedule = planner.Plan(policy, {step, 1, 0});
      const EngineStats s = r.Step(schedule, step, ctx.rank, kBatch);
      shared_peaks[ctx.rank] = MeasuredPeakBytes(s);
      shared_activations[ctx.rank] = s.activation_bytes;
      barrier();
      const int64_t peak = *std::max_element(shared_peaks, shared_peaks + 2);
      planner.ObservePeakMemory(
          step, peak,
          *std::max_element(shared_activations, shared_activations + 2));
      barrier();
      ++step;
      return std::make_pair(peak, s.all_gathers);
    };
    v1::Policy all_resharded, none_resharded, budget;
    none_resharded.set_reshard_after_forward(false);
    run(all_resharded);  // the optimizer state appears
    const auto least = run(all_resharded);
    const auto most = run(none_resharded);
    budget.set_memory_budget_bytes((least.first + most.first) / 2);
    std::vector<int64_t> peaks, gathers;
    for (int i = 0; i < kSettleSteps + kCheckedSteps; ++i) {
      const auto [peak, n] = run(budget);
      if (i >= kSettleSteps) {
        peaks.push_back(peak);
        gathers.push_back(n);
      }
    }
    // Lowered below the peak the first budget settled at: the plan must change.
    v1::Policy lower;
    lower.set_memory_budget_bytes(
        (least.first + *std::max_element(peaks.begin(), peaks.end())) / 2);
    std::vector<int64_t> lowered;
    for (int i = 0; i < kSettleSteps + kCheckedSteps; ++i) {
      const auto [peak, n] = run(lower);
      if (i >= kSettleSteps) lowered.push_back(peak);
    }
    if (ctx.rank == 0) {
      out = Outcome{least.first,
                    most.first,
                    budget.memory_budget_bytes(),
                    lower.memory_budget_bytes(),
                    least.second,
                    peaks,
                    lowered,
                    gathers};
    }
  });
  SCOPED_TRACE(absl::StrCat("least ", out.least, ", most ", out.most,
                            ", budget ", out.budget, ", lowered ", out.lower));
  // The budget lies strictly between the two peaks: the test means something.
  ASSERT_GT(out.most - out.least, 4 * kShards * 1024);
  for (int64_t peak : out.peaks) EXPECT_LE(peak, out.budget);
  for (int64_t n : out.gathers) EXPECT_LT(n, out.least_gathers);
  ASSERT_GT(out.peaks.back(), out.lower);
  for (int64_t peak : out.lowered_peaks) EXPECT_LE(peak, out.lower);
}

}  // namespace
}  // namespace hsdp::fsdp::testing
