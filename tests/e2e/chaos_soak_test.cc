// The chaos soak (label chaos; not in the default test set, see
// tests/e2e/CMakeLists.txt and docs/testing.md "Chaos soak"). A 2x2 job of
// real processes, each in its own network namespace ("pod"), trains for
// hundreds of steps while a driver injects one fault at a time:
//   - SIGKILL or SIGSTOP (then SIGCONT) of a worker or of the coordinator;
//   - a worker's or the coordinator's link delayed and lossy (tc), or cut;
//   - the coordinator's state disk (a size-limited tmpfs) filled up.
// A supervisor restarts every process that exits before the job is done, with
// the same command line, as a Kubernetes pod would be restarted. A fault is
// recovered when a step commits after it ends. The job must either finish, or
// stop with a clear error (the coordinator reports FAILED with a reason). It
// must never go without a committed step for longer than its timeouts allow (a
// hang), and every restarted coordinator must read its state directory. A
// finished job lost and doubled no update: the sample ledger over every report
// file is exact, and its final parameters are bitwise those of an undisturbed
// run of the same mesh history (the reduction order follows the mesh, so a
// fixed tolerance against single-process training cannot tell drift from a
// lost update; that distance is printed). The counts are printed at the end.
//
//   build/tests/e2e/chaos_soak_test   (root; env HSDP_CHAOS_STEPS,
//   HSDP_CHAOS_SEED, HSDP_CHAOS_FAULTS=kill-worker,stop-coordinator,...,
//   HSDP_CHAOS_KEEP=1 keeps the scratch directory with every log)
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <regex>
#include <set>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "tests/e2e/chaos_env.h"
#include "tests/e2e/cluster.h"

