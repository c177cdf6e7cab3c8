// Coordinator benchmark: N simulated workers do Join -> (GetSchedule ->
// ReportStep) x steps against a real in-process coordinator over loopback gRPC.
//
// Load model: training ranks are synchronised by their collectives, so every
// rank asks for step s at about the same moment and none starts step s + 1
// before all finished step s. The benchmark reproduces exactly that worst case:
// per step, all N GetSchedule calls are issued at once (a burst), then all N
// ReportStep calls, then a barrier. Worker calls are spread over a few client
// threads, each driving its workers asynchronously through one completion queue
// and a few channels (connections), as a handful of hosts would.
//
// --paced-step-ms T instead spreads the workers evenly over a step period of T
// ms (the load of agents that prefetch the next step in the background), which
// shows the per-call latency without a burst queued in front of it.
//
// Printed per N: GetSchedule latency p50/p99 as the worker sees it (queueing in
// the burst included), schedules served per second, wall time per step, and
// per-step cost relative to N = 64 next to the linear expectation N / 64.
#include <grpcpp/grpcpp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/barrier.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/server.h"
#include "hsdp/v1/coordinator_service.grpc.pb.h"

namespace {

using hsdp::v1::CoordinatorService;
using Clock = std::chrono::steady_clock;

constexpr char kJob[] = "bench";
constexpr auto kRpcTimeout = std::chrono::seconds(60);

struct Options {
  std::vector<int> workers = {64, 256, 1024};
  int steps = 100;
  int layers = 24;
  int client_threads = 2;
  int channels_per_thread = 4;
  std::string state_dir;  // empty: no persistence
  // 0: burst mode; > 0: paced mode with this step period.
  int paced_step_ms = 0;
};

hsdp::v1::JoinRequest MakeJoin(int rank, int layers) {
  hsdp::v1::JoinRequest request;
  request.set_job_id(kJob);
  request.set_rank_hint(rank);
  request.set_hostname(absl::StrCat("bench-", rank));
  request.set_device("cpu");
  request.set_model("bench");
  auto add = [&](const std::string& name, int64_t params) {
    hsdp::v1::UnitInfo* u = request.add_units();
    u->set_name(name);
    u->set_param_count(params);
    u->set_param_bytes(params * 4);
  };
  add("root", 50'000'000);
  for (int i = 0; i < layers; ++i) add(absl::StrCat("layers.", i), 12'000'000);
  return request;
}

// One client thread's share of the workers: its ranks, its channels and its
// completion queue. Thread-compatible: used by the one thread that owns it.
class ClientShard {
 public:
  ClientShard(const std::string& address, std::vector<int> ranks, int channels,
              int shard_index)
      : ranks_(std::move(ranks)) {
    for (int c = 0; c < channels; ++c) {
      grpc::ChannelArguments args;
      // Distinct arguments keep gRPC from sharing one connection between the
      // channels.
      args.SetInt("hsdp.bench.channel", shard_index * 1000 + c);
      stubs_.push_back(CoordinatorService::NewStub(grpc::CreateCustomChannel(
          address, grpc::InsecureChannelCredentials(), args)));
    }
  }

  bool JoinAll(int layers) {
    for (size_t i = 0; i < ranks_.size(); ++i) {
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + kRpcTimeout);
      hsdp::v1::JoinResponse response;
      grpc::Status s =
          Stub(i).Join(&context, MakeJoin(ranks_[i], layers), &response);
      if (!s.ok()) {
        std::fprintf(stderr, "join rank %d: %s\n", ranks_[i],
                     s.error_message().c_str());
        return false;
      }
    }
    return true;
  }

  // Issues every worker's GetSchedule(step) at once and collects the answers;
  // appends the round-trip latencies (seconds). False on any error.
  bool FetchAll(int64_t step, std::vector<double>* latencies) {
    std::vector<Call<hsdp::v1::GetScheduleResponse>> calls(ranks_.size());
    for (size_t i = 0; i < ranks_.size(); ++i) {
      hsdp::v1::GetScheduleRequest request;
      request.set_job_id(kJob);
      request.set_rank(ranks_[i]);
      request.set_step(step);
      Start(&calls[i]);
      calls[i].reader =
          Stub(i).AsyncGetSchedule(&calls[i].context, request, &cq_);
      calls[i].reader->Finish(&calls[i].response, &calls[i].status, &calls[i]);
    }
    if (!Drain(calls.size())) return false;
    for (auto& call : calls) {
      if (!call.status.ok() || call.response.schedule().step() != step) {
        std::fprintf(stderr, "GetSchedule(%ld): %s\n", static_cast<long>(step),
                     call.status.error_message().c_str());
        return false;
      }
      latencies->push_back(
          std::chrono::duration<double>(call.done - call.start).count());
    }
    return true;
  }

