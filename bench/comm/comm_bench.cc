// comm_bench: GlooCommunicator all-gather / reduce-scatter throughput vs raw
// Gloo collectives on the same bytes, ranks as threads over loopback TCP.
// Prints one line per (world, size, collective) with both throughputs and their
// ratio (target >= 0.9).
//
// Raw baselines, run on a second Gloo context of the same ranks and the same
// tcp device:
//   all-gather     — gloo::allgather, called inline on the rank's thread;
//   reduce-scatter — gloo::alltoall into a preallocated buffer + a plain float
//   sum loop (Gloo has
//                    no options-style reduce-scatter; this moves the same bytes
//                    as a ring RS).
// Rounds alternate raw and wrapped runs, and the median round of each is
// compared, so drift in the shared 2-core machine hits both sides alike.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "gloo/allgather.h"
#include "gloo/alltoall.h"
#include "gloo/barrier.h"
#include "gloo/rendezvous/context.h"
#include "worker/comm/gloo/gloo_communicator.h"
#include "worker/comm/gloo/gloo_store.h"
#include "worker/comm/store/in_memory_store.h"

namespace hsdp::comm {
namespace {

constexpr int kWarmupIterations = 2;
constexpr absl::Duration kTimeout = absl::Seconds(60);
constexpr double kMiB = 1024.0 * 1024.0;

struct BenchConfig {
  std::vector<int> worlds = {2, 4};
  std::vector<int> sizes_mib = {4, 32};
  int samples = 31;  // timed calls per side
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <typename Fn>
double TimeCall(Fn&& fn) {
  const absl::Time start = absl::Now();
  fn();
  return absl::ToDoubleSeconds(absl::Now() - start);
}

struct Result {
  double raw_seconds = 0;
  double wrapped_seconds = 0;
};

// A benchmark has no way to recover from a failed collective: say why and stop.
void ExitIfError(const absl::Status& status) {
  if (status.ok()) return;
  std::fprintf(stderr, "comm_bench: %s\n", status.ToString().c_str());
  std::exit(1);
}

// One rank of one (world, size) case. Rank 0's results are the reported ones.
void RunRank(const BenchConfig& config, int world, size_t total_bytes, int rank,
             Store& store, Result* all_gather, Result* reduce_scatter) {
  GlooDeviceOptions device_options;
  device_options.hostname = "127.0.0.1";
  auto device = CreateGlooDevice(device_options);
  ExitIfError(device.status());
  GlooCommunicatorOptions options;
  options.name = "gloo:bench";
  options.timeout = kTimeout;
  auto comm =
      GlooCommunicator::Create(store, "wrapped", rank, world, *device, options);
  ExitIfError(comm.status());
  auto raw = std::make_shared<gloo::rendezvous::Context>(rank, world);
  raw->setTimeout(
      std::chrono::milliseconds(absl::ToInt64Milliseconds(kTimeout)));
  GlooStoreAdapter raw_store(store, "raw", kTimeout);
  raw->connectFullMesh(raw_store, *device);

  const int64_t total = static_cast<int64_t>(total_bytes / sizeof(float));
  const int64_t shard = total / world;
  std::vector<float> full(shard * world, 1.0f), part(shard, 1.0f),
      scratch(shard * world);
  const Buffer full_buffer{full.data(), shard * world, DataType::kFloat32};
  const Buffer part_buffer{part.data(), shard, DataType::kFloat32};

  auto raw_all_gather = [&] {
    gloo::AllgatherOptions opts(raw);
    opts.setInput(part.data(), shard);
    opts.setOutput(full.data(), shard * world);
    gloo::allgather(opts);
  };
  auto wrapped_all_gather = [&] {
    auto status = (*comm)->AllGather(part_buffer, full_buffer)->Wait();
    ExitIfError(status);
  };
  auto raw_reduce_scatter = [&] {
    gloo::AlltoallOptions opts(raw);
    opts.setInput(full.data(), shard * world);
    opts.setOutput(scratch.data(), shard * world);
    gloo::alltoall(opts);
    std::copy(scratch.begin(), scratch.begin() + shard, part.begin());
    for (int r = 1; r < world; ++r) {
      const float* chunk = scratch.data() + r * shard;
      for (int64_t i = 0; i < shard; ++i) part[i] += chunk[i];
    }
  };
  auto wrapped_reduce_scatter = [&] {
    auto status = (*comm)
                      ->ReduceScatter(full_buffer, part_buffer, ReduceOp::kSum)
                      ->Wait();
    ExitIfError(status);
  };

  // Per-call interleaving (raw, wrapped, wrapped, raw, ...): load from other
  // processes on the shared machine then hits both sides alike, and the medians
  // drop outliers.
  auto measure = [&](auto& raw_fn, auto& wrapped_fn, Result* result) {
    for (int i = 0; i < kWarmupIterations; ++i) {
      raw_fn();
      wrapped_fn();
    }
    // Every timed call starts right after an (untimed) barrier, so a rank's
    // time is the collective's, not its wait for a late peer.
    auto timed = [&](auto& fn) {
      gloo::BarrierOptions barrier(raw);
      gloo::barrier(barrier);
      return TimeCall(fn);
    };
    std::vector<double> raw_times, wrapped_times;
    for (int sample = 0; sample < config.samples; ++sample) {
      if (sample % 2 == 0) {
        raw_times.push_back(timed(raw_fn));
        wrapped_times.push_back(timed(wrapped_fn));
      } else {
        wrapped_times.push_back(timed(wrapped_fn));
        raw_times.push_back(timed(raw_fn));
      }
    }
    if (rank == 0) *result = Result{Median(raw_times), Median(wrapped_times)};
  };
  measure(raw_all_gather, wrapped_all_gather, all_gather);
  measure(raw_reduce_scatter, wrapped_reduce_scatter, reduce_scatter);
}

void Report(const char* collective, int world, int size_mib, const Result& r) {
  const double bytes = size_mib * kMiB;
  std::printf(
      "%-14s world=%d size=%3d MiB  raw %7.3f ms %6.2f GB/s   hsdp %7.3f ms "
      "%6.2f GB/s   "
      "ratio %.3f\n",
      collective, world, size_mib, r.raw_seconds * 1e3,
      bytes / r.raw_seconds / 1e9, r.wrapped_seconds * 1e3,
      bytes / r.wrapped_seconds / 1e9, r.raw_seconds / r.wrapped_seconds);
}

int Main(const BenchConfig& config) {
  std::printf(
      "GlooCommunicator vs raw Gloo, fp32, loopback TCP, ranks as threads; "
      "median of %d interleaved calls per side; size = unsharded bytes (AG "
      "output, RS input); ratio = hsdp throughput / raw throughput\n",
      config.samples);
  for (int world : config.worlds) {
    for (int size_mib : config.sizes_mib) {
      InMemoryStore store;
      Result all_gather, reduce_scatter;
      std::vector<std::thread> ranks;
      for (int rank = 0; rank < world; ++rank) {
        ranks.emplace_back([&, rank] {
          RunRank(config, world, static_cast<size_t>(size_mib * kMiB), rank,
                  store, &all_gather, &reduce_scatter);
        });
      }
      for (std::thread& t : ranks) t.join();
      Report("all-gather", world, size_mib, all_gather);
      Report("reduce-scatter", world, size_mib, reduce_scatter);
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace
}  // namespace hsdp::comm

int main(int argc, char** argv) {
  hsdp::comm::BenchConfig config;
  CLI::App app{"GlooCommunicator vs raw Gloo collective throughput"};
  app.add_option("--worlds", config.worlds, "world sizes")->delimiter(',');
  app.add_option("--sizes-mib", config.sizes_mib, "unsharded sizes in MiB")
      ->delimiter(',');
  app.add_option("--samples", config.samples, "timed calls per side")
      ->check(CLI::PositiveNumber);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "comm_bench: %s\n", e.what());
    return 2;
  }
  return hsdp::comm::Main(config);
}