namespace hsdp::e2e {
namespace {

namespace fs = std::filesystem;
using std::chrono::milliseconds;
using std::chrono::seconds;

constexpr int kReplicas = 2;
constexpr int kShards = 2;
constexpr int kWorld = kReplicas * kShards;
// The job's global batch: one microbatch per rank of the full mesh (FIXED
// batch mode keeps it on every smaller one).
constexpr int kGlobalMicrobatches = kWorld;
constexpr int kPort = 50051;
constexpr int kCheckpointInterval = 25;
constexpr int64_t kStateDiskBytes = 32 << 20;
// A new longest time without a committed step above this is said as it
// happens, with the last fault injected.
constexpr double kSayGapAbove = 5.0;

// The longest a fault may leave the job without a committed step once it
// ended: the collective timeout (30 s) + heartbeat timeout + reform window +
// a restart and a rendezvous, with room for a loaded 2-core machine.
constexpr auto kRecoveryBound = seconds(180);
constexpr auto kRestartBackoff = milliseconds(1000);
constexpr auto kPoll = milliseconds(100);

int EnvInt(const char* name, int fallback) {
  const char* v = std::getenv(name);
  int out = 0;
  return v != nullptr && absl::SimpleAtoi(v, &out) ? out : fallback;
}

enum class Fault {
  kKillWorker,
  kStopWorker,
  kKillCoordinator,
  kStopCoordinator,
  kLossyLink,
  kCutLink,
  kFullDisk,
};
constexpr Fault kFaults[] = {Fault::kKillWorker,      Fault::kStopWorker,
                             Fault::kKillCoordinator, Fault::kStopCoordinator,
                             Fault::kLossyLink,       Fault::kCutLink,
                             Fault::kFullDisk};

const char* FaultName(Fault f) {
  switch (f) {
    case Fault::kKillWorker:
      return "kill-worker";
    case Fault::kStopWorker:
      return "stop-worker";
    case Fault::kKillCoordinator:
      return "kill-coordinator";
    case Fault::kStopCoordinator:
      return "stop-coordinator";
    case Fault::kLossyLink:
      return "lossy-link";
    case Fault::kCutLink:
      return "cut-link";
    case Fault::kFullDisk:
      return "full-disk";
  }
  return "?";
}

// HSDP_CHAOS_FAULTS: a comma-separated subset of the fault names (default:
// all of them).
std::vector<Fault> FaultsFromEnv() {
  const char* v = std::getenv("HSDP_CHAOS_FAULTS");
  std::vector<Fault> out;
  for (const Fault f : kFaults) {
    if (v == nullptr) {
      out.push_back(f);
      continue;
    }
    for (absl::string_view name : absl::StrSplit(v, ',')) {
      if (name == FaultName(f)) out.push_back(f);
    }
  }
  return out;
}

// A generation as the coordinator's log says it formed ("generation 3 formed:
// mesh 1x2, from step 120, 1 rank(s) to heal[, restored from the checkpoint of
// step 99]"). Generation 0 is the job's first and is not logged.
struct FormedGeneration {
  int replicas = 0;
  int64_t start_step = 0;
  bool restored = false;
};

std::map<int64_t, FormedGeneration> FormedGenerations(const std::string& log) {
  static const std::regex formed(
      "generation ([0-9]+) formed: mesh ([0-9]+)x[0-9]+, from step ([0-9]+)");
  std::map<int64_t, FormedGeneration> out;
  for (const std::string& line : Lines(log)) {
    std::smatch m;
    if (!std::regex_search(line, m, formed)) continue;
    FormedGeneration g;
    int64_t number = 0;
    if (!absl::SimpleAtoi(m[1].str(), &number) ||
        !absl::SimpleAtoi(m[2].str(), &g.replicas) ||
        !absl::SimpleAtoi(m[3].str(), &g.start_step)) {
      continue;
    }
    g.restored = line.find("restored from the checkpoint") != std::string::npos;
    out[number] = g;
  }
  return out;
}

struct LedgerCounts {
  int64_t lines = 0;
  // Lines of steps a later generation trained again after restoring a
  // checkpoint from before them (their updates were rolled back).
  int64_t superseded = 0;
  // Microbatches of a committed step whose line a process never wrote: it
  // was killed between the commit and the line, or it lost the answer to its
  // commit vote (declared lost while partitioned or stopped) and was healed.
  int64_t unwritten = 0;
};

// The sample ledger of the whole run, over every report file of every
// incarnation: once the superseded lines are set aside, each global microbatch
// of steps [0, steps) is trained exactly once. A microbatch may be missing
// only from the step after a file's last line before its process lost its
// place, at most that line's share: the last line of a killed process (the
// kill landed between the commit and the line), a line after which the same
// process trained again only in a later generation (it voted, lost the answer
// while partitioned or stopped, was declared lost, and was healed from a peer
// that applied the step), or the last line of a file that ends before the
// last step (the same, but the process then stood by to the end). The step's
// update is not lost then: the final parameters' bitwise comparison with the
// replayed mesh history checks that. Anything else is a lost or a doubled
// update.
// `world_of_step` gets the world size each step was trained on (as it counts).
LedgerCounts ExpectLedgerExact(
    const std::vector<std::string>& reports,
    const std::set<std::string>& killed, int steps, int global_microbatches,
    const std::map<int64_t, FormedGeneration>& generations,
    std::map<int64_t, int>* world_of_step) {
  LedgerCounts counts;
  std::map<int64_t, int> seen;
  // Step after a killed file's last line -> the microbatches it may miss.
  std::map<int64_t, int64_t> may_miss;
  for (const std::string& path : reports) {
    const std::vector<ReportLine> lines = ReadReportLines(path);
    if (!lines.empty() &&
        (killed.count(path) > 0 || lines.back().step < steps - 1)) {
      may_miss[lines.back().step + 1] += lines.back().microbatch_count;
    }
    for (size_t i = 0; i + 1 < lines.size(); ++i) {
      if (lines[i + 1].generation > lines[i].generation &&
          lines[i + 1].step > lines[i].step + 1) {
        may_miss[lines[i].step + 1] += lines[i].microbatch_count;
      }
    }
    for (const ReportLine& l : lines) {
      ++counts.lines;
      auto own = generations.find(l.generation);
      if (own != generations.end()) {
        EXPECT_GE(l.step, own->second.start_step)
            << path << ": step " << l.step << " of generation " << l.generation
            << ", which started at step " << own->second.start_step;
      }
      bool rolled_back = false;
      for (auto later = generations.upper_bound(l.generation);
           later != generations.end(); ++later) {
        rolled_back |=
            later->second.restored && later->second.start_step <= l.step;
      }
      if (rolled_back) {
        ++counts.superseded;
        continue;
      }
      auto [world, added] = world_of_step->try_emplace(l.step, l.world);
      EXPECT_TRUE(added || world->second == l.world)
          << path << ": step " << l.step << " on " << l.world << " ranks, "
          << "elsewhere on " << world->second;
      for (int64_t g = l.first_microbatch;
           g < l.first_microbatch + l.microbatch_count; ++g) {
        ++seen[g];
      }
    }
  }
  for (int64_t g = 0; g < int64_t{steps} * global_microbatches; ++g) {
    EXPECT_LE(seen[g], 1) << "microbatch " << g << " (step "
                          << g / global_microbatches << ") trained twice";
    if (seen[g] > 0) continue;
    int64_t& allowance = may_miss[g / global_microbatches];
    EXPECT_GT(allowance, 0) << "microbatch " << g << " of committed step "
                            << g / global_microbatches << " is in no ledger";
    if (allowance > 0) {
      --allowance;
      ++counts.unwritten;
    }
  }
  return counts;
}

// Steps [first_step, last_step] trained on `world` ranks.
struct Segment {
  int64_t first_step = 0;
  int64_t last_step = 0;
  int world = 0;
};

// The runs of equal world sizes in the steps' history.
std::vector<Segment> Segments(const std::map<int64_t, int>& world_of_step) {
  std::vector<Segment> out;
  for (const auto& [step, world] : world_of_step) {
    if (!out.empty() && out.back().world == world &&
        out.back().last_step + 1 == step) {
      out.back().last_step = step;
    } else {
      out.push_back(Segment{step, step, world});
    }
  }
  return out;
}

// The undisturbed run of the same mesh sequence: one job per segment on its
// mesh with the same global batch, each resumed from the checkpoint the one
// before saved at its last step (the checkpoint interval is the segment's end).
// Returns its final parameters' path, or "" when a job failed (a test failure).
std::string ReplayMeshSequence(const std::vector<Segment>& segments,
                               const std::string& dir,
                               const std::vector<std::string>& flags) {
  const std::string ckpt = dir + "/replay-ckpt";
  const std::string params = dir + "/replay.pt";
  // Its own jobs' failures stop the replay, not the run's earlier ones: the
  // parameters are compared even when the ledger was not exact.
  const ::testing::TestResult& result =
      *::testing::UnitTest::GetInstance()->current_test_info()->result();
  const int parts_before = result.total_part_count();
  for (size_t i = 0; i < segments.size(); ++i) {
    const Segment& segment = segments[i];
    Cluster job(absl::StrCat("chaos-replay-", i));
    const std::string policy = job.dir() + "/policy.json";
    // A checkpoint at the segment's last step only: (step + 1) % interval.
    std::ofstream(policy) << "{\"checkpointInterval\": "
                          << segment.last_step + 1 << ", \"microbatches\": "
                          << kGlobalMicrobatches / segment.world << "}\n";
    job.StartCoordinator(segment.world,
                         absl::StrCat(segment.world / kShards, "x", kShards), 0,
                         policy);
    std::vector<std::string> extra = flags;
    extra.insert(extra.end(), {"--checkpoint-dir", ckpt, "--sync-checkpoint",
                               "--keep-checkpoints", "2", "--threads", "1",
                               "--final-params", params});
    job.StartWorkers(segment.world, extra, segment.last_step + 1);
    job.WaitWorkers();
    if (result.total_part_count() > parts_before) return "";
  }
  return params;
}

// The largest absolute difference between two --final-params archives
// (infinity, and a test failure, when their tensors differ in name).
double MaxDiff(const std::string& a, const std::string& b) {
  const auto got = LoadParams(a);
  const auto want = LoadParams(b);
  double max_diff = 0;
  EXPECT_EQ(got.size(), want.size()) << a << " vs " << b;
  for (const auto& [name, t] : want) {
    if (got.count(name) == 0) {
      ADD_FAILURE() << a << " has no " << name;
      return std::numeric_limits<double>::infinity();
    }
    max_diff =
        std::max(max_diff, (got.at(name) - t).abs().max().item<double>());
  }
  return max_diff;
}

// One pod: a process restarted with the same command line until it exits 0.
// Each incarnation writes its own report and final-parameter files.
struct Pod {
  std::string name;
  std::string address;
  int rank = -1;  // -1: the coordinator
  Proc proc;
  bool running = false;
  bool done = false;  // exited 0
  int last_rc = 0;
  int incarnations = 0;
  Clock::time_point restart_at;
  std::vector<std::string> reports;
  std::vector<std::string> params;
};

class ChaosSoak {
 public:
  ChaosSoak(Cluster& cluster, PodNetwork& net, SizedTmpfs& disk,
            std::string state_root, int steps, unsigned seed,
            std::vector<Fault> faults)
      : faults_(std::move(faults)),
        c_(cluster),
        net_(net),
        disk_(disk),
        state_root_(std::move(state_root)),
        steps_(steps),
        rng_(seed) {}