  bool ReportAll(int64_t step) {
    std::vector<Call<hsdp::v1::ReportStepResponse>> calls(ranks_.size());
    for (size_t i = 0; i < ranks_.size(); ++i) {
      hsdp::v1::ReportStepRequest request;
      request.set_job_id(kJob);
      hsdp::v1::StepReport* report = request.mutable_report();
      report->set_rank(ranks_[i]);
      report->set_step(step);
      report->set_loss(2.0);
      report->set_step_seconds(0.5);
      report->set_peak_memory_bytes(int64_t{8} << 30);
      Start(&calls[i]);
      calls[i].reader =
          Stub(i).AsyncReportStep(&calls[i].context, request, &cq_);
      calls[i].reader->Finish(&calls[i].response, &calls[i].status, &calls[i]);
    }
    if (!Drain(calls.size())) return false;
    for (auto& call : calls) {
      if (!call.status.ok()) {
        std::fprintf(stderr, "ReportStep: %s\n",
                     call.status.error_message().c_str());
        return false;
      }
    }
    return true;
  }

  // Paced load: worker i fetches step s at start + phase_i + s * period, where
  // the phases spread the workers evenly over one period, then reports. This is
  // the load an agent that prefetches the next step in the background puts on
  // the coordinator; the latency is the service time without a synchronised
  // burst in front of it. Appends GetSchedule latencies; false on any error.
  bool RunPaced(int64_t steps, std::chrono::microseconds period, int world,
                Clock::time_point start, std::vector<double>* latencies) {
    struct Worker {
      int64_t step = 0;
      Clock::time_point next;
      bool busy = false;
      std::unique_ptr<Call<hsdp::v1::GetScheduleResponse>> fetch;
      std::unique_ptr<Call<hsdp::v1::ReportStepResponse>> report;
    };
    std::vector<Worker> workers(ranks_.size());
    for (size_t i = 0; i < workers.size(); ++i) {
      workers[i].next = start + period * ranks_[i] / world;
    }
    size_t finished = 0;
    while (finished < workers.size()) {
      Clock::time_point wake = Clock::now() + period;
      for (size_t i = 0; i < workers.size(); ++i) {
        Worker& w = workers[i];
        if (w.busy || w.step >= steps) continue;
        if (w.next > Clock::now()) {
          wake = std::min(wake, w.next);
          continue;
        }
        hsdp::v1::GetScheduleRequest request;
        request.set_job_id(kJob);
        request.set_rank(ranks_[i]);
        request.set_step(w.step);
        w.fetch = std::make_unique<Call<hsdp::v1::GetScheduleResponse>>();
        Start(w.fetch.get());
        w.fetch->reader =
            Stub(i).AsyncGetSchedule(&w.fetch->context, request, &cq_);
        w.fetch->reader->Finish(&w.fetch->response, &w.fetch->status,
                                Tag(i, /*report=*/false));
        w.busy = true;
      }
      void* tag;
      bool ok;
      // gRPC takes system_clock deadlines only.
      const auto got = cq_.AsyncNext(
          &tag, &ok,
          std::chrono::system_clock::now() +
              std::chrono::duration_cast<std::chrono::system_clock::duration>(
                  wake - Clock::now()));
      if (got == grpc::CompletionQueue::SHUTDOWN) return false;
      if (got == grpc::CompletionQueue::TIMEOUT) continue;
      if (!ok) return false;
      const size_t i = reinterpret_cast<uintptr_t>(tag) >> 1;
      Worker& w = workers[i];
      if ((reinterpret_cast<uintptr_t>(tag) & 1) == 0) {  // fetched
        if (!w.fetch->status.ok()) {
          std::fprintf(stderr, "GetSchedule: %s\n",
                       w.fetch->status.error_message().c_str());
          return false;
        }
        latencies->push_back(
            std::chrono::duration<double>(Clock::now() - w.fetch->start)
                .count());
        hsdp::v1::ReportStepRequest request;
        request.set_job_id(kJob);
        request.mutable_report()->set_rank(ranks_[i]);
        request.mutable_report()->set_step(w.step);
        w.report = std::make_unique<Call<hsdp::v1::ReportStepResponse>>();
        Start(w.report.get());
        w.report->reader =
            Stub(i).AsyncReportStep(&w.report->context, request, &cq_);
        w.report->reader->Finish(&w.report->response, &w.report->status,
                                 Tag(i, /*report=*/true));
      } else {  // reported
        if (!w.report->status.ok()) return false;
        w.busy = false;
        ++w.step;
        w.next += period;
        if (w.step == steps) ++finished;
      }
    }
    return true;
  }

