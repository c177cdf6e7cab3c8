// Engine benchmarks, printed as ratios from one run:
//  1. step time of the engine vs plain unsharded LibTorch on the same GPT at
//  world 1
//     (target <= 1.10x);
//  2. per-rank parameter + gradient + optimizer bytes vs unsharded at world 2
//  and 4
//     (target <= 1/S + the largest unit);
//  3. the engine's fused all-gather / reduce-scatter of one unit vs raw Gloo
//  collectives of the
//     same bytes at world 2 (target >= 0.9x throughput);
//  4. step time and collectives per step at world 4 over the schedules the
//     coordinator's planner seals (default policy vs reshard after forward
//     off, each with and without comm fusion), over both transports side by
//     side;
//  5. step time with the timeline recorder on vs off (target <= 1.03x).
// Memory and collectives are measured over both transports of ranks on one
// host: Gloo TCP and shared memory (the default).
// Ranks are threads over loopback Gloo; one intra-op thread per rank.
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/policy.h"
#include "coordinator/planner.h"
#include "hsdp/device_mesh.h"
#include "hsdp/fully_shard.h"
#include "hsdp/models/gpt.h"
#include "hsdp/v1/schedule.pb.h"
#include "worker/comm/store/in_memory_store.h"
#include "worker/fsdp/collectives.h"
#include "worker/fsdp/planner_units.h"
#include "worker/fsdp/trace_recorder.h"
#include "worker/fsdp/unit_group.h"
#include "worker/models/gpt_setup.h"

namespace hsdp::fsdp {
namespace {

constexpr int kExitBadFlags = 2;
constexpr uint64_t kSeed = 1234;
constexpr int kWarmupSteps = 2;
constexpr double kAdamStatesPerParam = 2;  // exp_avg, exp_avg_sq
constexpr absl::Duration kCommTimeout = absl::Seconds(60);
// Padding rows (dim 0 rounded up to a multiple of S) may lift the steady ratio
// a little over 1/S.
constexpr double kPaddingSlack = 0.01;

struct Flags {
  std::string dims = "256,4,4,64";
  int batch = 4;
  int steps = 30;
  int collective_reps = 100;
  std::vector<int> shard_sizes = {2, 4};
  // Which of the sections above run (1 step, 2 memory, 3 collectives, 4
  // schedules).
  std::vector<std::string> sections = {"step", "memory", "collectives",
                                       "schedules", "trace"};
};

bool Runs(const Flags& flags, const std::string& section) {
  return std::find(flags.sections.begin(), flags.sections.end(), section) !=
         flags.sections.end();
}

double Seconds(const std::function<void()>& fn) {
  const auto start = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
      .count();
}

// The least time of interleaved repetitions: the machine is shared, and load
// spikes only ever add time.
double Best(const std::vector<double>& v) {
  return *std::min_element(v.begin(), v.end());
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The transports the engine's collectives can take between ranks of one host.
enum class Transport { kGlooTcp, kSharedMemory };

const char* TransportName(Transport t) {
  return t == Transport::kSharedMemory ? "shared memory" : "Gloo TCP";
}

// Runs fn(rank, mesh) on `world` threads forming a 1 x world mesh whose
// segment collectives (the engine's all-gathers and reduce-scatters) take
// `transport`.
void RunRanks(int world, Transport transport,
              const std::function<void(int, comm::DeviceMesh&)>& fn) {
  static int run = 0;
  const std::string prefix = absl::StrCat("fsdp-bench-", run++);
  comm::InMemoryStore store;
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      at::set_num_threads(1);
      comm::GlooDeviceOptions device;
      device.hostname = "127.0.0.1";
      auto mesh = comm::DeviceMesh::CreateGloo(
          comm::MeshShape{1, world}, rank, store, prefix, device, kCommTimeout,
          /*shared_memory=*/transport == Transport::kSharedMemory);
      if (!mesh.ok()) {
        std::cerr << "mesh: " << mesh.status() << "\n";
        std::exit(1);
      }
      fn(rank, **mesh);
    });
  }
  for (auto& t : threads) t.join();
}