  ~ChaosSoak() {
    std::vector<Pod*> pods = {&coordinator_};
    for (Pod& w : workers_) pods.push_back(&w);
    for (Pod* p : pods) {
      if (!p->running) continue;
      kill(p->proc.pid, SIGKILL);
      waitpid(p->proc.pid, nullptr, 0);
    }
  }
  ChaosSoak(const ChaosSoak&) = delete;
  ChaosSoak& operator=(const ChaosSoak&) = delete;

  void AddPods() {
    coordinator_.name = "coordinator";
    coordinator_.address = *net_.AddPod(coordinator_.name);
    for (int r = 0; r < kWorld; ++r) {
      Pod w;
      w.name = absl::StrCat("worker", r);
      w.rank = r;
      absl::StatusOr<std::string> address = net_.AddPod(w.name);
      ASSERT_TRUE(address.ok()) << address.status();
      w.address = *address;
      workers_.push_back(w);
    }
  }

  void Start() {
    policy_ = c_.dir() + "/policy.json";
    std::ofstream(policy_) << "{\"checkpointInterval\": " << kCheckpointInterval
                           << "}\n";
    StartCoordinator();
    ASSERT_TRUE(WaitServing()) << ReadFile(coordinator_.proc.log);
    for (Pod& w : workers_) StartWorker(w);
  }

