// Traced steps: the spans the engine records for the production planner's
// schedule match what it issued (counts per unit against the engine's own
// counters), carry their unit and microbatch, and nest on each track.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "tests/worker/fsdp/fsdp_test_util.h"
#include "worker/fsdp/trace_recorder.h"

namespace hsdp::fsdp::testing {
namespace {

struct Traced {
  std::vector<RecordedSpan> spans;  // of the traced (second) step
  EngineStats stats;                // of the same step
  std::vector<std::string> unit_names;
};

// Trains two steps on `shape`, tracing the second; returns rank 0's record.
Traced TraceStep(comm::MeshShape shape, RunConfig config) {
  config.dims.layers = 3;
  const StateDict init = MakeInitialState(config.dims, 31);
  Traced out;
  RunOnMesh(shape, [&](RankContext& ctx) {
    TinyTransformer model = MakeModel(config.dims, init);
    std::unique_ptr<Engine> engine = MakeEngine(model, ctx.comms(), config);
    torch::optim::AdamW optimizer(engine->Parameters());
    const v1::StepSchedule schedule = PlanSchedule(*engine, config);
    const int local = config.global_batch / shape.world_size();
    const int per_mb = local / config.microbatches;
    TraceRecorder recorder;
    for (int step = 0; step < 2; ++step) {
      engine->ResetStats();
      engine->SetTraceRecorder(step == 1 ? &recorder : nullptr);
      for (int mb = 0; mb < config.microbatches; ++mb) {
        ASSERT_TRUE(engine->Apply(schedule, mb).ok());
        auto [tokens, targets] =
            Batch(config.dims, step, ctx.rank * local + mb * per_mb, per_mb);
        at::Tensor loss = Loss(
            EngineForward(*engine, model, tokens, config.checkpoint), targets);
        loss.backward();
      }
      optimizer.step();
      optimizer.zero_grad();
    }
    engine->SetTraceRecorder(nullptr);
    if (ctx.rank == 0) {
      out.spans = recorder.Take();
      out.stats = engine->Stats();
      for (const UnitLayout& u : engine->Units())
        out.unit_names.push_back(u.name);
    }
  });
  return out;
}

int Count(const Traced& t, const std::string& name, const std::string& unit,
          SpanTrack track) {
  return static_cast<int>(
      std::count_if(t.spans.begin(), t.spans.end(), [&](const RecordedSpan& s) {
        return s.name == name && s.unit == unit && s.track == track;
      }));
}

// Two spans of one track either are disjoint or one contains the other.
void ExpectNested(const Traced& t, SpanTrack track) {
  std::vector<const RecordedSpan*> spans;
  for (const RecordedSpan& s : t.spans) {
    if (s.track == track) spans.push_back(&s);
  }
  for (size_t i = 0; i < spans.size(); ++i) {
    for (size_t j = i + 1; j < spans.size(); ++j) {
      const RecordedSpan& a = *spans[i];
      const RecordedSpan& b = *spans[j];
      const bool disjoint = a.end_ns <= b.begin_ns || b.end_ns <= a.begin_ns;
      const bool a_in_b = b.begin_ns <= a.begin_ns && a.end_ns <= b.end_ns;
      const bool b_in_a = a.begin_ns <= b.begin_ns && b.end_ns <= a.end_ns;
      EXPECT_TRUE(disjoint || a_in_b || b_in_a)
          << a.name << " " << a.unit << " [" << a.begin_ns << ", " << a.end_ns
          << "] overlaps " << b.name << " " << b.unit << " [" << b.begin_ns
          << ", " << b.end_ns << "]";
    }
  }
}

TEST(FsdpTraceTest, SpansMatchTheCollectivesIssuedPerUnit) {
  RunConfig config;
  config.microbatches = 2;
  config.prefetch = 1;
  const Traced t = TraceStep({2, 2}, config);
  ASSERT_EQ(t.unit_names.size(), t.stats.units.size());
  for (size_t u = 0; u < t.unit_names.size(); ++u) {
    const std::string& unit = t.unit_names[u];
    SCOPED_TRACE(unit);
    EXPECT_EQ(Count(t, "forward", unit, SpanTrack::kCompute), 2);
    EXPECT_EQ(Count(t, "backward", unit, SpanTrack::kCompute), 2);
    EXPECT_EQ(Count(t, "all-gather", unit, SpanTrack::kShardComm),
              t.stats.units[u].all_gathers);
    EXPECT_EQ(Count(t, "wait all-gather", unit, SpanTrack::kCompute),
              t.stats.units[u].all_gathers);
    EXPECT_EQ(Count(t, "reduce-scatter", unit, SpanTrack::kShardComm),
              t.stats.units[u].reduce_scatters);
    EXPECT_EQ(Count(t, "all-reduce", unit, SpanTrack::kReplicateComm),
              t.stats.units[u].all_reduces);
    EXPECT_GT(t.stats.units[u].all_gathers, 0);
    EXPECT_EQ(t.stats.units[u].reduce_scatters, 2);
    EXPECT_EQ(t.stats.units[u].all_reduces, 2);
  }
  for (const RecordedSpan& s : t.spans) {
    EXPECT_LE(s.begin_ns, s.end_ns) << s.name;
    EXPECT_TRUE(s.microbatch == 0 || s.microbatch == 1) << s.name;
  }
  ExpectNested(t, SpanTrack::kCompute);
  // One communicator runs one collective at a time.
  ExpectNested(t, SpanTrack::kShardComm);
  ExpectNested(t, SpanTrack::kReplicateComm);
}

TEST(FsdpTraceTest, EveryAllGatherWaitIsInsideItsUnitsCompute) {
  RunConfig config;
  config.prefetch = 1;
  const Traced t = TraceStep({1, 2}, config);
  int waits = 0;
  for (const RecordedSpan& w : t.spans) {
    if (w.name != "wait all-gather") continue;
    ++waits;
    const bool inside =
        std::any_of(t.spans.begin(), t.spans.end(), [&](const RecordedSpan& s) {
          return (s.name == "forward" || s.name == "backward") &&
                 s.unit == w.unit && s.begin_ns <= w.begin_ns &&
                 w.end_ns <= s.end_ns;
        });
    EXPECT_TRUE(inside) << "wait all-gather of " << w.unit;
  }
  EXPECT_GT(waits, 0);
}

TEST(FsdpTraceTest, RecomputeIsTracedApartFromForward) {
  RunConfig config;
  config.checkpoint = true;
  const Traced t = TraceStep({1, 2}, config);
  // Blocks run under Recompute: their forward runs again in backward.
  EXPECT_EQ(Count(t, "recompute", "layers.0", SpanTrack::kCompute), 1);
  EXPECT_EQ(Count(t, "forward", "layers.0", SpanTrack::kCompute), 1);
  ExpectNested(t, SpanTrack::kCompute);
}

TEST(FsdpTraceTest, NothingIsRecordedWithoutARecorder) {
  TraceRecorder recorder;
  RunConfig config;
  const StateDict init = MakeInitialState(config.dims, 32);
  RunOnMesh({1, 2}, [&](RankContext& ctx) {
    TinyTransformer model = MakeModel(config.dims, init);
    std::unique_ptr<Engine> engine = MakeEngine(model, ctx.comms(), config);
    engine->SetTraceRecorder(ctx.rank == 0 ? &recorder : nullptr);
    engine->SetTraceRecorder(nullptr);
    const v1::StepSchedule schedule = PlanSchedule(*engine, config);
    ASSERT_TRUE(engine->Apply(schedule, 0).ok());
    auto [tokens, targets] = Batch(config.dims, 0, ctx.rank * 4, 4);
    Loss(EngineForward(*engine, model, tokens, false), targets).backward();
  });
  EXPECT_TRUE(recorder.Take().empty());
}

TEST(TraceRecorderTest, DropsPastTheCapAndCountsThem) {
  TraceRecorder recorder;
  for (size_t i = 0; i < TraceRecorder::kMaxSpans + 3; ++i) {
    recorder.Add(RecordedSpan{"x", "", SpanTrack::kCompute, 0, 1, 2});
  }
  EXPECT_EQ(recorder.Take().size(), TraceRecorder::kMaxSpans);
  EXPECT_EQ(recorder.dropped(), 3);
  EXPECT_TRUE(recorder.Take().empty());
}

}  // namespace
}  // namespace hsdp::fsdp::testing
