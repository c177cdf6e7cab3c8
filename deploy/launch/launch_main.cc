// hsdp-launch: a local cluster on this machine, like `torchrun --standalone`.
//
//   hsdp-launch --workers 4 --mesh 2x2 --model gpt-tiny --steps 200 [-- extra
//   hsdp-worker flags]
//   hsdp-launch --workers 4 --mesh 2x2 --worker-binary ./my-worker --steps 200
//
// Starts hsdp-coordinator and N hsdp-worker processes (found next to this
// binary; --worker-binary runs a user's worker, one built on
// hsdp::train::WorkerMain, instead), shows one live progress line read from the
// workers' report files and the coordinator's status (generation, mesh),
// forwards Ctrl-C / SIGTERM to every child and cleans up. Everything a run
// writes (logs, reports, coordinator state) lands in --run-dir; the
// coordinator's dashboard URL is printed and written to RUN_DIR/dashboard.url.
//
// Elastic: a worker that dies is started again with its own command line (its
// report file aside: RUN_DIR/worker-R.restart-K.jsonl) up to --max-restarts
// times in all; it joins again and is healed by its peers while the others
// keep training. A worker that fails before the job's first committed step
// (a bad flag, an unknown model) is not restarted, and --max-restarts 0 stops
// every process at the first worker that fails. Exits 0 when the job finishes,
// and otherwise non-zero naming the worker that failed past the restarts (the
// last line of its log) or the coordinator's reason (a FAILED job).
//
// Single-threaded: the main loop polls children, report files and the
// coordinator's status; signal handlers only set a flag.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/token.h"
#include "deploy/launch/cluster.h"
#include "deploy/launch/coordinator_status.h"
#include "deploy/launch/launch_options.h"
#include "deploy/launch/progress.h"
#include "hsdp/mesh.h"