  // Runs the job to its end under faults. Returns false on a hang.
  bool Run() {
    const auto deadline = Clock::now() + seconds(60 * 60);
    auto next_fault = Clock::now() + seconds(8);
    int64_t lines_at_fault_end = -1;  // >= 0: waiting for a committed step
    Clock::time_point fault_ended;
    last_progress_ = Clock::now();
    last_commit_ = last_progress_;
    while (Clock::now() < deadline) {
      std::this_thread::sleep_for(kPoll);
      Supervise();
      if (failed_ || AllDone()) return true;
      const int64_t lines = CommittedLines();
      if (lines != lines_) {
        lines_ = lines;
        last_progress_ = Clock::now();
        const double gap =
            std::chrono::duration<double>(last_progress_ - last_commit_)
                .count();
        if (gap > max_gap_s_ && gap > kSayGapAbove) {
          std::cout << "chaos:   " << gap << " s without a committed step"
                    << (active_.empty() ? "" : " after ") << active_
                    << " (until report line " << lines << ")\n";
        }
        max_gap_s_ = std::max(max_gap_s_, gap);
        last_commit_ = last_progress_;
      }
      if (lines_at_fault_end >= 0 && lines > lines_at_fault_end) {
        const double took =
            std::chrono::duration<double>(Clock::now() - fault_ended).count();
        ++recovered_;
        max_recovery_s_ = std::max(max_recovery_s_, took);
        std::cout << "chaos:   recovered: a step committed " << took
                  << " s after the fault ended\n";
        lines_at_fault_end = -1;
        next_fault = Clock::now() + milliseconds(Uniform(1000, 4000));
      }
      if (Clock::now() - last_progress_ > kRecoveryBound) {
        std::cout << "chaos: HANG: no committed step for "
                  << std::chrono::duration_cast<seconds>(kRecoveryBound).count()
                  << " s" << (active_.empty() ? "" : " after ") << active_
                  << "\n";
        ++hangs_;
        return false;
      }
      // Faults until 90% of the steps: the end of the job is left alone.
      if (lines_at_fault_end < 0 && Clock::now() >= next_fault &&
          MaxStep() < steps_ * 9 / 10) {
        Inject();
        lines_at_fault_end = CommittedLines();
        fault_ended = Clock::now();
        last_progress_ = std::max(last_progress_, fault_ended);
      }
    }
    ++hangs_;
    std::cout << "chaos: HANG: the job did not end within an hour\n";
    return false;
  }

