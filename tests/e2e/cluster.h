// End-to-end test harness: real hsdp-coordinator, hsdp-worker, hsdpctl and
// hsdp-launch processes on loopback, their report files, and the one-line
// error check. Thread-compatible; one Cluster per test.
#ifndef HSDP_TESTS_E2E_CLUSTER_H_
#define HSDP_TESTS_E2E_CLUSTER_H_

#include <sys/types.h>
#include <torch/types.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace hsdp::e2e {

using Clock = std::chrono::steady_clock;

// Small enough for 4 processes on 2 cores, large enough to shard unevenly (seq
// 24 rows). Four blocks: with reshard after forward, backward holds the current
// block and the prefetched one (plus root) unsharded — fewer than all of them,
// so turning reshard off visibly raises the peak.
inline constexpr char kDims[] = "32,4,2,24";
inline constexpr int kSteps = 40;
inline constexpr auto kRunTimeout = std::chrono::seconds(150);

struct Proc {
  pid_t pid = -1;
  std::string log;
};

// Starts argv[0] with stdout and stderr appended to `log`; the child dies with
// the test.
Proc Spawn(const std::vector<std::string>& argv, const std::string& log);
// Exit code, 128 + signal, or -1 on timeout (the process is then killed).
int Wait(const Proc& p, std::chrono::seconds timeout = kRunTimeout);
void Kill(const Proc& p, int sig = 9);

std::string ReadFile(const std::string& path);
std::vector<std::string> Lines(const std::string& text);
// A binary of the build under test (build/bin/NAME).
std::string Bin(const std::string& name);

// The value of "key" in one JSON report line (strings unquoted).
std::string Field(const std::string& line, const std::string& key);

struct StepRecord {
  int64_t step = 0;
  std::string loss_hex;
  double loss = 0;
  int64_t peak = 0;
  std::string reshard_after_forward;
  // Shard-group and host-group all-gathers of the step (0 on reference lines).
  int64_t all_gathers = 0;
  int64_t host_all_gathers = 0;
};
std::vector<StepRecord> ReadReport(const std::string& path);
int64_t StepsReported(const std::string& path);

// A whole job killed and restarted from its newest complete checkpoint in
// `ckpt_dir`: `report` (rank r's, appended to by both runs) holds the first
// run's steps, then steps checkpoint + 1 .. steps - 1 of the second, every
// line with the loss bits of `base`; the restarted worker's `log` names the
// checkpoint step it resumed from, and that checkpoint is complete. The kill
// may come right after a checkpoint, so no step need have run twice.
void ExpectResumedFromCheckpoint(const std::string& report,
                                 const std::string& log,
                                 const std::string& ckpt_dir, int64_t steps,
                                 const std::vector<StepRecord>& base);

// Every report file (`report_paths[r]` for rank r) holds steps 0..steps-1
// exactly once, with losses bitwise equal to `base[r]`.
void ExpectSameLosses(const std::vector<std::string>& report_paths,
                      const std::vector<std::vector<StepRecord>>& base,
                      int steps);

// One line of a worker's report file, with the fields elastic checks read.
struct ReportLine {
  int rank = 0;
  int64_t step = 0;
  int64_t generation = 0;
  int world = 0;
  int64_t first_microbatch = 0;
  int64_t microbatch_count = 0;
  std::string loss_hex;
  double loss = 0;
  std::string heal_crc;
};
std::vector<ReportLine> ReadReportLines(const std::string& path);

// The sample ledger over every report file of a job (every incarnation of
// every rank): each global microbatch index of steps [0, steps) with
// `global_microbatches` per step is trained exactly once, except that
// `killed_file`'s (an index into `reports`, or -1) last committed step may be
// missing from it (a kill can land between the commit and the line).
void ExpectExactLedger(const std::vector<std::string>& reports, int steps,
                       int global_microbatches, int killed_file);

// A LibTorch archive of named tensors (--final-params).
std::map<std::string, at::Tensor> LoadParams(const std::string& path);

// How long RunReference waits: kRunTimeout, plus a second per
// kReferenceStepsPerSecond steps (a long soak's reference on a loaded 2-core
// machine runs several minutes).
inline constexpr int64_t kReferenceStepsPerSecond = 10;
std::chrono::seconds ReferenceTimeout(int64_t steps);

// Runs the single-process reference (hsdp-worker --reference, gpt-tiny with
// kDims, microbatch size 2) of a job of `world` ranks x `microbatches` for
// `steps` steps: its report to `report` and, unless empty, its final
// parameters to `params`; `extra` flags are appended. Its output goes to
// `log`. Returns the exit code, -1 past ReferenceTimeout(steps).
int RunReference(int world, int microbatches, int64_t steps,
                 const std::string& report, const std::string& params,
                 const std::string& log,
                 const std::vector<std::string>& extra = {});

