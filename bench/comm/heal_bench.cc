// heal_bench: time to heal one rank with a shard's state (parameters + AdamW
// moments + step) of gpt-medium, from 1, 2 and 3 sources at once, next to a
// plain Gloo broadcast of the same bytes from one source — ranks as threads
// over loopback TCP, in one run. Prints per case the median heal time, the
// target's receive throughput and the ratio to the one-source heal.
//
// The state is laid out as the engine holds it: for each parameter of
// gpt-medium (d 512, 8 layers, ffn 2048, vocab 256, seq 256: 25.6 M
// parameters) its dim-0 shard of ceil(rows / S) rows, three times (parameter,
// exp_avg, exp_avg_sq, fp32), plus an int64 step counter. Every healed target
// is checked bitwise against the sources.
//
// On one machine every byte crosses loopback TCP, so the figure is bounded by
// CPU copies, not by a network link; between hosts each source adds its own
// link's bandwidth.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "worker/comm/gloo/gloo_communicator.h"
#include "worker/comm/heal.h"
#include "worker/comm/store/in_memory_store.h"

namespace hsdp::comm {
namespace {

constexpr absl::Duration kTimeout = absl::Seconds(120);
constexpr double kMB = 1e6;

// (rows, cols) of every gpt-medium parameter, in module order (as
// worker/models/gpt.cc builds it; 1-D parameters have cols 1).
std::vector<std::pair<int64_t, int64_t>> GptMediumShapes() {
  constexpr int64_t d = 512, layers = 8, ffn = 2048, vocab = 256, seq = 256;
  std::vector<std::pair<int64_t, int64_t>> shapes = {{vocab, d}, {seq, d}};
  for (int l = 0; l < layers; ++l) {
    const std::vector<std::pair<int64_t, int64_t>> layer = {
        {d, 1},     {d, 1},      // ln1
        {3 * d, d}, {3 * d, 1},  // qkv
        {d, d},     {d, 1},      // proj
        {d, 1},     {d, 1},      // ln2
        {ffn, d},   {ffn, 1},    // fc
        {d, ffn},   {d, 1}};     // out
    shapes.insert(shapes.end(), layer.begin(), layer.end());
  }
  shapes.insert(shapes.end(), {{d, 1}, {d, 1}, {vocab, d}});  // ln_f, head
  return shapes;
}

// One rank's copy of a shard's state.
struct ShardState {
  ShardState(int shard, uint64_t seed) {
    for (int copy = 0; copy < 3; ++copy) {
      for (const auto& [rows, cols] : GptMediumShapes()) {
        const int64_t shard_rows = (rows + shard - 1) / shard;
        tensors.emplace_back(static_cast<size_t>(shard_rows * cols));
      }
    }
    step.assign(1, 0);
    Fill(seed);
  }
  void Fill(uint64_t seed) {
    for (auto& t : tensors) {
      for (size_t i = 0; i < t.size(); ++i) {
        t[i] = static_cast<float>((seed + i) % 1009) * 0.001f;
      }
      seed += 7;
    }
    step[0] = static_cast<int64_t>(seed);
  }
  std::vector<Buffer> buffers() {
    std::vector<Buffer> out;
    for (auto& t : tensors) {
      out.push_back(
          Buffer{t.data(), static_cast<int64_t>(t.size()), DataType::kFloat32});
    }
    out.push_back(Buffer{step.data(), 1, DataType::kInt64});
    return out;
  }
  size_t bytes() const {
    size_t total = sizeof(int64_t);
    for (const auto& t : tensors) total += t.size() * sizeof(float);
    return total;
  }
  bool operator==(const ShardState& o) const {
    return tensors == o.tensors && step == o.step;
  }
  std::vector<std::vector<float>> tensors;
  std::vector<int64_t> step;
};

void ExitIfError(const absl::Status& status) {
  if (status.ok()) return;
  std::fprintf(stderr, "heal_bench: %s\n", status.ToString().c_str());
  std::exit(1);
}

// A group of `world` ranks (threads) with their states; rank world-1 is the
// target, the others the sources.
struct Group {
  Group(int world, int shard) {
    states.reserve(world);
    for (int r = 0; r < world; ++r) states.emplace_back(shard, 17);
    comms.resize(world);
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r) {
      threads.emplace_back([&, r] {
        GlooDeviceOptions device_options;
        device_options.hostname = "127.0.0.1";
        auto device = CreateGlooDevice(device_options);
        ExitIfError(device.status());
        GlooCommunicatorOptions options;
        options.name = "gloo:heal";
        options.timeout = kTimeout;
        auto comm =
            GlooCommunicator::Create(store, "heal", r, world, *device, options);
        ExitIfError(comm.status());
        comms[r] = *std::move(comm);
      });
    }
    for (auto& t : threads) t.join();
  }
  InMemoryStore store;
  std::vector<ShardState> states;
  std::vector<std::unique_ptr<GlooCommunicator>> comms;
};

// Wipes the target, runs `fn(rank)` on every rank at once, checks the target
// and returns the wall time.
template <typename Fn>
double TimeRound(Group& g, Fn&& fn) {
  const int world = static_cast<int>(g.comms.size());
  g.states[world - 1].Fill(99);
  const absl::Time start = absl::Now();
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) threads.emplace_back([&, r] { fn(r); });
  for (auto& t : threads) t.join();
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  if (!(g.states[world - 1] == g.states[0])) {
    std::fprintf(stderr, "heal_bench: target differs from the sources\n");
    std::exit(1);
  }
  return seconds;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace
}  // namespace hsdp::comm