  // Kills the coordinator and starts it again on the state it left: it must
  // read it and report the job's final state.
  std::string RestartAndReadState() {
    kill(coordinator_.proc.pid, SIGKILL);
    waitpid(coordinator_.proc.pid, nullptr, 0);
    coordinator_.running = false;
    StartCoordinator();
    if (!WaitServing()) return "";
    return StatusField("state");
  }

  std::string FinalParams() const {
    std::string newest;
    fs::file_time_type when;
    for (const Pod& w : workers_) {
      for (const std::string& p : w.params) {
        std::error_code ec;
        const auto t = fs::last_write_time(p, ec);
        if (!ec && (newest.empty() || t > when)) {
          newest = p;
          when = t;
        }
      }
    }
    return newest;
  }

  const std::vector<std::string>& Flags() const { return flags_; }

  // Every report file of every worker incarnation, and those whose process
  // did not exit 0 (all but the last of each pod).
  std::vector<std::string> Reports() const {
    std::vector<std::string> out;
    for (const Pod& w : workers_) {
      out.insert(out.end(), w.reports.begin(), w.reports.end());
    }
    return out;
  }
  std::set<std::string> KilledReports() const {
    std::set<std::string> out;
    for (const Pod& w : workers_) {
      if (w.reports.size() > 1) {
        out.insert(w.reports.begin(), w.reports.end() - 1);
      }
    }
    return out;
  }
  std::string CoordinatorLog() const { return ReadFile(coordinator_.proc.log); }
  bool failed() const { return failed_; }
  const std::string& failure() const { return failure_; }

  void PrintCounts() const {
    std::vector<std::string> kinds;
    for (const auto& [kind, n] : injected_) {
      kinds.push_back(absl::StrCat(FaultName(kind), " ", n));
    }
    std::cout << "chaos: " << total_faults() << " faults injected ("
              << absl::StrJoin(kinds, ", ") << "); " << recovered_
              << " recovered (slowest " << max_recovery_s_ << " s); "
              << (failed_ ? 1 : 0) << " clear failures; " << hangs_
              << " hangs; " << restarts_ << " automatic restarts; "
              << unreadable_state_ << " unreadable state directories; "
              << "longest time without a committed step " << max_gap_s_ << " s"
              << std::endl;
    if (!impairments_.empty()) {
      std::cout << "chaos: link impairments: " << impairments_ << "\n";
    }
  }

  int hangs() const { return hangs_; }
  int unreadable_state() const { return unreadable_state_; }
  int total_faults() const {
    int n = 0;
    for (const auto& [kind, count] : injected_) n += count;
    return n;
  }
  int recovered() const { return recovered_; }

 private:
  int Uniform(int lo, int hi) {
    return std::uniform_int_distribution<int>(lo, hi)(rng_);
  }

  std::string CoordinatorAddress() const {
    return absl::StrCat(coordinator_.address, ":", kPort);
  }

  void StartCoordinator() {
    fs::remove(c_.dir() + "/port");
    std::vector<std::string> argv =
        CoordinatorArgv(c_.dir(), kWorld, absl::StrCat(kReplicas, "x", kShards),
                        absl::StrCat("0.0.0.0:", kPort),
                        {"--state-dir", state_root_ + "/state", "--policy-file",
                         policy_, "--heartbeat-timeout", "4", "--reform-window",
                         "2", "--join-wait", "30", "--min-replicas", "1"});
    coordinator_.proc = Spawn(net_.Exec(coordinator_.name, argv),
                              c_.dir() + "/coordinator.log");
    coordinator_.running = true;
    ++coordinator_.incarnations;
  }

  bool WaitServing() {
    const auto deadline = Clock::now() + seconds(30);
    while (Clock::now() < deadline) {
      int port = 0;
      if (absl::SimpleAtoi(
              absl::StripAsciiWhitespace(ReadFile(c_.dir() + "/port")),
              &port) &&
          port > 0) {
        return true;
      }
      int status = 0;
      if (waitpid(coordinator_.proc.pid, &status, WNOHANG) ==
          coordinator_.proc.pid) {
        coordinator_.running = false;
        return false;
      }
      std::this_thread::sleep_for(milliseconds(50));
    }
    return false;
  }