  ~ClientShard() {
    cq_.Shutdown();
    void* tag;
    bool ok;
    while (cq_.Next(&tag, &ok)) {
    }
  }

 private:
  struct CallBase {
    grpc::ClientContext context;
    grpc::Status status;
    Clock::time_point start;
    Clock::time_point done;
  };
  template <typename Response>
  struct Call : CallBase {
    Response response;
    std::unique_ptr<grpc::ClientAsyncResponseReader<Response>> reader;
  };

  static void* Tag(size_t worker, bool report) {
    return reinterpret_cast<void*>((worker << 1) | (report ? 1 : 0));
  }

  CoordinatorService::Stub& Stub(size_t worker) {
    return *stubs_[worker % stubs_.size()];
  }

  static void Start(CallBase* call) {
    call->context.set_deadline(std::chrono::system_clock::now() + kRpcTimeout);
    call->start = Clock::now();
  }

  bool Drain(size_t n) {
    for (size_t i = 0; i < n; ++i) {
      void* tag;
      bool ok;
      if (!cq_.Next(&tag, &ok) || !ok) return false;
      static_cast<CallBase*>(tag)->done = Clock::now();
    }
    return true;
  }

  std::vector<int> ranks_;
  std::vector<std::unique_ptr<CoordinatorService::Stub>> stubs_;
  grpc::CompletionQueue cq_;
};

struct Result {
  int workers = 0;
  double p50_ms = 0;
  double p99_ms = 0;
  double max_ms = 0;
  double schedules_per_second = 0;
  double step_ms = 0;
};

double Percentile(std::vector<double>& v, double q) {
  const size_t k = std::min(
      v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())));
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k),
                   v.end());
  return v[k];
}

