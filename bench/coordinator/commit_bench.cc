// commit_bench: what the two-phase step commit costs per step, against a real
// in-process coordinator over loopback gRPC. N simulated workers (threads)
// join, then per step all vote CommitStep at once (as ranks do after their
// step's collectives); the round lasts from the first vote sent to the last
// answer received. Side by side in one run: the same rounds of a plain unary
// RPC (Heartbeat) — the floor any coordinator round trip costs — and the
// commit with and without a state directory (the commit point fsync'ed per
// step). Prints p50/p99 per N and mode.
#include <grpcpp/grpcpp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "coordinator/server.h"
#include "hsdp/v1/coordinator_service.grpc.pb.h"

namespace {

using hsdp::v1::CoordinatorService;
using Clock = std::chrono::steady_clock;

constexpr char kJob[] = "commit-bench";
constexpr int kChannels = 4;

double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(p * static_cast<double>(v.size() - 1))];
}

void Check(const grpc::Status& s, const char* what) {
  if (s.ok()) return;
  std::fprintf(stderr, "commit_bench: %s: %s\n", what,
               s.error_message().c_str());
  std::exit(1);
}

std::unique_ptr<grpc::ClientContext> Ctx() {
  auto c = std::make_unique<grpc::ClientContext>();
  c->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  return c;
}

enum class Mode { kHeartbeat, kCommit };

// Round times (ms) of `steps` rounds of `workers` concurrent calls.
std::vector<double> Run(int workers, int steps, Mode mode,
                        const std::string& state_dir) {
  hsdp::coordinator::JobConfig job;
  job.job_id = kJob;
  job.world_size = workers;
  job.mesh = {workers, 1};
  job.state_dir = state_dir;
  hsdp::coordinator::ServerOptions options;
  options.listen = "127.0.0.1:0";
  options.metrics_listen = "";
  auto server = hsdp::coordinator::CoordinatorServer::Start(job, options);
  if (!server.ok()) {
    std::fprintf(stderr, "commit_bench: %s\n",
                 server.status().ToString().c_str());
    std::exit(1);
  }
  std::vector<std::unique_ptr<CoordinatorService::Stub>> stubs;
  for (int c = 0; c < kChannels; ++c) {
    grpc::ChannelArguments args;
    args.SetInt("channel_idx", c);
    stubs.push_back(CoordinatorService::NewStub(grpc::CreateCustomChannel(
        (*server)->address(), grpc::InsecureChannelCredentials(), args)));
  }
  std::vector<int64_t> ids(workers);
  for (int r = 0; r < workers; ++r) {
    hsdp::v1::JoinRequest join;
    join.set_job_id(kJob);
    join.set_rank_hint(r);
    join.set_hostname("h");
    join.set_model("m");
    auto* unit = join.add_units();
    unit->set_name("root");
    unit->set_param_count(1);
    unit->set_param_bytes(4);
    hsdp::v1::JoinResponse joined;
    Check(stubs[r % kChannels]->Join(Ctx().get(), join, &joined), "Join");
    ids[r] = joined.worker_id();
  }
  std::vector<std::vector<Clock::time_point>> done(
      steps, std::vector<Clock::time_point>(workers));
  std::vector<std::vector<Clock::time_point>> begun(
      steps, std::vector<Clock::time_point>(workers));
  // Workers that finished each step (release/acquire orders `done`).
  std::vector<std::atomic<int>> finished(steps);
  std::vector<std::thread> threads;
  for (int r = 0; r < workers; ++r) {
    threads.emplace_back([&, r] {
      CoordinatorService::Stub& stub = *stubs[r % kChannels];
      for (int s = 0; s < steps; ++s) {
        begun[s][r] = Clock::now();
        if (mode == Mode::kCommit) {
          hsdp::v1::CommitStepRequest vote;
          vote.set_job_id(kJob);
          vote.set_worker_id(ids[r]);
          vote.set_generation(0);
          vote.set_step(s);
          hsdp::v1::CommitStepResponse answer;
          Check(stub.CommitStep(Ctx().get(), vote, &answer), "CommitStep");
        } else {
          hsdp::v1::HeartbeatRequest beat;
          beat.set_job_id(kJob);
          beat.set_worker_id(ids[r]);
          beat.set_step(s);
          hsdp::v1::HeartbeatResponse answer;
          Check(stub.Heartbeat(Ctx().get(), beat, &answer), "Heartbeat");
        }
        done[s][r] = Clock::now();
        finished[s].fetch_add(1, std::memory_order_release);
        // All ranks finish a step before any starts the next (collectives
        // synchronise them in a real job).
        while (finished[s].load(std::memory_order_acquire) < workers) {
          std::this_thread::yield();
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  std::vector<double> rounds;
  for (int s = 0; s < steps; ++s) {
    const Clock::time_point first =
        *std::min_element(begun[s].begin(), begun[s].end());
    const Clock::time_point last =
        *std::max_element(done[s].begin(), done[s].end());
    rounds.push_back(
        std::chrono::duration<double, std::milli>(last - first).count());
  }
  (*server)->Shutdown();
  return rounds;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"commit_bench: the cost of the two-phase step commit"};
  std::vector<int> workers = {4, 16, 64};
  int steps = 200;
  std::string state_dir = "/tmp/hsdp-commit-bench";
  app.add_option("--workers", workers, "Worker counts, e.g. 4,16,64")
      ->delimiter(',');
  app.add_option("--steps", steps, "Rounds per case");
  app.add_option("--state-dir", state_dir,
                 "Scratch directory for the persisted case");
  CLI11_PARSE(app, argc, argv);
  std::printf("%-8s %-26s %10s %10s\n", "workers", "round", "p50_ms", "p99_ms");
  for (int n : workers) {
    struct Case {
      const char* name;
      Mode mode;
      bool persist;
    };
    for (const Case& c :
         {Case{"heartbeat (RPC floor)", Mode::kHeartbeat, false},
          Case{"commit", Mode::kCommit, false},
          Case{"commit + state dir fsync", Mode::kCommit, true}}) {
      std::string dir;
      if (c.persist) {
        dir = absl::StrCat(state_dir, "-", n);
        std::filesystem::remove_all(dir);
      }
      const std::vector<double> rounds = Run(n, steps, c.mode, dir);
      std::printf("%-8d %-26s %10.3f %10.3f\n", n, c.name,
                  Percentile(rounds, 0.5), Percentile(rounds, 0.99));
      if (!dir.empty()) std::filesystem::remove_all(dir);
    }
  }
  return 0;
}