  void StartWorker(Pod& w) {
    const int n = w.incarnations++;
    const std::string base = absl::StrCat(c_.dir(), "/", w.name, "-", n);
    w.reports.push_back(base + ".jsonl");
    w.params.push_back(base + ".pt");
    std::vector<std::string> extra = flags_;
    extra.insert(extra.end(),
                 {"--gloo-hostname", w.address, "--final-params",
                  w.params.back(), "--checkpoint-dir", c_.dir() + "/ckpt",
                  "--keep-checkpoints", "3", "--threads", "1",
                  "--collective-timeout", "30", "--coordinator-timeout", "90"});
    w.proc =
        Spawn(net_.Exec(w.name, WorkerArgv(CoordinatorAddress(), w.rank,
                                           w.reports.back(), extra, steps_)),
              c_.dir() + "/" + w.name + ".log");
    w.running = true;
  }

  // Reaps exited processes and restarts them (after a back-off), unless the
  // job is done or failed.
  void Supervise() {
    const auto now = Clock::now();
    auto reap = [&](Pod& p) {
      if (!p.running) return false;
      int status = 0;
      if (waitpid(p.proc.pid, &status, WNOHANG) != p.proc.pid) return false;
      p.running = false;
      p.last_rc =
          WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      p.restart_at = now + kRestartBackoff;
      return true;
    };
    if (reap(coordinator_)) {
      // This incarnation's output only: the log is shared by all of them.
      const std::string log =
          ReadFile(coordinator_.proc.log).substr(coordinator_log_offset_);
      if (coordinator_.last_rc != 128 + SIGKILL) {
        std::cout << "chaos:   coordinator exited " << coordinator_.last_rc
                  << ": " << LastLine(log) << std::endl;
      }
      if (log.find("corrupt") != std::string::npos ||
          log.find("DATA_LOSS") != std::string::npos) {
        ++unreadable_state_;
      }
    }
    if (!coordinator_.running && now >= coordinator_.restart_at) {
      ++restarts_;
      StartCoordinator();
    }
    for (Pod& w : workers_) {
      if (reap(w)) {
        std::cout << "chaos:   " << w.name << " exited " << w.last_rc << ": "
                  << LastLine(ReadFile(w.proc.log)) << std::endl;
        if (w.last_rc == 0) {
          w.done = true;
          continue;
        }
        // A worker that stopped because the job failed: the failure is the
        // coordinator's to report (asked at most every few seconds).
        if (now >= next_status_check_) {
          next_status_check_ = now + seconds(3);
          if (StatusField("state") == "FAILED") {
            failed_ = true;
            const std::string why = StatusField("why");
            failure_ = why.empty() ? LastLine(ReadFile(w.proc.log)) : why;
            return;
          }
        }
      }
      if (!w.running && !w.done && now >= w.restart_at) {
        ++restarts_;
        StartWorker(w);
      }
    }
  }

  static std::string LastLine(const std::string& text) {
    const std::vector<std::string> lines = Lines(text);
    return lines.empty() ? "" : lines.back();
  }

  bool AllDone() const {
    for (const Pod& w : workers_)
      if (!w.done) return false;
    return true;
  }

  int64_t CommittedLines() const {
    int64_t n = 0;
    for (const Pod& w : workers_)
      for (const std::string& r : w.reports) n += StepsReported(r);
    return n;
  }

  int64_t MaxStep() const {
    int64_t best = -1;
    for (const Pod& w : workers_) {
      if (w.reports.empty()) continue;
      const std::vector<std::string> lines = Lines(ReadFile(w.reports.back()));
      int64_t step = -1;
      if (!lines.empty() &&
          absl::SimpleAtoi(Field(lines.back(), "step"), &step))
        best = std::max(best, step);
    }
    return best;
  }

  // One row of `hsdpctl status`, run in the coordinator's pod.
  std::string StatusField(const std::string& field) {
    const std::string log = c_.dir() + "/hsdpctl.out";
    fs::remove(log);
    Wait(Spawn(net_.Exec(coordinator_.name,
                         {Bin("hsdpctl"), "--coordinator",
                          absl::StrCat("127.0.0.1:", kPort), "status"}),
               log),
         seconds(30));
    for (const std::string& line : Lines(ReadFile(log))) {
      if (line.rfind(field + " ", 0) != 0) continue;
      return std::string(absl::StripAsciiWhitespace(line.substr(field.size())));
    }
    return "";
  }

  Pod& RandomRunningWorker() {
    std::vector<Pod*> running;
    for (Pod& w : workers_)
      if (w.running) running.push_back(&w);
    if (running.empty()) return workers_[Uniform(0, kWorld - 1)];
    return *running[Uniform(0, static_cast<int>(running.size()) - 1)];
  }

