// Coordinator benchmark: N simulated workers Join, then every step get the
// step's schedule and ReportStep, against a real coordinator over loopback
// gRPC. The coordinator runs in a child process (this binary with --serve), so
// its CPU time is measured apart from the clients'; both share this machine's
// cores.
//
// Transports: "unary" (GetSchedule per step and worker, the long poll current
// workers use) and "stream" (WatchSchedules: one stream per worker over which
// the coordinator pushes each sealed step; --push-ahead is how many steps past
// the slowest rank's next step it pushes: 1 is the coordinator's default, 0 the
// worst case where nobody holds a step before all of them need it).
// Reports: "stream" (StreamReports: one message per step on a stream each
// worker keeps open, as workers send them) or "unary" (one ReportStep call per
// step and worker).
// Votes (burst mode), after holding the step and before reporting it, as the
// training loop commits each step: "stream" (a message on the report stream,
// the commit pushed on the schedule stream, as workers vote), "unary" (one
// long-polled CommitStep call per step and worker, answered when the last vote
// came) or "none".
//
// Load: training ranks are synchronised by their collectives, so in burst mode
// (the default) all N workers need step s at the same moment, then all report,
// then a barrier, then --compute-ms of the step's compute (0 by default: the
// next step is needed at once, so the coordinator's backlog of reports shows
// in the hold time; real steps give it their compute time). --paced-step-ms T
// spreads the workers evenly over a step period of T ms instead (each needs
// step s at its own phase, then reports).
//
// Printed per N, over the timed steps:
//  - hold (burst mode): the time from the moment the workers need step s until
//    every worker holds it (p50 / p99 over steps);
//  - wait: per worker and step, from needing the schedule to holding it (the
//    per-call latency of GetSchedule; for a stream, 0 when the push came
//    first) p50 / p99;
//  - schedules/s delivered, wall time per step;
//  - the coordinator's CPU time per step (utime + stime of the child), per
//    worker, and per-step cost relative to the first N next to the linear
//    expectation.
// Persistence: --state-dir DIR gives each run a fresh fsync'd state directory
// under DIR (as every deployment runs).
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
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
constexpr char kAddressPrefix[] = "ADDRESS ";
// Steps run before the timed ones: connections, sealing, first pushes.
constexpr int kWarmupSteps = 3;
// Simulated workers share a host eight at a time: with the 8-wide shard
// groups Serve() picks, every shard group lies inside one host, as the
// coordinator places them on a real cluster.
constexpr int kRanksPerHost = 8;

struct Options {
  std::vector<int> workers = {64, 256, 1024};
  int steps = 100;
  int layers = 24;
  int client_threads = 2;
  int channels_per_thread = 4;
  std::string state_dir;  // empty: no persistence
  // 0: burst mode; > 0: paced mode with this step period.
  int paced_step_ms = 0;
  // Burst mode: the compute time between a step's barrier and the next need.
  int compute_ms = 0;
  std::string transport = "unary";
  std::string reports = "stream";
  // Empty: as workers vote (stream where both streams are used, else unary).
  std::string votes;
  // > 0: simulated host relays, each carrying this many ranks' streams.
  int ranks_per_relay = 0;
  int push_ahead = hsdp::coordinator::kDefaultPushAhead;
};

hsdp::v1::JoinRequest MakeJoin(int rank, int layers) {
  hsdp::v1::JoinRequest request;
  request.set_job_id(kJob);
  request.set_rank_hint(rank);
  request.set_hostname(absl::StrCat("bench-", rank / kRanksPerHost));
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

int64_t Nanos(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             t.time_since_epoch())
      .count();
}

// ---- the coordinator child
// -------------------------------------------------------------

// --serve: runs a coordinator for `n` workers, prints "ADDRESS host:port" and
// serves until stdin closes.
int Serve(const Options& options, int n) {
  hsdp::coordinator::JobConfig job;
  job.job_id = kJob;
  job.world_size = n;
  job.mesh = n % kRanksPerHost == 0
                 ? hsdp::MeshShape{n / kRanksPerHost, kRanksPerHost}
                 : hsdp::MeshShape{1, n};
  job.heartbeat_timeout = absl::Seconds(300);
  job.state_dir = options.state_dir;
  hsdp::coordinator::ServerOptions server_options;
  server_options.listen = "127.0.0.1:0";
  server_options.schedule_push_ahead = options.push_ahead;
  auto server =
      hsdp::coordinator::CoordinatorServer::Start(job, server_options);
  if (!server.ok()) {
    std::cerr << "start: " << server.status() << "\n";
    return 1;
  }
  std::cout << kAddressPrefix << (*server)->address() << std::endl;
  char c;
  while (read(STDIN_FILENO, &c, 1) > 0) {
  }
  (*server)->Shutdown();
  return 0;
}