// A GPT sharded by the engine: one unit per block plus root; blocks enter their
// unit.
struct ShardedGpt {
  models::Gpt model;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<torch::optim::AdamW> optimizer;

  ShardedGpt(const models::GptConfig& config, comm::DeviceMesh& mesh)
      : model(config, kSeed) {
    auto e =
        models::ShardGpt(model, MeshComms{&mesh.shard(), &mesh.replicate()});
    if (!e.ok()) Die(e.status());
    engine = std::move(*e);
    optimizer = std::make_unique<torch::optim::AdamW>(engine->Parameters());
  }

  // One step; with a schedule, applied first as hsdp-worker does (one
  // microbatch).
  void Step(const at::Tensor& tokens, const at::Tensor& targets,
            const hsdp::v1::StepSchedule* schedule = nullptr) {
    if (schedule != nullptr) {
      if (absl::Status s = engine->Apply(*schedule, 0); !s.ok()) Die(s);
    }
    at::Tensor loss = engine->Root().Forward(
        tokens, [&](const at::Tensor& t) { return model->Loss(t, targets); });
    loss.backward();
    optimizer->step();
    optimizer->zero_grad();
  }

  [[noreturn]] static void Die(const absl::Status& s) {
    std::cerr << "engine: " << s << "\n";
    std::exit(1);
  }
};

std::pair<at::Tensor, at::Tensor> Tokens(const models::GptConfig& config,
                                         int batch) {
  at::Tensor t = torch::randint(config.vocab_size, {batch, config.seq_len + 1},
                                torch::kLong);
  return {t.narrow(1, 0, config.seq_len).contiguous(),
          t.narrow(1, 1, config.seq_len).contiguous()};
}

void StepTime(const models::GptConfig& config, const Flags& flags) {
  torch::manual_seed(kSeed);
  at::Tensor tokens, targets;
  std::tie(tokens, targets) = Tokens(config, flags.batch);
  models::Gpt plain(config, kSeed);
  torch::optim::AdamW plain_opt(plain->parameters());
  auto plain_step = [&] {
    plain->Loss(tokens, targets).backward();
    plain_opt.step();
    plain_opt.zero_grad();
  };
  RunRanks(1, Transport::kGlooTcp, [&](int, comm::DeviceMesh& mesh) {
    ShardedGpt sharded(config, mesh);
    for (int i = 0; i < kWarmupSteps; ++i) {
      plain_step();
      sharded.Step(tokens, targets);
    }
    std::vector<double> plain_s, engine_s;
    for (int i = 0; i < flags.steps;
         ++i) {  // interleaved: both see the same machine load
      plain_s.push_back(Seconds(plain_step));
      engine_s.push_back(Seconds([&] { sharded.Step(tokens, targets); }));
    }
    const double ratio = Best(engine_s) / Best(plain_s);
    std::printf(
        "step time, world 1 (dims %s, batch %d, best of %d interleaved): "
        "plain %.1f ms, engine %.1f ms, ratio %.3fx (median ratio %.3fx) "
        "(target <= 1.10x) %s\n",
        flags.dims.c_str(), flags.batch, flags.steps, Best(plain_s) * 1e3,
        Best(engine_s) * 1e3, ratio, Median(engine_s) / Median(plain_s),
        ratio <= 1.10 ? "PASS" : "MISS");
  });
}

int64_t OptimizerStateBytes(torch::optim::AdamW& optimizer) {
  int64_t bytes = 0;
  for (const auto& [key, state] : optimizer.state()) {
    auto& s = static_cast<torch::optim::AdamWParamState&>(*state);
    for (const at::Tensor& t :
         {s.exp_avg(), s.exp_avg_sq(), s.max_exp_avg_sq()}) {
      if (t.defined()) bytes += t.numel() * t.element_size();
    }
  }
  return bytes;
}