  // Sleeps `ms` while supervising (a stopped process's peers may exit and be
  // restarted meanwhile).
  void Hold(int ms) {
    const auto until = Clock::now() + milliseconds(ms);
    while (Clock::now() < until && !failed_) {
      std::this_thread::sleep_for(kPoll);
      Supervise();
    }
  }

  void Inject() {
    // Every kind once, in a random order, then again: each run sees all.
    if (bag_.empty()) {
      bag_ = faults_;
      std::shuffle(bag_.begin(), bag_.end(), rng_);
    }
    const Fault f = bag_.back();
    bag_.pop_back();
    ++injected_[f];
    const int ms = Uniform(1000, 8000);
    switch (f) {
      case Fault::kKillWorker: {
        Pod& w = RandomRunningWorker();
        active_ = absl::StrCat("SIGKILL ", w.name);
        if (w.running) kill(w.proc.pid, SIGKILL);
        break;
      }
      case Fault::kStopWorker: {
        Pod& w = RandomRunningWorker();
        active_ = absl::StrCat("SIGSTOP ", w.name, " for ", ms, " ms");
        const pid_t pid = w.proc.pid;
        if (w.running) kill(pid, SIGSTOP);
        Hold(ms);
        kill(pid, SIGCONT);
        break;
      }
      case Fault::kKillCoordinator:
        active_ = "SIGKILL coordinator";
        if (coordinator_.running) kill(coordinator_.proc.pid, SIGKILL);
        break;
      case Fault::kStopCoordinator: {
        active_ = absl::StrCat("SIGSTOP coordinator for ", ms, " ms");
        const pid_t pid = coordinator_.proc.pid;
        if (coordinator_.running) kill(pid, SIGSTOP);
        Hold(ms);
        kill(pid, SIGCONT);
        break;
      }
      case Fault::kLossyLink: {
        const bool coordinator = Uniform(0, 3) == 0;
        const std::string pod =
            coordinator ? coordinator_.name : RandomRunningWorker().name;
        const int delay = Uniform(20, 200);
        const int loss = Uniform(1, 10);
        absl::StatusOr<std::string> what = net_.Impair(pod, delay, loss);
        active_ =
            absl::StrCat("impaired link of ", pod, " for ", ms,
                         " ms: ", what.ok() ? *what : what.status().ToString());
        if (impairments_.empty() && what.ok()) impairments_ = *what;
        Hold(ms);
        net_.Repair(pod);
        break;
      }
      case Fault::kCutLink: {
        const std::string pod = RandomRunningWorker().name;
        active_ = absl::StrCat("cut link of ", pod, " for ", ms, " ms");
        (void)net_.SetLink(pod, false);
        Hold(ms);
        (void)net_.SetLink(pod, true);
        break;
      }
      case Fault::kFullDisk: {
        const int64_t bytes = disk_.Fill();
        active_ =
            absl::StrCat("state disk full (", bytes, " bytes) for ", ms, " ms");
        Hold(ms);
        disk_.Free();
        break;
      }
    }
    std::cout << "chaos: fault " << total_faults() << " at step " << MaxStep()
              << ": " << active_ << std::endl;
  }