class Child {
 public:
  // Starts this binary with --serve; false on failure.
  bool Start(const std::vector<std::string>& args) {
    int to_child[2], from_child[2];
    if (pipe(to_child) != 0 || pipe(from_child) != 0) return false;
    pid_ = fork();
    if (pid_ == 0) {
      dup2(to_child[0], STDIN_FILENO);
      dup2(from_child[1], STDOUT_FILENO);
      close(to_child[1]);
      close(from_child[0]);
      std::vector<char*> argv;
      for (const std::string& a : args)
        argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      execv("/proc/self/exe", argv.data());
      _exit(127);
    }
    close(to_child[0]);
    close(from_child[1]);
    stdin_ = to_child[1];
    std::string line;
    char c;
    while (read(from_child[0], &c, 1) == 1 && c != '\n') line += c;
    close(from_child[0]);
    if (line.rfind(kAddressPrefix, 0) != 0) return false;
    address_ = line.substr(std::strlen(kAddressPrefix));
    return true;
  }
  ~Child() {
    if (stdin_ >= 0) close(stdin_);
    if (pid_ > 0) waitpid(pid_, nullptr, 0);
  }
  // utime + stime so far, seconds.
  double CpuSeconds() const {
    std::ifstream in(absl::StrCat("/proc/", pid_, "/stat"));
    std::string text((std::istreambuf_iterator<char>(in)),
                     std::istreambuf_iterator<char>());
    // Fields after the ")" closing the command name; utime and stime are the
    // 14th and 15th fields of the line.
    std::istringstream fields(text.substr(text.rfind(')') + 2));
    std::string field;
    double ticks = 0;
    for (int i = 3; i <= 15 && fields >> field; ++i) {
      if (i >= 14) ticks += std::stod(field);
    }
    return ticks / static_cast<double>(sysconf(_SC_CLK_TCK));
  }
  const std::string& address() const { return address_; }

 private:
  pid_t pid_ = -1;
  int stdin_ = -1;
  std::string address_;
};

// ---- the simulated workers
// ------------------------------------------------------------

// Per step, shared by the client threads: when the first worker needed the
// step and when the last one held it (steady-clock nanoseconds).
struct StepTimes {
  std::atomic<int64_t> first_need{INT64_MAX};
  std::atomic<int64_t> last_held{0};
};

void AtomicMin(std::atomic<int64_t>& a, int64_t v) {
  int64_t cur = a.load();
  while (v < cur && !a.compare_exchange_weak(cur, v)) {
  }
}
void AtomicMax(std::atomic<int64_t>& a, int64_t v) {
  int64_t cur = a.load();
  while (v > cur && !a.compare_exchange_weak(cur, v)) {
  }
}

// One client thread's share of the workers: their channels, streams and
// completion queue. Thread-compatible: used by the one thread that owns it.
class ClientShard {
 public:
  // `ranks_per_relay` > 0: each run of that many consecutive ranks is one
  // host whose relay holds the streams and sends their messages together.
  ClientShard(const std::string& address, std::vector<int> ranks, int channels,
              int shard_index, bool stream, bool stream_reports,
              std::string votes, int ranks_per_relay)
      : stream_(stream),
        stream_reports_(stream_reports),
        votes_(std::move(votes)),
        group_(std::max(1, ranks_per_relay)),
        workers_(ranks.size()) {
    for (size_t i = 0; i < ranks.size(); ++i) workers_[i].rank = ranks[i];
    for (int c = 0; c < channels; ++c) {
      grpc::ChannelArguments args;
      // Distinct arguments keep gRPC from sharing one connection between the
      // channels.
      args.SetInt("hsdp.bench.channel", shard_index * 1000 + c);
      stubs_.push_back(CoordinatorService::NewStub(grpc::CreateCustomChannel(
          address, grpc::InsecureChannelCredentials(), args)));
    }
  }

  ~ClientShard() {
    for (Worker& w : workers_) {
      if (w.stream_context) w.stream_context->TryCancel();
      if (w.report_stream_context) w.report_stream_context->TryCancel();
    }
    cq_.Shutdown();
    void* tag;
    bool ok;
    while (cq_.Next(&tag, &ok)) {
    }
  }