void MemoryRatio(const models::GptConfig& config, const Flags& flags,
                 int shards, Transport transport) {
  RunRanks(shards, transport, [&](int rank, comm::DeviceMesh& mesh) {
    ShardedGpt sharded(config, mesh);
    at::Tensor tokens, targets;
    std::tie(tokens, targets) =
        Tokens(config, std::max(1, flags.batch / shards));
    // Grads are inspected before zero_grad: run forward/backward/step by hand.
    at::Tensor loss = sharded.engine->Root().Forward(
        tokens,
        [&](const at::Tensor& t) { return sharded.model->Loss(t, targets); });
    loss.backward();
    sharded.optimizer->step();
    const EngineStats stats = sharded.engine->Stats();
    int64_t numel = 0, largest_unit = 0;
    for (const UnitLayout& u : sharded.engine->Units()) {
      numel += u.numel;
      largest_unit = std::max(largest_unit, u.unsharded_bytes);
    }
    const double unsharded =
        numel * 4.0 * (2 + kAdamStatesPerParam);  // param+grad+adam
    const double steady = stats.sharded_bytes + stats.grad_bytes +
                          OptimizerStateBytes(*sharded.optimizer);
    // Transients alive at the same moment (the engine samples their sum after
    // every all-gather copy-out and reduce-scatter copy-in), not the sum of
    // separate peaks, which never coincide.
    const double peak = steady + stats.peak_transient_bytes;
    const double separate_peaks = steady + stats.peak_unsharded_bytes +
                                  stats.peak_unsharded_grad_bytes +
                                  stats.peak_comm_buffer_bytes;
    // The allowance: the largest unit unsharded, parameters and gradients.
    const double bound = 1.0 / shards + 2.0 * largest_unit / unsharded;
    if (rank == 0) {
      std::printf(
          "memory, world %d (1x%d, %s, prefetch depth 0, reshard after "
          "forward and backward): unsharded param+grad+AdamW %.2f MB, largest "
          "unit %.2f MB\n"
          "  steady: per-rank %.2f MB, ratio %.3f (target 1/S = %.3f) %s\n"
          "  peak: ratio %.3f = steady + transients alive together %.2f MB "
          "(unsharded params %.2f MB + unsharded grads %.2f MB + flat comm "
          "buffers %.2f MB); bound 1/S + largest unit (params+grads) = %.3f "
          "%s\n"
          "  (sum of the separate peaks, never alive together: ratio %.3f)\n",
          shards, shards, TransportName(transport), unsharded / 1e6,
          largest_unit / 1e6, steady / 1e6, steady / unsharded, 1.0 / shards,
          steady / unsharded <= 1.0 / shards + kPaddingSlack ? "PASS" : "MISS",
          peak / unsharded, stats.peak_transient_bytes / 1e6,
          stats.peak_transient_param_bytes / 1e6,
          stats.peak_transient_grad_bytes / 1e6,
          stats.peak_transient_comm_bytes / 1e6, bound,
          peak / unsharded <= bound ? "PASS" : "MISS",
          separate_peaks / unsharded);
    }
  });
}