int main(int argc, char** argv) {
  using namespace hsdp::comm;
  CLI::App app{"heal_bench: heal one rank from several sources at once"};
  int shard = 2;
  int rounds = 5;
  int max_sources = 3;
  app.add_option("--shard", shard, "Shard degree S (state per rank / S)");
  app.add_option("--rounds", rounds, "Timed rounds per case (median shown)");
  app.add_option("--max-sources", max_sources, "Sources 1..N");
  CLI11_PARSE(app, argc, argv);

  std::vector<std::unique_ptr<Group>> groups;
  for (int k = 1; k <= max_sources; ++k) {
    groups.push_back(std::make_unique<Group>(k + 1, shard));
  }
  const double bytes = static_cast<double>(groups[0]->states[0].bytes());
  std::printf("gpt-medium shard state, S=%d: %.1f MB per rank (%zu buffers)\n",
              shard, bytes / kMB, groups[0]->states[0].buffers().size());

  // Rounds alternate the cases, so drift on a shared machine hits all alike.
  std::vector<std::vector<double>> heal(max_sources), broadcast;
  broadcast.resize(1);
  for (int round = -1; round < rounds; ++round) {  // round -1: warm-up
    for (int k = 1; k <= max_sources; ++k) {
      Group& g = *groups[k - 1];
      HealRoles roles;
      for (int s = 0; s < k; ++s) roles.sources.push_back(s);
      roles.targets = {k};
      const double t = TimeRound(g, [&](int r) {
        ExitIfError(HealState(*g.comms[r], roles, g.states[r].buffers()));
      });
      if (round >= 0) heal[k - 1].push_back(t);
    }
    // Baseline: the same bytes, one Gloo broadcast per buffer from rank 0 of
    // the one-source group.
    Group& g = *groups[0];
    const double t = TimeRound(g, [&](int r) {
      std::vector<std::unique_ptr<Work>> works;
      for (const Buffer& b : g.states[r].buffers()) {
        works.push_back(g.comms[r]->Broadcast(b, 0));
      }
      for (auto& w : works) ExitIfError(w->Wait());
    });
    if (round >= 0) broadcast[0].push_back(t);
  }

  const double one = Median(heal[0]);
  std::printf("%-28s %10s %12s %14s\n", "case", "median_s", "target_MB/s",
              "vs_1_source");
  const double b = Median(broadcast[0]);
  std::printf("%-28s %10.3f %12.1f %14.2f\n", "gloo broadcast, 1 source", b,
              bytes / kMB / b, one / b);
  for (int k = 1; k <= max_sources; ++k) {
    const double t = Median(heal[k - 1]);
    std::printf(
        "%-28s %10.3f %12.1f %14.2f\n",
        absl::StrFormat("HealState, %d source%s", k, k > 1 ? "s" : "").c_str(),
        t, bytes / kMB / t, one / t);
  }
  return 0;
}