  bool JoinAll(int layers) {
    for (size_t i = 0; i < workers_.size(); ++i) {
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + kRpcTimeout);
      hsdp::v1::JoinResponse response;
      grpc::Status s =
          Stub(i).Join(&context, MakeJoin(workers_[i].rank, layers), &response);
      if (!s.ok()) {
        std::fprintf(stderr, "join rank %d: %s\n", workers_[i].rank,
                     s.error_message().c_str());
        return false;
      }
      workers_[i].worker_id = response.worker_id();
      workers_[i].generation = response.generation();
    }
    if (stream_reports_) {
      for (size_t i = 0; i < workers_.size(); i += group_) {
        Worker& w = workers_[i];
        w.report_stream_context = std::make_unique<grpc::ClientContext>();
        w.report_writer = Stub(i).AsyncStreamReports(
            w.report_stream_context.get(), &w.report_stream_response, &cq_,
            Tag(i, kReportStreamStarted));
      }
      // A stream takes writes once it started.
      pending_started_ = Hosts();
      while (pending_started_ > 0) {
        if (!Pump()) return false;
      }
    }
    if (!stream_) return true;
    for (size_t i = 0; i < workers_.size(); i += group_) {
      Worker& w = workers_[i];
      w.stream_context = std::make_unique<grpc::ClientContext>();
      hsdp::v1::WatchSchedulesRequest request;
      request.set_job_id(kJob);
      request.set_rank(w.rank);
      request.set_from_step(0);
      w.reader = Stub(i).AsyncWatchSchedules(w.stream_context.get(), request,
                                             &cq_, Tag(i, kStreamStarted));
    }
    return true;
  }

  // Burst step: every worker needs `step` now; then every worker reports it.
  // Appends the waits (seconds) and updates `times`. False on any error.
  bool BurstStep(int64_t step, StepTimes* times, std::vector<double>* waits) {
    const Clock::time_point need = Clock::now();
    AtomicMin(times->first_need, Nanos(need));
    size_t pending = workers_.size();
    for (size_t i = 0; i < workers_.size(); ++i) {
      Worker& w = workers_[i];
      w.need = need;
      w.needed_step = step;
      if (!stream_) {
        StartFetch(i, step);
      } else if (workers_[Leader(i)].received.count(step) > 0) {
        w.held = need;  // pushed before it was needed
        --pending;
      }
    }
    pending_held_ = pending;
    while (pending_held_ > 0) {
      if (!Pump()) return false;
    }
    for (Worker& w : workers_) {
      waits->push_back(std::chrono::duration<double>(w.held - w.need).count());
      AtomicMax(times->last_held, Nanos(w.held));
      w.received.erase(w.received.begin(), w.received.upper_bound(step));
    }
    if (votes_ != "none") {
      // Each vote returns once every rank voted: the commit round.
      pending_votes_ = Hosts();
      for (size_t i = 0; i < workers_.size(); i += group_) StartVote(i, step);
      while (pending_votes_ > 0) {
        if (!Pump()) return false;
      }
    }
    pending_reports_ = Hosts();
    for (size_t i = 0; i < workers_.size(); i += group_) StartReport(i, step);
    while (pending_reports_ > 0) {
      if (!Pump()) return false;
    }
    return true;
  }

  // Handles completions (pushes arriving, reports sent) for `period`, as a
  // worker's agent does while its training thread computes. False on an error.
  bool PumpFor(std::chrono::milliseconds period) {
    const Clock::time_point until = Clock::now() + period;
    while (Clock::now() < until) {
      if (!Pump(until)) return false;
    }
    return true;
  }

  // Paced steps: worker k needs step s at start + phase_k + s * period, then
  // reports it. Appends the waits; false on any error.
  bool RunPaced(int64_t first_step, int64_t steps,
                std::chrono::microseconds period, int world,
                Clock::time_point start, std::vector<StepTimes>* times,
                std::vector<double>* waits) {
    paced_times_ = times;
    paced_waits_ = waits;
    paced_first_ = first_step;
    period_ = period;
    for (Worker& w : workers_) {
      w.paced_step = first_step;
      w.next = start + period * w.rank / world;
      w.busy = false;
    }
    size_t finished = 0;
    while (finished < workers_.size()) {
      Clock::time_point wake = Clock::now() + period;
      for (size_t i = 0; i < workers_.size(); ++i) {
        Worker& w = workers_[i];
        if (w.busy || w.paced_step >= first_step + steps) continue;
        if (w.next > Clock::now()) {
          wake = std::min(wake, w.next);
          continue;
        }
        w.busy = true;
        w.need = Clock::now();
        w.needed_step = w.paced_step;
        AtomicMin((*times)[w.paced_step - first_step].first_need,
                  Nanos(w.need));
        if (!stream_) {
          StartFetch(i, w.paced_step);
        } else if (w.received.count(w.paced_step) > 0) {
          w.held = w.need;
          HeldPaced(i);
        }
      }
      if (!Pump(wake)) return false;
      finished = 0;
      for (const Worker& w : workers_) {
        finished += !w.busy && w.paced_step >= first_step + steps;
      }
    }
    return true;
  }

 private:
  enum TagKind : uintptr_t {
    kStreamStarted = 0,
    kStreamRead = 1,
    kFetched = 2,
    kReported = 3,
    kReportStreamStarted = 4,
    kVoted = 5,
    kVoteWritten = 6,
  };
  static constexpr int kTagBits = 3;

  struct Worker {
    int rank = 0;
    int64_t worker_id = 0;
    int64_t generation = 0;
    // Stream transport.
    std::unique_ptr<grpc::ClientContext> stream_context;
    std::unique_ptr<grpc::ClientAsyncReader<hsdp::v1::WatchSchedulesResponse>>
        reader;
    hsdp::v1::WatchSchedulesResponse incoming;
    std::map<int64_t, Clock::time_point> received;
    // Unary transport.
    std::unique_ptr<grpc::ClientContext> fetch_context;
    std::unique_ptr<
        grpc::ClientAsyncResponseReader<hsdp::v1::GetScheduleResponse>>
        fetch;
    hsdp::v1::GetScheduleResponse fetched;
    grpc::Status fetch_status;
    // Reports.
    std::unique_ptr<grpc::ClientContext> report_context;
    std::unique_ptr<
        grpc::ClientAsyncResponseReader<hsdp::v1::ReportStepResponse>>
        report;
    hsdp::v1::ReportStepResponse reported;
    grpc::Status report_status;
    // Streamed reports: a write completes as kReported.
    std::unique_ptr<grpc::ClientContext> report_stream_context;
    std::unique_ptr<grpc::ClientAsyncWriter<hsdp::v1::StreamReportsRequest>>
        report_writer;
    hsdp::v1::StreamReportsResponse report_stream_response;
    // Votes: a call, or a message on the report stream answered on the
    // schedule stream (both the write and the commit complete the vote).
    std::unique_ptr<grpc::ClientContext> vote_context;
    std::unique_ptr<
        grpc::ClientAsyncResponseReader<hsdp::v1::CommitStepResponse>>
        vote;
    hsdp::v1::CommitStepResponse voted;
    grpc::Status vote_status;
    int64_t voted_step = -1;
    int64_t committed_step = -1;
    bool vote_written = true;
    bool vote_answered = true;
    // The step it waits for, since when, and when it held it.
    int64_t needed_step = -1;
    Clock::time_point need, held;
    // Paced mode.
    int64_t paced_step = 0;
    Clock::time_point next;
    bool busy = false;
  };

  static void* Tag(size_t worker, TagKind kind) {
    return reinterpret_cast<void*>((worker << kTagBits) | kind);
  }

  // The worker whose streams carry worker `i`'s messages (itself without
  // relays), and how many such workers (hosts) there are.
  size_t Leader(size_t i) const { return i - i % group_; }
  size_t Hosts() const { return (workers_.size() + group_ - 1) / group_; }

  CoordinatorService::Stub& Stub(size_t worker) {
    return *stubs_[worker % stubs_.size()];
  }

  static std::unique_ptr<grpc::ClientContext> Context() {
    auto context = std::make_unique<grpc::ClientContext>();
    context->set_deadline(std::chrono::system_clock::now() + kRpcTimeout);
    return context;
  }

  void StartFetch(size_t i, int64_t step) {
    Worker& w = workers_[i];
    hsdp::v1::GetScheduleRequest request;
    request.set_job_id(kJob);
    request.set_rank(w.rank);
    request.set_step(step);
    w.fetch_context = Context();
    w.fetch = Stub(i).AsyncGetSchedule(w.fetch_context.get(), request, &cq_);
    w.fetch->Finish(&w.fetched, &w.fetch_status, Tag(i, kFetched));
  }

  hsdp::v1::ReportStepRequest MakeReport(size_t i, int64_t step) const {
    hsdp::v1::ReportStepRequest request;
    request.set_job_id(kJob);
    hsdp::v1::StepReport* report = request.mutable_report();
    report->set_rank(workers_[i].rank);
    report->set_step(step);
    report->set_loss(2.0);
    report->set_step_seconds(0.5);
    report->set_peak_memory_bytes(int64_t{8} << 30);
    return request;
  }

  // The ranks after `leader` on its host (none without relays).
  size_t RelayedEnd(size_t leader) const {
    return std::min(workers_.size(), leader + group_);
  }

  // Worker `i`'s report; with relays, its host's reports in one message.
  void StartReport(size_t i, int64_t step) {
    Worker& w = workers_[i];
    hsdp::v1::ReportStepRequest request = MakeReport(i, step);
    if (stream_reports_) {
      w.report_status = grpc::Status::OK;
      hsdp::v1::StreamReportsRequest message;
      *message.mutable_report() = std::move(request);
      for (size_t j = i + 1; j < RelayedEnd(i); ++j) {
        *message.add_relayed()->mutable_report() = MakeReport(j, step);
      }
      w.report_writer->Write(message, Tag(i, kReported));
      return;
    }
    w.report_context = Context();
    w.report = Stub(i).AsyncReportStep(w.report_context.get(), request, &cq_);
    w.report->Finish(&w.reported, &w.report_status, Tag(i, kReported));
  }

  hsdp::v1::CommitStepRequest MakeVote(size_t i, int64_t step) const {
    hsdp::v1::CommitStepRequest request;
    request.set_job_id(kJob);
    request.set_worker_id(workers_[i].worker_id);
    request.set_generation(workers_[i].generation);
    request.set_step(step);
    return request;
  }

  // Worker `i`'s vote; with relays, its host's votes in one message.
  void StartVote(size_t i, int64_t step) {
    Worker& w = workers_[i];
    hsdp::v1::CommitStepRequest request = MakeVote(i, step);
    w.voted_step = step;
    if (votes_ == "stream") {
      w.vote_written = false;
      w.vote_answered = w.committed_step >= step;
      hsdp::v1::StreamReportsRequest message;
      *message.mutable_vote() = std::move(request);
      for (size_t j = i + 1; j < RelayedEnd(i); ++j) {
        *message.add_relayed()->mutable_vote() = MakeVote(j, step);
      }
      w.report_writer->Write(message, Tag(i, kVoteWritten));
      return;
    }
    w.vote_context = Context();
    w.vote = Stub(i).AsyncCommitStep(w.vote_context.get(), request, &cq_);
    w.vote->Finish(&w.voted, &w.vote_status, Tag(i, kVoted));
  }

  // A streamed vote is done once written (the stream takes one write at a
  // time) and answered.
  void VoteProgress(Worker& w) {
    if (w.vote_written && w.vote_answered) --pending_votes_;
  }

  // A paced worker holds its step: record, then report.
  void HeldPaced(size_t i) {
    Worker& w = workers_[i];
    paced_waits_->push_back(
        std::chrono::duration<double>(w.held - w.need).count());
    AtomicMax((*paced_times_)[w.paced_step - paced_first_].last_held,
              Nanos(w.held));
    w.received.erase(w.received.begin(), w.received.upper_bound(w.paced_step));
    StartReport(i, w.paced_step);
  }

  // Handles one completion (waiting at most until `until`). False on an
  // error.
  bool Pump(Clock::time_point until = Clock::time_point::max()) {
    void* tag;
    bool ok;
    if (until == Clock::time_point::max()) {
      if (!cq_.Next(&tag, &ok)) return false;
    } else {
      // gRPC takes system_clock deadlines only.
      const auto got = cq_.AsyncNext(
          &tag, &ok,
          std::chrono::system_clock::now() +
              std::chrono::duration_cast<std::chrono::system_clock::duration>(
                  until - Clock::now()));
      if (got == grpc::CompletionQueue::SHUTDOWN) return false;
      if (got == grpc::CompletionQueue::TIMEOUT) return true;
    }
    const auto bits = reinterpret_cast<uintptr_t>(tag);
    const size_t i = bits >> kTagBits;
    Worker& w = workers_[i];
    const Clock::time_point now = Clock::now();
    switch (static_cast<TagKind>(bits & ((1 << kTagBits) - 1))) {
      case kReportStreamStarted:
        if (!ok) return Fail("StreamReports did not start");
        --pending_started_;
        return true;
      case kStreamStarted:
        if (!ok) return Fail("WatchSchedules did not start");
        w.reader->Read(&w.incoming, Tag(i, kStreamRead));
        return true;
      case kStreamRead: {
        if (!ok) return Fail("WatchSchedules ended");
        if (w.incoming.has_committed()) {
          w.committed_step =
              std::max(w.committed_step, w.incoming.committed().step());
          if (!w.vote_answered && w.committed_step >= w.voted_step) {
            w.vote_answered = true;
            VoteProgress(w);
          }
          // A commit alone carries no step.
          if (w.incoming.schedule().empty()) {
            w.reader->Read(&w.incoming, Tag(i, kStreamRead));
            return true;
          }
        }
        const int64_t step = w.incoming.step();
        if (w.incoming.schedule().empty()) return Fail("empty schedule pushed");
        w.received[step] = now;
        w.reader->Read(&w.incoming, Tag(i, kStreamRead));
        // With relays the host's relay hands the step to each of its ranks.
        for (size_t j = i; j < RelayedEnd(i); ++j) {
          Worker& r = workers_[j];
          if (step == r.needed_step && r.held < r.need) {
            r.held = now;
            if (paced_times_ != nullptr && r.busy) {
              HeldPaced(j);
            } else {
              --pending_held_;
            }
          }
        }
        return true;
      }
      case kFetched:
        if (!ok || !w.fetch_status.ok() ||
            w.fetched.schedule().step() != w.needed_step) {
          return Fail(
              absl::StrCat("GetSchedule: ", w.fetch_status.error_message()));
        }
        w.held = now;
        if (paced_times_ != nullptr) {
          HeldPaced(i);
        } else {
          --pending_held_;
        }
        return true;
      case kVoted:
        if (!ok || !w.vote_status.ok()) {
          return Fail(
              absl::StrCat("CommitStep: ", w.vote_status.error_message()));
        }
        --pending_votes_;
        return true;
      case kVoteWritten:
        if (!ok) return Fail("StreamReports: the vote was not written");
        w.vote_written = true;
        VoteProgress(w);
        return true;
      case kReported:
        if (!ok || !w.report_status.ok()) {
          return Fail(
              absl::StrCat("ReportStep: ", w.report_status.error_message()));
        }
        if (paced_times_ != nullptr) {
          w.busy = false;
          ++w.paced_step;
          w.next += period_;
        } else {
          --pending_reports_;
        }
        return true;
    }
    return false;
  }

  bool Fail(const std::string& what) {
    std::fprintf(stderr, "%s\n", what.c_str());
    return false;
  }

  const bool stream_;
  const bool stream_reports_;
  const std::string votes_;
  const size_t group_;
  std::vector<Worker> workers_;
  std::vector<std::unique_ptr<CoordinatorService::Stub>> stubs_;
  grpc::CompletionQueue cq_;
  size_t pending_started_ = 0;
  size_t pending_held_ = 0;
  size_t pending_reports_ = 0;
  size_t pending_votes_ = 0;
  std::vector<StepTimes>* paced_times_ = nullptr;
  std::vector<double>* paced_waits_ = nullptr;
  int64_t paced_first_ = 0;
  std::chrono::microseconds period_{0};
};