void CollectiveThroughput(const models::GptConfig& config, const Flags& flags,
                          Transport transport) {
  constexpr int kWorld = 2;
  RunRanks(kWorld, transport, [&](int rank, comm::DeviceMesh& mesh) {
    ShardedGpt sharded(config, mesh);
    EngineCore& core = CoreOf(*sharded.engine);
    UnitGroup& unit = *core.units[1];  // a block: the largest unit
    const int64_t chunk = FlatChunkNumel(unit.params());
    const double bytes = chunk * kWorld * 4.0;
    // Raw Gloo: the same bytes in one flat buffer. The mesh's flat
    // collectives are Gloo's on either transport (shared memory carries only
    // the segment collectives).
    comm::Communicator& raw = mesh.shard();
    at::Tensor in = torch::randn({chunk}), out = torch::empty({chunk * kWorld});
    at::Tensor rs_in = torch::randn({chunk * kWorld}),
               rs_out = torch::empty({chunk});
    auto buffer = [](const at::Tensor& t) {
      return comm::Buffer{t.data_ptr(), t.numel(), comm::DataType::kFloat32};
    };
    std::vector<double> raw_ag, raw_rs, eng_ag, eng_rs, first_touch;
    // Each timed collective starts with both ranks in step: otherwise one
    // rank's local work before it (filling gradients) is charged to it.
    auto in_step = [&] { (void)raw.Barrier()->Wait(); };
    for (int i = 0; i < flags.collective_reps; ++i) {
      in_step();
      raw_ag.push_back(Seconds(
          [&] { (void)raw.AllGather(buffer(in), buffer(out))->Wait(); }));
      in_step();
      eng_ag.push_back(Seconds([&] {
        unit.WaitForUnshard();
        unit.Reshard();
      }));
      // The engine's share of an all-gather that raw Gloo, writing into a
      // buffer it reuses, does not pay: storage that reshard returned to the
      // system comes back as fresh pages (a fault and a zeroing per 4 KiB).
      first_touch.push_back(Seconds([&] {
        for (ShardedParam* p : unit.params()) {
          p->AllocUnsharded();
          p->unsharded_padded().zero_();
          p->FreeUnsharded();
        }
      }));
      in_step();
      raw_rs.push_back(Seconds([&] {
        (void)raw
            .ReduceScatter(buffer(rs_in), buffer(rs_out), comm::ReduceOp::kAvg)
            ->Wait();
      }));
      for (ShardedParam* p : unit.params()) {
        p->module_param().mutable_grad() =
            torch::randn(p->module_param().sizes());
      }
      unit.post_backward_done = false;
      in_step();
      eng_rs.push_back(Seconds([&] {
        unit.PostBackward();
        core.FinishPendingReductions();
      }));
    }
    if (rank == 0) {
      const double ag = Best(raw_ag) / Best(eng_ag),
                   rs = Best(raw_rs) / Best(eng_rs);
      std::printf(
          "collectives over %s, world 2, one block (%.2f MB gathered, best of "
          "%d interleaved; median ratios in brackets):\n"
          "  all-gather (unshard + reshard): engine %.1f MB/s vs raw Gloo "
          "%.1f MB/s = %.2fx [%.2fx] (target >= 0.9x) %s; of the engine's "
          "%.2f ms, first-touching the storage reshard returned takes %.2f "
          "ms\n"
          "  reduce-scatter (post-backward, into the sharded grads): engine "
          "%.1f MB/s vs raw Gloo %.1f MB/s = %.2fx [%.2fx] (target >= 0.9x) "
          "%s\n",
          TransportName(transport), bytes / 1e6, flags.collective_reps,
          bytes / Best(eng_ag) / 1e6, bytes / Best(raw_ag) / 1e6, ag,
          Median(raw_ag) / Median(eng_ag), ag >= 0.9 ? "PASS" : "MISS",
          Best(eng_ag) * 1e3, Best(first_touch) * 1e3,
          bytes / Best(eng_rs) / 1e6, bytes / Best(raw_rs) / 1e6, rs,
          Median(raw_rs) / Median(eng_rs), rs >= 0.9 ? "PASS" : "MISS");
    }
  });
}

// The schedules section 4 compares: the planner's for four policies
// (protobuf text: reshard after forward on and off, each with and without
// comm fusion), and the default policy as the planner sealed it before the root
// rule and the execution-order backward prefetch (the root resharded after
// forward and re-gathered at once by backward; unit i prefetching i-1 in
// backward, so the root's list missed the last block and unit 1 "prefetched"
// the unsharded root), for a before/after comparison in one run.
struct ScheduleVariant {
  const char* name;
  const char* policy;
  bool legacy = false;
};
constexpr ScheduleVariant kScheduleVariants[] = {
    {"default policy", ""},
    {"default, legacy planner", "", true},
    {"reshard_after_forward off", "reshard_after_forward: false"},
    // Comm fusion with a bucket over the default model's total bytes: every
    // unit's shard-group collectives in one group.
    {"default, comm fusion 64 MiB", "comm_fusion_bucket_bytes: 67108864"},
    {"raf off, comm fusion 64 MiB",
     "reshard_after_forward: false comm_fusion_bucket_bytes: 67108864"},
};

hsdp::v1::StepSchedule LegacySchedule(hsdp::v1::StepSchedule schedule) {
  for (int i = 0; i < schedule.units_size(); ++i) {
    hsdp::v1::UnitSchedule* u = schedule.mutable_units(i);
    if (i == 0) {
      u->set_reshard_after_forward(true);
      u->set_reshard_after_backward(true);
    }
    u->clear_backward_prefetch();
    if (i > 0) u->add_backward_prefetch(i - 1);
  }
  return schedule;
}