// The model flags of every gpt-tiny run here: kDims, microbatch size 2.
std::vector<std::string> ModelFlags(int64_t steps);

// Runs the single-process reference of `world` ranks x 1 microbatch for
// `steps` steps (its files under `dir`, `extra` flags appended) and returns the
// largest absolute difference of any parameter in `params` (--final-params)
// from its final parameters; a failed reference run or another set of tensors
// is a test failure, returned as infinity.
double MaxDiffFromReference(const std::string& params, int world, int64_t steps,
                            const std::string& dir,
                            const std::vector<std::string>& extra);

// Runs argv to completion; expects a non-zero exit and exactly one line on
// stderr/stdout that contains `needle`.
void ExpectOneLineError(const std::vector<std::string>& argv,
                        const std::string& needle, const std::string& name);

// The command lines a Cluster starts: the coordinator of job "e2e" with its
// port file and state under `dir`, listening on `listen`; a gpt-tiny worker
// (kDims) of rank hint `rank` writing `report`. A flag in `extra` replaces the
// default of the same name; an extra --model replaces gpt-tiny and kDims.
std::vector<std::string> CoordinatorArgv(const std::string& dir, int world,
                                         const std::string& mesh,
                                         const std::string& listen,
                                         const std::vector<std::string>& extra);
std::vector<std::string> WorkerArgv(const std::string& coordinator, int rank,
                                    const std::string& report,
                                    const std::vector<std::string>& extra,
                                    int64_t steps);

// A coordinator and workers under a scratch directory that is removed when the
// test passes (kept for inspection when it fails).
class Cluster {
 public:
  explicit Cluster(const std::string& name);
  ~Cluster();
  Cluster(const Cluster&) = delete;
  Cluster& operator=(const Cluster&) = delete;

  // Starts the coordinator (port 0 picks one; a restart passes the old port).
  // A flag in `extra` replaces the default of the same name.
  void StartCoordinator(int world, const std::string& mesh, int port = 0,
                        const std::string& policy_file = "",
                        const std::vector<std::string>& extra = {});
  // Starts n gpt-tiny workers with kDims. A flag in `extra` replaces the
  // default of the same name; an extra --model replaces gpt-tiny and kDims.
  void StartWorkers(int n, const std::vector<std::string>& extra = {},
                    int64_t steps = kSteps);
  // Starts one worker of rank hint `rank` with exactly these extra flags.
  Proc StartWorker(int rank, const std::vector<std::string>& extra,
                   int64_t steps);
  // Waits for every worker; expects exit 0 from each.
  void WaitWorkers();
  // Blocks until `rank` reported at least `steps` steps (or the time runs out).
  bool WaitForSteps(int64_t steps, int rank = 0);
  // Runs hsdpctl against this cluster; returns its exit code.
  int Ctl(const std::vector<std::string>& args, std::string* output = nullptr);

  // Keeps the scratch directory even when the test passes.
  void Keep() { keep_ = true; }

  std::string address() const;
  int port() const { return port_; }
  std::string report(int r) const;
  // Worker r's stdout and stderr, appended to by each process started as r.
  std::string worker_log(int r) const;
  const std::string& dir() const { return dir_; }
  Proc& coordinator() { return coordinator_; }
  std::vector<Proc>& workers() { return workers_; }

 private:
  std::string dir_;
  bool keep_ = false;
  Proc coordinator_;
  int port_ = 0;
  std::vector<Proc> workers_;
};

// The job a test binary compares its other runs with: `workers` workers on
// `mesh`, started with `worker_flags` for `steps` steps, run once, on first
// use, under a Cluster named `name`.
class BaselineRun {
 public:
  BaselineRun(std::string name, int workers, std::string mesh,
              std::vector<std::string> worker_flags, int steps);

  // Rank r's steps are Reports()[r]. The first call runs the job.
  const std::vector<std::vector<StepRecord>>& Reports();
  // Every rank of `c` reported steps 0..steps-1 exactly once, with losses
  // bitwise equal to the baseline's.
  void ExpectSameAs(const Cluster& c);

 private:
  const std::string name_;
  const int workers_;
  const std::string mesh_;
  const std::vector<std::string> worker_flags_;
  const int steps_;
  std::optional<std::vector<std::vector<StepRecord>>> reports_;
};

}  // namespace hsdp::e2e

#endif  // HSDP_TESTS_E2E_CLUSTER_H_