struct Result {
  double hold_p50_ms = 0, hold_p99_ms = 0;
  double wait_p50_ms = 0, wait_p99_ms = 0, wait_max_ms = 0;
  double schedules_per_second = 0;
  double step_ms = 0;
  double cpu_ms_per_step = 0;
};

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  const size_t k = std::min(
      v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())));
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k),
                   v.end());
  return v[k];
}

bool RunOne(const Options& options, int n, Result* result) {
  const bool stream = options.transport == "stream";
  std::vector<std::string> args = {"coordinator_bench", "--serve",
                                   std::to_string(n), "--push-ahead",
                                   std::to_string(options.push_ahead)};
  if (!options.state_dir.empty()) {
    const std::string dir =
        absl::StrCat(options.state_dir, "/n", n, "-", options.transport);
    std::filesystem::remove_all(dir);
    args.push_back("--state-dir");
    args.push_back(dir);
  }
  Child child;
  if (!child.Start(args)) {
    std::fprintf(stderr, "the coordinator child did not start\n");
    return false;
  }
  const int threads = options.client_threads;
  std::vector<std::unique_ptr<ClientShard>> shards;
  // With relays, whole hosts (consecutive ranks) go to each client thread.
  const int group = std::max(1, options.ranks_per_relay);
  for (int t = 0; t < threads; ++t) {
    std::vector<int> ranks;
    for (int h = t; h * group < n; h += threads) {
      for (int r = h * group; r < std::min(n, (h + 1) * group); ++r) {
        ranks.push_back(r);
      }
    }
    shards.push_back(std::make_unique<ClientShard>(
        child.address(), std::move(ranks), options.channels_per_thread, t,
        stream, options.reports == "stream", options.votes,
        options.ranks_per_relay));
  }
  const int64_t total_steps = kWarmupSteps + options.steps;
  std::vector<StepTimes> times(static_cast<size_t>(total_steps));
  std::vector<std::vector<double>> waits(threads);
  std::atomic<bool> failed{false};
  absl::Barrier* joined = new absl::Barrier(threads);
  absl::Barrier* warmed = new absl::Barrier(threads + 1);
  absl::Barrier* go = new absl::Barrier(threads + 1);
  std::vector<absl::Barrier*> step_barriers;
  for (int64_t s = 0; s < total_steps; ++s) {
    step_barriers.push_back(new absl::Barrier(threads));
  }
  std::vector<std::thread> clients;
  for (int t = 0; t < threads; ++t) {
    clients.emplace_back([&, t] {
      ClientShard& shard = *shards[t];
      if (!shard.JoinAll(options.layers)) failed = true;
      // No rank trains a step before every rank joined (its collectives need
      // them all).
      if (joined->Block()) delete joined;
      std::vector<double> ignored;
      // Every step: all need it, all report, then everybody waits for
      // everybody (the collectives).
      auto burst = [&](int64_t s, std::vector<double>* w) {
        if (!failed && !shard.BurstStep(s, &times[s], w)) failed = true;
        if (step_barriers[s]->Block()) delete step_barriers[s];
        if (!failed && options.compute_ms > 0 &&
            !shard.PumpFor(std::chrono::milliseconds(options.compute_ms))) {
          failed = true;
        }
      };
      for (int64_t s = 0; s < kWarmupSteps; ++s) burst(s, &ignored);
      if (warmed->Block()) delete warmed;
      if (go->Block()) delete go;
      if (options.paced_step_ms > 0) {
        if (!failed &&
            !shard.RunPaced(kWarmupSteps, options.steps,
                            std::chrono::milliseconds(options.paced_step_ms), n,
                            Clock::now(), &times, &waits[t])) {
          failed = true;
        }
        for (int64_t s = kWarmupSteps; s < total_steps; ++s) {
          if (step_barriers[s]->Block()) delete step_barriers[s];
        }
        return;
      }
      for (int64_t s = kWarmupSteps; s < total_steps; ++s) burst(s, &waits[t]);
    });
  }
  if (warmed->Block()) delete warmed;
  const double cpu_before = child.CpuSeconds();
  const Clock::time_point start = Clock::now();
  if (go->Block()) delete go;
  for (auto& c : clients) c.join();
  const double seconds =
      std::chrono::duration<double>(Clock::now() - start).count();
  const double cpu = child.CpuSeconds() - cpu_before;
  shards.clear();
  if (failed) return false;
  std::vector<double> all, holds;
  for (auto& w : waits) all.insert(all.end(), w.begin(), w.end());
  for (int64_t s = kWarmupSteps; s < total_steps; ++s) {
    holds.push_back(1e-9 * static_cast<double>(times[s].last_held.load() -
                                               times[s].first_need.load()));
  }
  result->hold_p50_ms = 1e3 * Percentile(holds, 0.50);
  result->hold_p99_ms = 1e3 * Percentile(holds, 0.99);
  result->wait_p50_ms = 1e3 * Percentile(all, 0.50);
  result->wait_p99_ms = 1e3 * Percentile(all, 0.99);
  result->wait_max_ms = 1e3 * *std::max_element(all.begin(), all.end());
  result->schedules_per_second = static_cast<double>(all.size()) / seconds;
  result->step_ms = 1e3 * seconds / options.steps;
  result->cpu_ms_per_step = 1e3 * cpu / options.steps;
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
  int serve = 0;
  app.add_option("--workers", workers,
                 "Comma-separated worker counts (first is the baseline)");
  app.add_option("--steps", options.steps, "Timed steps per run");
  app.add_option("--layers", options.layers,
                 "Transformer layers of the simulated model");
  app.add_option("--client-threads", options.client_threads, "Client threads");
  app.add_option("--channels", options.channels_per_thread,
                 "Connections per client thread");
  app.add_option("--paced-step-ms", options.paced_step_ms,
                 "Paced mode: step period in ms, workers spread over it "
                 "(default 0: burst mode)");
  app.add_option("--compute-ms", options.compute_ms,
                 "Burst mode: compute time per step between the barrier and "
                 "the next step (default 0)");
  app.add_option("--state-dir", options.state_dir,
                 "Persist sealed steps (fsync) under DIR");
  app.add_option("--transport", options.transport,
                 "unary (GetSchedule) or stream (WatchSchedules)")
      ->check(CLI::IsMember({"unary", "stream"}));
  app.add_option("--reports", options.reports,
                 "stream (StreamReports, as workers send them) or unary "
                 "(ReportStep per step)")
      ->check(CLI::IsMember({"unary", "stream"}));
  app.add_option("--votes", options.votes,
                 "Burst mode: stream (on the report stream, the commit on the "
                 "schedule stream, as workers vote; needs --transport stream "
                 "and --reports stream), unary (CommitStep per step) or none; "
                 "default: stream where it can, else unary")
      ->check(CLI::IsMember({"stream", "unary", "none"}));
  app.add_option("--ranks-per-relay", options.ranks_per_relay,
                 "Burst mode over both streams: simulate one host relay per "
                 "this many ranks (hsdp-relay: one schedule stream and one "
                 "report stream per host, the host's reports and votes in one "
                 "message; default 0: a stream pair per rank)");
  app.add_option("--push-ahead", options.push_ahead,
                 "Stream: steps pushed past the slowest rank's next step");
  app.add_option("--serve", serve, "(internal) run the coordinator child");
  CLI11_PARSE(app, argc, argv);
  if (serve > 0) return Serve(options, serve);
  if (options.votes.empty()) {
    options.votes = options.transport == "stream" && options.reports == "stream"
                        ? "stream"
                        : "unary";
  }
  if (options.paced_step_ms > 0) options.votes = "none";
  if (options.votes == "stream" &&
      (options.transport != "stream" || options.reports != "stream")) {
    std::fprintf(stderr,
                 "--votes stream needs --transport stream and --reports "
                 "stream (the vote goes up one, the commit down the other)\n");
    return 2;
  }
  if (options.ranks_per_relay > 0 &&
      (options.paced_step_ms > 0 || options.transport != "stream" ||
       options.reports != "stream" || options.votes == "unary")) {
    std::fprintf(stderr,
                 "--ranks-per-relay needs burst mode, --transport stream, "
                 "--reports stream and --votes stream or none (a relay "
                 "carries streams)\n");
    return 2;
  }
  options.workers.clear();
  for (absl::string_view w : absl::StrSplit(workers, ',')) {
    options.workers.push_back(std::stoi(std::string(w)));
  }

  std::printf(
      "coordinator_bench: %s, transport %s%s, reports %s, votes %s%s, %d "
      "steps (+%d warm-up), %d units, %d client threads x %d channels, %s; "
      "the coordinator in its own process\n",
      options.paced_step_ms > 0
          ? absl::StrCat("paced mode (step ", options.paced_step_ms, " ms)")
                .c_str()
          : absl::StrCat("burst mode (all ranks at once, barrier per step, ",
                         options.compute_ms, " ms compute)")
                .c_str(),
      options.transport.c_str(),
      options.transport == "stream"
          ? absl::StrCat(" (push ahead ", options.push_ahead, ")").c_str()
          : "",
      options.reports.c_str(), options.votes.c_str(),
      options.ranks_per_relay > 0
          ? absl::StrCat(", a relay per ", options.ranks_per_relay, " ranks")
                .c_str()
          : "",
      options.steps, kWarmupSteps, options.layers + 1, options.client_threads,
      options.channels_per_thread,
      options.state_dir.empty() ? "no persistence" : "persistence with fsync");
  std::printf("%7s %10s %10s %10s %10s %10s %12s %9s %12s %12s %8s %7s\n",
              "workers", "hold_p50", "hold_p99", "wait_p50", "wait_p99",
              "wait_max", "schedules/s", "step_ms", "coord_cpu_ms", "us/worker",
              "cost/N0", "linear");
  double baseline_cpu = 0;
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
      baseline_cpu = r.cpu_ms_per_step;
    }
    // In paced mode the workers need a step at their own phases: the spread
    // from the first to the last is the period, not a delivery time.
    const bool paced = options.paced_step_ms > 0;
    std::printf(
        "%7d %10s %10s %10.3f %10.3f %10.3f %12.0f %9.2f %12.3f %12.2f %8.2f "
        "%7.2f\n",
        n, paced ? "-" : absl::StrFormat("%.3f", r.hold_p50_ms).c_str(),
        paced ? "-" : absl::StrFormat("%.3f", r.hold_p99_ms).c_str(),
        r.wait_p50_ms, r.wait_p99_ms, r.wait_max_ms, r.schedules_per_second,
        r.step_ms, r.cpu_ms_per_step, 1e3 * r.cpu_ms_per_step / n,
        r.cpu_ms_per_step / baseline_cpu, static_cast<double>(n) / baseline_n);
    std::fflush(stdout);
  }
  return ok ? 0 : 1;
}