void ScheduledSteps(const models::GptConfig& config, const Flags& flags,
                    Transport transport) {
  constexpr int kWorld = 4;
  constexpr int kVariants = std::size(kScheduleVariants);
  std::vector<double> seconds[kVariants];
  std::vector<double> compute_seconds;
  UnitStats per_step[kVariants];
  RunRanks(kWorld, transport, [&](int rank, comm::DeviceMesh& mesh) {
    ShardedGpt sharded(config, mesh);
    // The compute floor: the same model and local batch, unsharded, no
    // communication, run by every rank at once (the same contention).
    models::Gpt plain(config, kSeed);
    torch::optim::AdamW plain_opt(plain->parameters());
    coordinator::Planner planner(PlannerUnits(*sharded.engine), kWorld);
    std::vector<hsdp::v1::StepSchedule> schedules;
    for (const ScheduleVariant& v : kScheduleVariants) {
      absl::StatusOr<hsdp::v1::Policy> policy = ParsePolicy(v.policy);
      if (!policy.ok()) ShardedGpt::Die(policy.status());
      hsdp::v1::StepSchedule schedule =
          planner.Plan(*policy, coordinator::PlanInput());
      schedules.push_back(v.legacy ? LegacySchedule(std::move(schedule))
                                   : std::move(schedule));
    }
    torch::manual_seed(kSeed + rank);
    at::Tensor tokens, targets;
    std::tie(tokens, targets) =
        Tokens(config, std::max(1, flags.batch / kWorld));
    auto plain_step = [&] {
      plain->Loss(tokens, targets).backward();
      plain_opt.step();
      plain_opt.zero_grad();
    };
    for (int i = 0; i < kWarmupSteps; ++i) {
      plain_step();
      for (const auto& schedule : schedules) {
        sharded.Step(tokens, targets, &schedule);
      }
    }
    for (int i = 0; i < flags.steps; ++i) {  // interleaved: same machine load
      (void)mesh.shard().Barrier()->Wait();
      const double compute = Seconds(plain_step);
      if (rank == 0) compute_seconds.push_back(compute);
      (void)mesh.shard().Barrier()->Wait();
      // Rotated each step: no variant always runs first after the floor.
      for (int k = 0; k < kVariants; ++k) {
        const int v = (i + k) % kVariants;
        sharded.engine->ResetStats();
        const double s =
            Seconds([&] { sharded.Step(tokens, targets, &schedules[v]); });
        if (rank != 0) continue;
        seconds[v].push_back(s);
        UnitStats total;
        for (const UnitStats& u : sharded.engine->Stats().units) {
          total.all_gathers += u.all_gathers;
          total.reduce_scatters += u.reduce_scatters;
        }
        per_step[v] = total;
      }
    }
  });
  std::printf(
      "steps over the planner's schedules, world 4 (1x4, %s, batch %d, "
      "median of %d interleaved; compute floor: plain LibTorch on the local "
      "batch, no communication, %.1f ms):\n",
      TransportName(transport), flags.batch, flags.steps,
      Median(compute_seconds) * 1e3);
  for (int v = 0; v < kVariants; ++v) {
    std::printf(
        "  %-26s %8.1f ms (x %.3f of the default policy), %ld all-gathers, "
        "%ld reduce-scatters per step\n",
        kScheduleVariants[v].name, Median(seconds[v]) * 1e3,
        Median(seconds[v]) / Median(seconds[0]),
        static_cast<long>(per_step[v].all_gathers),
        static_cast<long>(per_step[v].reduce_scatters));
  }
}