namespace hsdp::launch {
namespace {

namespace fs = std::filesystem;

constexpr auto kPollInterval = std::chrono::milliseconds(200);
constexpr auto kCoordinatorStartTimeout = std::chrono::seconds(30);
// How often the coordinator's status is read.
constexpr auto kStatusInterval = std::chrono::seconds(1);

volatile std::sig_atomic_t g_signal = 0;
void OnSignal(int sig) { g_signal = sig; }

absl::StatusOr<int> WaitForPort(const std::string& port_file,
                                Cluster& cluster) {
  const auto deadline =
      std::chrono::steady_clock::now() + kCoordinatorStartTimeout;
  while (std::chrono::steady_clock::now() < deadline) {
    std::ifstream in(port_file);
    std::string text;
    int port;
    if (in >> text && absl::SimpleAtoi(text, &port) && port > 0) return port;
    if (!cluster.Reap().empty()) {
      const Child& failed = cluster.children().front();
      return absl::UnavailableError(absl::StrCat(
          "coordinator failed to start (", DescribeExit(failed.exit_status),
          "): ", LastLine(failed.log)));
    }
    if (g_signal != 0) return absl::CancelledError("interrupted");
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return absl::DeadlineExceededError(
      "coordinator did not report its port within 30 s");
}

// The coordinator's command line.
std::vector<std::string> CoordinatorArgs(const Options& o,
                                         const std::string& coordinator_bin,
                                         const hsdp::MeshShape& mesh,
                                         const std::string& run_dir,
                                         const std::string& port_file,
                                         const std::string& dashboard_file) {
  std::vector<std::string> cargs = {coordinator_bin,
                                    "--job-id",
                                    o.job_id,
                                    "--world-size",
                                    std::to_string(o.workers),
                                    "--mesh",
                                    hsdp::MeshToString(mesh),
                                    "--listen",
                                    absl::StrCat("127.0.0.1:", o.port),
                                    "--port-file",
                                    port_file,
                                    "--state-dir",
                                    run_dir + "/coordinator-state"};
  if (o.metrics_port >= 0) {
    // The coordinator writes the URL before its port file, so it is there
    // once WaitForPort returns.
    for (const std::string& a :
         {std::string("--metrics-listen"),
          absl::StrCat("127.0.0.1:", o.metrics_port),
          std::string("--dashboard-url-file"), dashboard_file}) {
      cargs.push_back(a);
    }
  } else {
    cargs.push_back("--metrics-listen");
    cargs.push_back("");
  }
  if (!o.control_token_file.empty()) {
    cargs.push_back("--control-token-file");
    cargs.push_back(o.control_token_file);
  }
  if (!o.policy_file.empty()) {
    cargs.push_back("--policy-file");
    cargs.push_back(o.policy_file);
  }
  return cargs;
}

// Rank `rank`'s worker command line, writing its report to `report`.
std::vector<std::string> WorkerArgs(const Options& o,
                                    const std::string& worker_bin, int port,
                                    int rank, const std::string& run_dir,
                                    const std::string& report,
                                    const std::string& relay) {
  std::vector<std::string> wargs = {worker_bin,
                                    "--coordinator",
                                    absl::StrCat("127.0.0.1:", port),
                                    "--job-id",
                                    o.job_id,
                                    "--rank-hint",
                                    std::to_string(rank),
                                    "--steps",
                                    std::to_string(o.steps),
                                    "--gloo-hostname",
                                    "127.0.0.1",
                                    kReportFileFlag,
                                    report};
  if (!relay.empty()) {
    wargs.push_back("--relay");
    wargs.push_back(relay);
  }
  if (!o.model.empty()) {
    wargs.push_back("--model");
    wargs.push_back(o.model);
  }
  // Checkpoints (policy interval or `hsdpctl checkpoint`) land in the run dir
  // unless the user chose a place; relaunching on the same --run-dir resumes
  // from them.
  if (std::find(o.worker_args.begin(), o.worker_args.end(),
                "--checkpoint-dir") == o.worker_args.end()) {
    wargs.push_back("--checkpoint-dir");
    wargs.push_back(run_dir + "/checkpoints");
  }
  wargs.insert(wargs.end(), o.worker_args.begin(), o.worker_args.end());
  return wargs;
}

int Run(const Options& o) {
  absl::StatusOr<hsdp::MeshShape> mesh =
      hsdp::ParseMeshForWorld(o.mesh, o.workers);
  if (!mesh.ok()) {
    std::cerr << "hsdp-launch: " << mesh.status().message() << " (--workers "
              << o.workers << ")" << std::endl;
    return kExitUsage;
  }
  const std::string bin = o.bin_dir.empty() ? BinDir() : o.bin_dir;
  const std::string coordinator_bin = bin + "/hsdp-coordinator";
  std::string worker_bin = bin + "/hsdp-worker";
  if (!o.worker_binary.empty()) {
    absl::StatusOr<std::string> user_bin = ResolveWorkerBinary(o.worker_binary);
    if (!user_bin.ok()) {
      std::cerr << "hsdp-launch: " << user_bin.status().message() << std::endl;
      return kExitUsage;
    }
    worker_bin = *user_bin;
  }
  const std::string relay_bin = bin + "/hsdp-relay";
  std::vector<std::string> needed = {coordinator_bin, worker_bin};
  if (o.relay) needed.push_back(relay_bin);
  for (const std::string& b : needed) {
    if (access(b.c_str(), X_OK) != 0) {
      std::cerr << "hsdp-launch: " << b
                << " not found (build it, or pass --bin-dir)" << std::endl;
      return kExitFailure;
    }
  }
  std::string run_dir = o.run_dir;
  if (run_dir.empty()) {
    char tmpl[] = "/tmp/hsdp-launch-XXXXXX";
    if (mkdtemp(tmpl) == nullptr) {
      std::cerr << "hsdp-launch: mkdtemp: " << std::strerror(errno)
                << std::endl;
      return kExitFailure;
    }
    run_dir = tmpl;
  }
  std::error_code ec;
  fs::create_directories(run_dir, ec);
  const std::string port_file = run_dir + "/coordinator.port";
  fs::remove(port_file, ec);
  const std::string dashboard_file = run_dir + "/dashboard.url";
  fs::remove(dashboard_file, ec);
  std::cerr << "hsdp-launch: run dir " << run_dir << std::endl;

  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);

  // A fresh job token per run for the coordinator and the workers, handed down
  // through the environment (argv is visible to every user of the machine).
  absl::StatusOr<std::string> job_token = hsdp::RandomToken();
  if (!job_token.ok()) {
    std::cerr << "hsdp-launch: job token: " << job_token.status().message()
              << std::endl;
    return kExitFailure;
  }
  unsetenv(hsdp::kJobTokenFileEnv);
  setenv(hsdp::kJobTokenEnv, job_token->c_str(), /*overwrite=*/1);

  Cluster cluster;
  const std::vector<std::string> cargs = CoordinatorArgs(
      o, coordinator_bin, *mesh, run_dir, port_file, dashboard_file);
  Child coordinator;
  coordinator.name = "coordinator";
  coordinator.log = run_dir + "/coordinator.log";
  auto cpid = Spawn(cargs, coordinator.log);
  if (!cpid.ok()) {
    std::cerr << "hsdp-launch: " << cpid.status().message() << std::endl;
    return kExitFailure;
  }
  coordinator.pid = *cpid;
  coordinator.running = true;
  cluster.Add(coordinator);
  absl::StatusOr<int> port = WaitForPort(port_file, cluster);
  if (!port.ok()) {
    std::cerr << "hsdp-launch: " << port.status().message() << std::endl;
    return kExitFailure;
  }
  std::cerr << "hsdp-launch: coordinator on 127.0.0.1:" << *port << ", "
            << o.workers << " workers, mesh " << hsdp::MeshToString(*mesh)
            << ", worker " << worker_bin
            << (o.model.empty() ? std::string()
                                : absl::StrCat(", model ", o.model))
            << ", " << o.steps << " steps" << std::endl;
  if (o.metrics_port >= 0) {
    std::cerr << "hsdp-launch: dashboard " << FirstLine(dashboard_file)
              << std::endl;
  }

  // One relay for the workers of this machine, as one per host on a cluster.
  std::string relay_address;
  if (o.relay) {
    relay_address = absl::StrCat("unix:", run_dir, "/relay.sock");
    Child relay;
    relay.name = "relay";
    relay.log = run_dir + "/relay.log";
    relay.rank = kRelayRank;
    auto rpid =
        Spawn({relay_bin, "--coordinator", absl::StrCat("127.0.0.1:", *port),
               "--listen", relay_address},
              relay.log);
    if (!rpid.ok()) {
      std::cerr << "hsdp-launch: " << rpid.status().message() << std::endl;
      return kExitFailure;
    }
    relay.pid = *rpid;
    relay.running = true;
    cluster.Add(relay);
    std::cerr << "hsdp-launch: relay on " << relay_address << std::endl;
  }

  // The live incarnation's report file of each rank.
  std::vector<std::string> reports;
  for (int r = 0; r < o.workers; ++r) {
    const std::string report = absl::StrCat(run_dir, "/worker-", r, ".jsonl");
    fs::remove(report, ec);
    reports.push_back(report);
    const std::vector<std::string> wargs =
        WorkerArgs(o, worker_bin, *port, r, run_dir, report, relay_address);
    Child w;
    w.name = absl::StrCat("worker ", r);
    w.log = absl::StrCat(run_dir, "/worker-", r, ".log");
    w.rank = r;
    w.argv = wargs;
    auto wpid = Spawn(wargs, w.log);
    if (!wpid.ok()) {
      std::cerr << "hsdp-launch: " << wpid.status().message() << std::endl;
      return kExitFailure;
    }
    w.pid = *wpid;
    w.running = true;
    cluster.Add(w);
  }

  Progress progress(isatty(STDERR_FILENO), mesh->shard, o.steps,
                    std::move(reports));
  StatusClient coordinator_status(
      absl::StrCat("127.0.0.1:", *port),
      o.control_token_file.empty() ? "" : ReadToken(o.control_token_file));
  std::optional<hsdp::v1::GetStatusResponse> status;
  auto next_status = std::chrono::steady_clock::now();
  int failures = 0;
  int restarts = 0;
  auto refresh_status = [&]() {
    absl::StatusOr<hsdp::v1::GetStatusResponse> now = coordinator_status.Get();
    if (now.ok()) status = *std::move(now);  // else the next poll tries again
  };
  auto is_state = [&](hsdp::v1::JobState state) {
    return status.has_value() && status->state() == state;
  };
  auto show = [&](bool final_line) {
    progress.Show(final_line, status, restarts);
  };
  auto fail_job = [&](const std::string& why) {
    show(true);
    std::cerr << "hsdp-launch: " << why << std::endl;
    cluster.Terminate();
    return kExitFailure;
  };

  while (true) {
    if (g_signal != 0) {
      show(true);
      std::cerr << "hsdp-launch: " << strsignal(g_signal)
                << ", stopping all processes" << std::endl;
      cluster.Terminate();
      return 128 + g_signal;
    }
    for (const size_t index : cluster.Reap()) {
      Child& c = cluster.children()[index];
      if (c.rank == kRelayRank) {
        // Only the streams went through it: the workers go on by call.
        std::cerr << progress.LineStart() << "hsdp-launch: the relay exited ("
                  << DescribeExit(c.exit_status) << "): " << LastLine(c.log)
                  << "; the workers go on without it" << std::endl;
        continue;
      }
      if (c.rank == kCoordinatorRank) {
        return fail_job(absl::StrCat("coordinator exited while workers run (",
                                     DescribeExit(c.exit_status),
                                     "): ", LastLine(c.log)));
      }
      if (ExitedOk(c.exit_status)) continue;
      ++failures;
      const std::string what =
          absl::StrCat(c.name, " failed (", DescribeExit(c.exit_status),
                       "): ", LastLine(c.log), " [log: ", c.log, "]");
      if (o.max_restarts == 0) return fail_job(what);
      // The coordinator says whether the job can go on at all.
      refresh_status();
      if (is_state(hsdp::v1::JOB_STATE_FAILED)) {
        return fail_job(absl::StrCat("the job failed: ", status->message(),
                                     " (", c.name, ": ",
                                     DescribeExit(c.exit_status), ")"));
      }
      if (status.has_value() && status->last_committed_step() < 0) {
        // Before the first step a failure is the set-up's (a flag, the
        // model): a new process would fail the same way.
        return fail_job(absl::StrCat(what,
                                     "; not restarted: the job has not "
                                     "committed a step yet"));
      }
      if (restarts >= o.max_restarts) {
        return fail_job(absl::StrCat(what, "; all ", o.max_restarts,
                                     " restarts (--max-restarts) are used"));
      }
      if (is_state(hsdp::v1::JOB_STATE_FINISHED) ||
          is_state(hsdp::v1::JOB_STATE_DRAINING)) {
        // No step is left for a new process to join.
        std::cerr << "hsdp-launch: " << what << "; not restarted: the job is "
                  << (is_state(hsdp::v1::JOB_STATE_FINISHED) ? "finished"
                                                             : "draining")
                  << std::endl;
        continue;
      }
      ++restarts;
      const std::string report = absl::StrCat(run_dir, "/worker-", c.rank,
                                              ".restart-", restarts, ".jsonl");
      fs::remove(report, ec);
      progress.Restarted(c.rank, restarts, report);
      absl::Status respawned =
          Respawn(c, report,
                  absl::StrCat("hsdp-launch: restart ", restarts, " of ",
                               o.max_restarts, " (the previous process ",
                               DescribeExit(c.exit_status), ")"));
      if (!respawned.ok()) return fail_job(std::string(respawned.message()));
      progress.AddEvent(absl::StrCat(c.name, " was lost (",
                                     DescribeExit(c.exit_status), ")"));
      std::cerr << progress.LineStart() << "hsdp-launch: " << what
                << "; restarting it (restart " << restarts << " of "
                << o.max_restarts << ", report " << report << ")" << std::endl;
    }
    bool workers_running = false;
    for (const Child& c : cluster.children()) {
      workers_running |= (c.running && c.rank >= 0);
    }
    if (!workers_running) break;
    if (std::chrono::steady_clock::now() >= next_status) {
      refresh_status();
      next_status = std::chrono::steady_clock::now() + kStatusInterval;
      if (is_state(hsdp::v1::JOB_STATE_FAILED)) {
        return fail_job(absl::StrCat("the job failed: ", status->message()));
      }
    }
    progress.SayGenerations();
    show(false);
    std::this_thread::sleep_for(kPollInterval);
  }
  refresh_status();
  progress.SayGenerations();
  show(true);
  if (is_state(hsdp::v1::JOB_STATE_FAILED)) {
    return fail_job(absl::StrCat("the job failed: ", status->message()));
  }
  // A worker that failed without a restart (the job had finished or was
  // draining) counts only if the job did not finish.
  bool all_ok = true;
  for (const Child& c : cluster.children()) {
    if (c.rank >= 0) all_ok &= ExitedOk(c.exit_status);
  }
  if (!all_ok && !is_state(hsdp::v1::JOB_STATE_FINISHED)) {
    return fail_job("the workers stopped before the job finished");
  }
  cluster.Terminate();  // the coordinator: graceful SIGTERM
  std::cerr << "hsdp-launch: all " << o.workers << " workers finished";
  if (failures > 0 || restarts > 0) {
    std::cerr << " (" << failures
              << (failures == 1 ? " failure, " : " failures, ") << restarts
              << (restarts == 1 ? " restart" : " restarts");
    if (status.has_value()) {
      std::cerr << "; generation " << status->generation() << ", "
                << MeshOf(*status);
    }
    std::cerr << ")";
  }
  std::cerr << "; reports in " << run_dir << std::endl;
  return 0;
}

}  // namespace
}  // namespace hsdp::launch

int main(int argc, char** argv) {
  hsdp::launch::Options o;
  if (std::optional<int> exit_code = hsdp::launch::ParseOptions(argc, argv, o);
      exit_code.has_value()) {
    return *exit_code;
  }
  return hsdp::launch::Run(o);
}