bool RunOne(const Options& options, int n, Result* result) {
  hsdp::coordinator::JobConfig job;
  job.job_id = kJob;
  job.world_size = n;
  job.mesh = n % 8 == 0 ? hsdp::MeshShape{n / 8, 8} : hsdp::MeshShape{1, n};
  job.heartbeat_timeout = absl::Seconds(300);
  if (!options.state_dir.empty())
    job.state_dir = absl::StrCat(options.state_dir, "/n", n);
  hsdp::coordinator::ServerOptions server_options;
  server_options.listen = "127.0.0.1:0";
  auto server =
      hsdp::coordinator::CoordinatorServer::Start(job, server_options);
  if (!server.ok()) {
    std::fprintf(stderr, "start: %s\n", server.status().ToString().c_str());
    return false;
  }
  const int threads = options.client_threads;
  std::vector<std::unique_ptr<ClientShard>> shards;
  for (int t = 0; t < threads; ++t) {
    std::vector<int> ranks;
    for (int r = t; r < n; r += threads) ranks.push_back(r);
    shards.push_back(
        std::make_unique<ClientShard>((*server)->address(), std::move(ranks),
                                      options.channels_per_thread, t));
  }
  std::vector<std::vector<double>> latencies(threads);
  std::atomic<bool> failed{false};
  // Every step: all fetch, all report, then everybody waits for everybody (the
  // collectives).
  absl::Barrier* joined = new absl::Barrier(threads + 1);
  std::vector<absl::Barrier*> step_barriers;
  for (int s = 0; s < options.steps; ++s)
    step_barriers.push_back(new absl::Barrier(threads));
  Clock::time_point start;
  std::vector<std::thread> clients;
  for (int t = 0; t < threads; ++t) {
    clients.emplace_back([&, t] {
      if (!shards[t]->JoinAll(options.layers)) failed = true;
      if (joined->Block()) delete joined;
      if (options.paced_step_ms > 0) {
        if (!shards[t]->RunPaced(
                options.steps, std::chrono::milliseconds(options.paced_step_ms),
                n, Clock::now(), &latencies[t])) {
          failed = true;
        }
        for (int s = 0; s < options.steps; ++s) {
          if (step_barriers[s]->Block()) delete step_barriers[s];
        }
        return;
      }
      for (int s = 0; s < options.steps && !failed; ++s) {
        if (!shards[t]->FetchAll(s, &latencies[t]) || !shards[t]->ReportAll(s))
          failed = true;
        if (step_barriers[s]->Block()) delete step_barriers[s];
      }
    });
  }
  if (joined->Block()) delete joined;
  start = Clock::now();
  for (auto& c : clients) c.join();
  const double seconds =
      std::chrono::duration<double>(Clock::now() - start).count();
  (*server)->Shutdown();
  if (failed) return false;
  std::vector<double> all;
  for (auto& l : latencies) all.insert(all.end(), l.begin(), l.end());
  result->workers = n;
  result->p50_ms = 1e3 * Percentile(all, 0.50);
  result->p99_ms = 1e3 * Percentile(all, 0.99);
  result->max_ms = 1e3 * *std::max_element(all.begin(), all.end());
  result->schedules_per_second = static_cast<double>(all.size()) / seconds;
  result->step_ms = 1e3 * seconds / options.steps;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  // Debian's Abseil is built with Mutex deadlock detection on: a lock-order
  // graph update on every lock (~5% of the coordinator's CPU under load, gRPC's
  // own mutexes included). Lock order is checked in tests, not in production.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  CLI::App app{"coordinator benchmark: N simulated workers over loopback gRPC",
               "coordinator_bench"};
  Options options;
  std::string workers = "64,256,1024";
  app.add_option("--workers", workers,
                 "Comma-separated worker counts (first is the baseline)");
  app.add_option("--steps", options.steps, "Steps per run");
  app.add_option("--layers", options.layers,
                 "Transformer layers of the simulated model");
  app.add_option("--client-threads", options.client_threads, "Client threads");
  app.add_option("--channels", options.channels_per_thread,
                 "Connections per client thread");
  app.add_option("--paced-step-ms", options.paced_step_ms,
                 "Paced mode: step period in ms, workers spread over it "
                 "(default 0: burst mode)");
  app.add_option("--state-dir", options.state_dir,
                 "Persist sealed steps (fsync) under DIR");
  CLI11_PARSE(app, argc, argv);
  options.workers.clear();
  for (absl::string_view w : absl::StrSplit(workers, ',')) {
    options.workers.push_back(std::stoi(std::string(w)));
  }

  std::printf(
      "coordinator_bench: %s, %d steps, %d units, %d client threads x %d "
      "channels, %s\n",
      options.paced_step_ms > 0
          ? absl::StrCat("paced mode (step ", options.paced_step_ms, " ms)")
                .c_str()
          : "burst mode (all ranks at once, barrier per step)",
      options.steps, options.layers + 1, options.client_threads,
      options.channels_per_thread,
      options.state_dir.empty() ? "no persistence" : "persistence with fsync");
  std::printf("%7s %12s %12s %12s %14s %10s %14s %10s\n", "workers", "p50_ms",
              "p99_ms", "max_ms", "schedules/s", "step_ms", "step_cost/N64",
              "linear");
  double baseline_step_ms = 0;
  int baseline_n = 0;
  bool ok = true;
  for (int n : options.workers) {
    Result r;
    if (!RunOne(options, n, &r)) {
      std::printf("%7d failed\n", n);
      ok = false;
      continue;
    }
    if (baseline_n == 0) {
      baseline_n = n;
      baseline_step_ms = r.step_ms;
    }
    std::printf("%7d %12.3f %12.3f %12.3f %14.0f %10.2f", r.workers, r.p50_ms,
                r.p99_ms, r.max_ms, r.schedules_per_second, r.step_ms);
    if (options.paced_step_ms > 0) {
      // The step period is fixed in paced mode: no cost ratio to show.
      std::printf(" %14s %10s\n", "-", "-");
    } else {
      std::printf(" %14.2f %10.2f\n", r.step_ms / baseline_step_ms,
                  static_cast<double>(n) / baseline_n);
    }
    std::fflush(stdout);
  }
  return ok ? 0 : 1;
}
