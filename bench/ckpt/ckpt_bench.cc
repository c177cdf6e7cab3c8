// Checkpoint costs, measured side by side in one run (ranks are threads over
// loopback Gloo, one intra-op thread each, a GPT under the engine with AdamW):
//   1. step time of a checkpoint step against a normal step at R x S, the
//      checkpoint written on the training thread (sync) and in the background
//      (async), through the runner's path (train::Checkpointing);
//   2. load time at another mesh against the same mesh, and bytes read per
//      rank against the minimum (its own rows).
// Repetitions are interleaved and the least time kept: the machine is shared
// and load only ever adds time.
#include <glog/logging.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "hsdp/device_mesh.h"
#include "hsdp/fully_shard.h"
#include "hsdp/models/gpt.h"
#include "worker/comm/store/in_memory_store.h"
#include "worker/models/gpt_setup.h"
#include "worker/train/checkpointing.h"
#include "worker/train/worker_mesh.h"

namespace hsdp::ckpt {
namespace {

constexpr uint64_t kSeed = 1234;
constexpr absl::Duration kCommTimeout = absl::Seconds(120);

struct Flags {
  std::string model = "gpt-small";
  std::string mesh = "2x2";
  std::string load_mesh = "1x3";
  int batch = 2;   // samples per rank per step
  int rounds = 5;  // interleaved (normal, sync, normal, async, normal)
  std::string dir = "/tmp/hsdp-ckpt-bench";
};

comm::MeshShape ParseMesh(const std::string& s) {
  std::vector<std::string> p = absl::StrSplit(s, 'x');
  return comm::MeshShape{std::stoi(p.at(0)), std::stoi(p.at(1))};
}

[[noreturn]] void Die(const absl::Status& s) {
  std::cerr << "ckpt_bench: " << s << "\n";
  std::exit(1);
}

void RunRanks(comm::MeshShape shape,
              const std::function<void(int, comm::DeviceMesh&)>& fn) {
  static int run = 0;
  const std::string prefix = absl::StrCat("ckpt-bench-", run++);
  comm::InMemoryStore store;
  std::vector<std::thread> threads;
  for (int rank = 0; rank < shape.world_size(); ++rank) {
    threads.emplace_back([&, rank] {
      at::set_num_threads(1);
      comm::GlooDeviceOptions device;
      device.hostname = "127.0.0.1";
      auto mesh = comm::DeviceMesh::CreateGloo(shape, rank, store, prefix,
                                               device, kCommTimeout, true);
      if (!mesh.ok()) Die(mesh.status());
      fn(rank, **mesh);
    });
  }
  for (auto& t : threads) t.join();
}

struct ShardedGpt {
  models::Gpt model;
  std::unique_ptr<fsdp::Engine> engine;
  std::unique_ptr<torch::optim::AdamW> optimizer;

  ShardedGpt(const models::GptConfig& config, comm::DeviceMesh& mesh,
             uint64_t seed)
      : model(config, seed) {
    auto e = models::ShardGpt(
        model, fsdp::MeshComms{&mesh.shard(), &mesh.replicate()});
    if (!e.ok()) Die(e.status());
    engine = std::move(*e);
    optimizer = std::make_unique<torch::optim::AdamW>(engine->Parameters());
  }