// Step time with the timeline recorder on (hsdpctl trace) against off, on the
// default policy's schedule, interleaved.
void TracedSteps(const models::GptConfig& config, const Flags& flags,
                 Transport transport) {
  constexpr int kWorld = 4;
  std::vector<double> off, on;
  size_t spans_per_step = 0;
  RunRanks(kWorld, transport, [&](int rank, comm::DeviceMesh& mesh) {
    ShardedGpt sharded(config, mesh);
    coordinator::Planner planner(PlannerUnits(*sharded.engine), kWorld);
    const hsdp::v1::StepSchedule schedule =
        planner.Plan(hsdp::v1::Policy(), coordinator::PlanInput());
    torch::manual_seed(kSeed + rank);
    at::Tensor tokens, targets;
    std::tie(tokens, targets) =
        Tokens(config, std::max(1, flags.batch / kWorld));
    TraceRecorder recorder;
    auto step = [&](bool traced) {
      sharded.engine->SetTraceRecorder(traced ? &recorder : nullptr);
      const double s =
          Seconds([&] { sharded.Step(tokens, targets, &schedule); });
      sharded.engine->SetTraceRecorder(nullptr);
      const size_t n = recorder.Take().size();
      if (traced && rank == 0) spans_per_step = n;
      return s;
    };
    for (int i = 0; i < kWarmupSteps; ++i) step(i % 2 == 0);
    for (int i = 0; i < flags.steps; ++i) {
      for (int k = 0; k < 2; ++k) {  // alternating which runs first
        const bool traced = (i + k) % 2 == 1;
        (void)mesh.shard().Barrier()->Wait();
        const double s = step(traced);
        if (rank == 0) (traced ? on : off).push_back(s);
      }
    }
  });
  const double ratio = Median(on) / Median(off);
  std::printf(
      "tracing, world 4 (1x4, %s, batch %d, median of %d interleaved): "
      "recorder off %.1f ms, on %.1f ms (%zu spans per rank-step): x %.3f "
      "(target <= 1.03) %s; off costs one pointer test per hook\n",
      TransportName(transport), flags.batch, flags.steps, Median(off) * 1e3,
      Median(on) * 1e3, spans_per_step, ratio, ratio <= 1.03 ? "PASS" : "MISS");
}

}  // namespace
}  // namespace hsdp::fsdp

int main(int argc, char** argv) {
  hsdp::fsdp::Flags flags;
  CLI::App app{
      "Sharding engine benchmarks: step time, memory, collectives (ratios)"};
  app.add_option("--dims", flags.dims, "GPT d_model,n_layers,n_heads,seq_len");
  app.add_option("--batch", flags.batch, "global batch (sequences)")
      ->check(CLI::PositiveNumber);
  app.add_option("--steps", flags.steps, "timed steps per side")
      ->check(CLI::PositiveNumber);
  app.add_option("--collective-reps", flags.collective_reps,
                 "timed collectives per kind")
      ->check(CLI::PositiveNumber);
  app.add_option("--shard-sizes", flags.shard_sizes,
                 "worlds for the memory ratio")
      ->delimiter(',');
  app.add_option("--sections", flags.sections,
                 "sections to run: step,memory,collectives,schedules,trace")
      ->delimiter(',');
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << "fsdp_bench: " << e.what() << "\n";
    return hsdp::fsdp::kExitBadFlags;
  }
  auto config = hsdp::models::GptConfigFromDims(flags.dims);
  if (!config.ok()) {
    std::cerr << "fsdp_bench: --dims: " << config.status().message() << "\n";
    return hsdp::fsdp::kExitBadFlags;
  }
  at::set_num_threads(1);
  using hsdp::fsdp::Runs;
  using hsdp::fsdp::Transport;
  if (Runs(flags, "step")) hsdp::fsdp::StepTime(*config, flags);
  for (Transport t : {Transport::kSharedMemory, Transport::kGlooTcp}) {
    if (!Runs(flags, "memory")) break;
    for (int s : flags.shard_sizes)
      hsdp::fsdp::MemoryRatio(*config, flags, s, t);
  }
  for (Transport t : {Transport::kGlooTcp, Transport::kSharedMemory}) {
    if (Runs(flags, "collectives"))
      hsdp::fsdp::CollectiveThroughput(*config, flags, t);
  }
  for (Transport t : {Transport::kSharedMemory, Transport::kGlooTcp}) {
    if (Runs(flags, "schedules")) hsdp::fsdp::ScheduledSteps(*config, flags, t);
  }
  if (Runs(flags, "trace")) {
    hsdp::fsdp::TracedSteps(*config, flags, Transport::kSharedMemory);
  }
  return 0;
}