  const std::vector<Fault> faults_;
  std::vector<Fault> bag_;
  Cluster& c_;
  PodNetwork& net_;
  SizedTmpfs& disk_;
  std::string state_root_;
  std::string policy_;
  int steps_;
  std::mt19937 rng_;
  const std::vector<std::string> flags_ = {"--optimizer", "sgd", "--lr",
                                           "0.05"};
  Pod coordinator_;
  std::vector<Pod> workers_;
  std::map<Fault, int> injected_;
  std::string active_;
  std::string impairments_;
  std::string failure_;
  bool failed_ = false;
  size_t coordinator_log_offset_ = 0;
  Clock::time_point next_status_check_;
  int64_t lines_ = 0;
  Clock::time_point last_progress_;
  // The last time a report line appeared, and the longest wait for one.
  Clock::time_point last_commit_;
  double max_gap_s_ = 0;
  int recovered_ = 0;
  double max_recovery_s_ = 0;
  int hangs_ = 0;
  int restarts_ = 0;
  int unreadable_state_ = 0;
};

TEST(ChaosSoakTest, FaultsEndInTheReferenceParametersOrAClearError) {
  Cluster c("chaos");
  absl::StatusOr<std::unique_ptr<PodNetwork>> net = PodNetwork::Create(c.dir());
  if (!net.ok()) GTEST_SKIP() << net.status().message();
  const std::string state_root = c.dir() + "/statefs";
  absl::StatusOr<std::unique_ptr<SizedTmpfs>> disk =
      SizedTmpfs::Mount(state_root, kStateDiskBytes);
  if (!disk.ok()) GTEST_SKIP() << disk.status().message();

  const int steps = EnvInt("HSDP_CHAOS_STEPS", 800);
  if (std::getenv("HSDP_CHAOS_KEEP") != nullptr) c.Keep();
  const unsigned seed = EnvInt("HSDP_CHAOS_SEED", 1);
  const std::vector<Fault> faults = FaultsFromEnv();
  ASSERT_FALSE(faults.empty()) << "HSDP_CHAOS_FAULTS names no fault";
  ChaosSoak soak(c, **net, **disk, state_root, steps, seed, faults);
  soak.AddPods();
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  soak.Start();
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  const bool ended = soak.Run();
  soak.PrintCounts();
  EXPECT_TRUE(ended) << "the job hung";
  EXPECT_EQ(soak.hangs(), 0);
  EXPECT_GT(soak.total_faults(), 0);

  // A restarted coordinator reads what was left in its state directory.
  const std::string state = soak.RestartAndReadState();
  std::cout << "chaos: restarted coordinator reads state " << state
            << std::endl;
  EXPECT_EQ(state, soak.failed() ? "FAILED" : "FINISHED");
  EXPECT_EQ(soak.unreadable_state(), 0);
  if (!ended) return;
  if (soak.failed()) {
    std::cout << "chaos: the job stopped with a clear error: " << soak.failure()
              << "\n";
    EXPECT_FALSE(soak.failure().empty());
    return;
  }
  EXPECT_EQ(soak.recovered(), soak.total_faults());

  // No update lost or doubled: the ledger over every report file is exact.
  const std::map<int64_t, FormedGeneration> generations =
      FormedGenerations(soak.CoordinatorLog());
  std::map<int64_t, int> world_of_step;
  const LedgerCounts ledger =
      ExpectLedgerExact(soak.Reports(), soak.KilledReports(), steps,
                        kGlobalMicrobatches, generations, &world_of_step);
  int restores = 0;
  for (const auto& [number, g] : generations) restores += g.restored ? 1 : 0;
  std::cout << "chaos: ledger exact over " << soak.Reports().size()
            << " report files: " << ledger.lines << " lines, "
            << generations.size() + 1 << " generations, " << restores
            << " checkpoint restores (" << ledger.superseded
            << " lines rolled back), " << ledger.unwritten
            << " microbatches whose line a killed or partitioned process "
               "never wrote\n";

  const std::string final_params = soak.FinalParams();
  ASSERT_FALSE(final_params.empty());
  // The reduction order follows the mesh, so the parameters drift from a
  // single-process run as the mesh changes; an undisturbed run of the same
  // mesh sequence reduces in the same order and must end bitwise equal.
  const std::vector<Segment> segments = Segments(world_of_step);
  std::vector<std::string> history;
  for (const Segment& segment : segments) {
    history.push_back(absl::StrCat(segment.first_step, "-", segment.last_step,
                                   " on ", segment.world / kShards, "x",
                                   kShards));
  }
  // Flushed: the replay below takes as long as the run.
  std::cout << "chaos: mesh history " << absl::StrJoin(history, ", ")
            << std::endl;
  const std::string replay =
      ReplayMeshSequence(segments, c.dir(), soak.Flags());
  ASSERT_FALSE(replay.empty());
  const double replay_diff = MaxDiff(final_params, replay);
  const double reference_diff =
      MaxDiffFromReference(final_params, kWorld, steps, c.dir(), soak.Flags());
  std::cout << "chaos: " << steps << " steps; final parameters: max |diff| "
            << replay_diff << " vs the undisturbed run of the same mesh "
            << "history, " << reference_diff
            << " vs single-process training (reduction-order drift)\n";
  EXPECT_EQ(replay_diff, 0.0);
}

}  // namespace
}  // namespace hsdp::e2e