  void Step(const models::GptConfig& config, int batch) {
    at::Tensor t = torch::randint(config.vocab_size,
                                  {batch, config.seq_len + 1}, torch::kLong);
    at::Tensor tokens = t.narrow(1, 0, config.seq_len).contiguous();
    at::Tensor targets = t.narrow(1, 1, config.seq_len).contiguous();
    at::Tensor loss = engine->Root().Forward(
        tokens, [&](const at::Tensor& x) { return model->Loss(x, targets); });
    loss.backward();
    optimizer->step();
    optimizer->zero_grad();
  }
};

double Now() {
  return std::chrono::duration<double>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

train::CheckpointingOptions Options(const Flags& flags, bool async,
                                    const std::string& dir) {
  train::CheckpointingOptions o;
  o.root = dir;
  o.async = async;
  o.keep = 1;
  o.model_name = flags.model;
  o.seed = kSeed;
  return o;
}

void StepTimes(const models::GptConfig& config, const Flags& flags) {
  const comm::MeshShape shape = ParseMesh(flags.mesh);
  std::vector<double> normal, sync, async, after_async;
  RunRanks(shape, [&](int rank, comm::DeviceMesh& mesh) {
    ShardedGpt gpt(config, mesh, kSeed);
    const c10::Device cpu(c10::kCPU);
    train::Checkpointing sync_ckpt(Options(flags, false, flags.dir + "/sync"),
                                   mesh, cpu);
    train::Checkpointing async_ckpt(Options(flags, true, flags.dir + "/async"),
                                    mesh, cpu);
    int64_t step = 0;
    auto timed = [&](std::vector<double>* out, train::Checkpointing* c) {
      const double t0 = Now();
      gpt.Step(config, flags.batch);
      if (c != nullptr) {
        absl::Status s = c->Save(step, *gpt.engine, *gpt.optimizer, 0, 0);
        if (!s.ok()) Die(s);
      }
      ++step;
      // Every rank finished the step (and its part of the save): normal steps
      // absorb the ranks' skew as the save's own barrier does.
      if (auto b = train::MeshAverage(mesh, 0.0, cpu); !b.ok()) Die(b.status());
      const double dt = Now() - t0;
      if (rank == 0 && out != nullptr) out->push_back(dt);
    };
    for (int w = 0; w < 2; ++w) timed(nullptr, nullptr);  // warm-up
    for (int r = 0; r < flags.rounds; ++r) {
      timed(&normal, nullptr);
      timed(&sync, &sync_ckpt);
      timed(&normal, nullptr);
      timed(&async, &async_ckpt);
      timed(&after_async, nullptr);  // runs while the write is in flight
      if (absl::Status s = async_ckpt.Finish(); !s.ok()) Die(s);
    }
  });
  auto best = [](const std::vector<double>& v) {
    return *std::min_element(v.begin(), v.end());
  };
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::printf(
      "== checkpoint step vs normal step: %s at %s, batch %d per rank, %d "
      "rounds ==\n",
      config.name.c_str(), flags.mesh.c_str(), flags.batch, flags.rounds);
  std::printf("normal step        best %8.1f ms  median %8.1f ms\n",
              best(normal) * 1e3, median(normal) * 1e3);
  std::printf(
      "sync checkpoint    best %8.1f ms  median %8.1f ms  ratio %.2f (medians "
      "%.2f)\n",
      best(sync) * 1e3, median(sync) * 1e3, best(sync) / best(normal),
      median(sync) / median(normal));
  std::printf(
      "async checkpoint   best %8.1f ms  median %8.1f ms  ratio %.2f (medians "
      "%.2f)\n",
      best(async) * 1e3, median(async) * 1e3, best(async) / best(normal),
      median(async) / median(normal));
  std::printf(
      "step after async   best %8.1f ms  median %8.1f ms  ratio %.2f  (the "
      "write in flight shares the cores)\n",
      best(after_async) * 1e3, median(after_async) * 1e3,
      best(after_async) / best(normal));
}

void LoadTimes(const models::GptConfig& config, const Flags& flags) {
  const comm::MeshShape saved = ParseMesh(flags.mesh);
  const comm::MeshShape other = ParseMesh(flags.load_mesh);
  const std::string dir = flags.dir + "/load";
  std::filesystem::remove_all(dir);
  RunRanks(saved, [&](int, comm::DeviceMesh& mesh) {
    ShardedGpt gpt(config, mesh, kSeed);
    gpt.Step(config, flags.batch);
    train::Checkpointing c(Options(flags, false, dir), mesh, c10::kCPU);
    if (absl::Status s = c.Save(0, *gpt.engine, *gpt.optimizer, 0, 0);
        !s.ok()) {
      Die(s);
    }
  });
  // Per mesh: the largest ratio over ranks of bytes read to bytes needed.
  std::map<std::string, double> excess;
  absl::Mutex mu;
  auto load = [&](comm::MeshShape shape) {
    std::atomic<double> slowest{0};
    RunRanks(shape, [&](int, comm::DeviceMesh& mesh) {
      ShardedGpt gpt(config, mesh, kSeed + 1);
      train::Checkpointing c(Options(flags, false, dir), mesh, c10::kCPU);
      const double t0 = Now();
      auto step = c.Resume(*gpt.engine, *gpt.optimizer);
      const double dt = Now() - t0;
      if (!step.ok()) Die(step.status());
      {
        absl::MutexLock lock(&mu);
        const std::string key = absl::StrCat(shape.replicate, "x", shape.shard);
        const double r = static_cast<double>(c.read_stats().bytes_read) /
                         std::max<int64_t>(1, c.read_stats().bytes_needed);
        excess[key] = std::max(excess[key], r);
      }
      double cur = slowest.load();
      while (dt > cur && !slowest.compare_exchange_weak(cur, dt)) {
      }
    });
    return slowest.load();
  };
  std::vector<double> same, moved;
  for (int r = 0; r < 3; ++r) {
    same.push_back(load(saved));
    moved.push_back(load(other));
  }
  const double s = *std::min_element(same.begin(), same.end());
  const double m = *std::min_element(moved.begin(), moved.end());
  std::printf(
      "== load time (slowest rank, best of 3; includes the ranks' "
      "agreement collectives) ==\n");
  std::printf("same mesh %s        %8.1f ms\n", flags.mesh.c_str(), s * 1e3);
  std::printf("other mesh %s       %8.1f ms  ratio %.2f\n",
              flags.load_mesh.c_str(), m * 1e3, m / s);
  for (const auto& [mesh, r] : excess) {
    std::printf("bytes read / minimum (worst rank) at %s: %.3f\n", mesh.c_str(),
                r);
  }
}

}  // namespace
}  // namespace hsdp::ckpt

int main(int argc, char** argv) {
  hsdp::ckpt::Flags flags;
  CLI::App app{"checkpoint step and load costs"};
  app.add_option("--model", flags.model, "a GPT name (gpt-tiny, gpt-small..)");
  app.add_option("--mesh", flags.mesh, "RxS of the training run");
  app.add_option("--load-mesh", flags.load_mesh, "RxS to load on");
  app.add_option("--batch", flags.batch, "samples per rank per step");
  app.add_option("--rounds", flags.rounds, "interleaved rounds");
  app.add_option("--dir", flags.dir, "scratch directory");
  CLI11_PARSE(app, argc, argv);
  auto config = hsdp::models::GptConfigForName(flags.model);
  if (!config.ok()) hsdp::ckpt::Die(config.status());
  std::filesystem::remove_all(flags.dir);
  FLAGS_minloglevel = 1;  // the ranks' "resumed from" lines
  at::set_num_threads(1);
  hsdp::ckpt::StepTimes(*config, flags);
  hsdp::ckpt::LoadTimes(*config, flags);
  return 0;
}
