#include "deploy/launch/launch_options.h"

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <filesystem>
#include <iostream>
#include <system_error>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace hsdp::launch {

namespace fs = std::filesystem;

std::optional<int> ParseOptions(int argc, char** argv, Options& o) {
  CLI::App app{"hsdp-launch: run a coordinator and N workers on this machine"};
  app.add_option("--workers", o.workers, "number of worker processes")
      ->required();
  app.add_option("--mesh", o.mesh, "RxS (default 1xWORKERS)");
  app.add_option(
      "--model", o.model,
      "model name (default: the worker's, gpt-tiny for hsdp-worker)");
  app.add_option("--steps", o.steps, "training steps");
  app.add_option("--policy-file", o.policy_file,
                 "initial policy for the coordinator");
  app.add_option("--port", o.port, "coordinator port (0: ephemeral)");
  app.add_option("--metrics-port", o.metrics_port,
                 "port of the coordinator's /metrics and dashboard on "
                 "127.0.0.1 (0: ephemeral, -1: none)");
  app.add_option("--control-token-file", o.control_token_file,
                 "bearer token hsdpctl and the dashboard's policy form need");
  app.add_option("--job-id", o.job_id, "job id");
  app.add_flag("--relay", o.relay,
               "run one hsdp-relay beside the workers and send their schedule "
               "and report streams through it, as one relay per host does "
               "on a cluster");
  app.add_option("--run-dir", o.run_dir,
                 "logs, reports and coordinator state (default: a temp dir)");
  app.add_option("--bin-dir", o.bin_dir,
                 "where hsdp-coordinator and hsdp-worker are");
  app.add_option("--worker-binary", o.worker_binary,
                 "the workers' executable: a user's worker built on "
                 "hsdp::train::WorkerMain (default: hsdp-worker in --bin-dir)");
  app.add_option("--max-restarts", o.max_restarts,
                 absl::StrCat("restarts of dead workers in all (default ",
                              kDefaultMaxRestarts,
                              "); 0: the first failure stops the job"));
  // Flags hsdp-launch does not know go to every worker as well (e.g.
  // --microbatch-size 8).
  app.allow_extras(true);
  try {
    // Everything after `--` goes to the workers verbatim (CLI11 would reorder
    // it).
    int launcher_argc = argc;
    for (int i = 1; i < argc; ++i) {
      if (std::string(argv[i]) == "--") {
        launcher_argc = i;
        o.worker_args.assign(argv + i + 1, argv + argc);
        break;
      }
    }
    app.parse(launcher_argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << "hsdp-launch: " << e.what() << " (see --help)" << std::endl;
    return kExitUsage;
  }
  for (const std::string& extra : app.remaining())
    o.worker_args.push_back(extra);
  if (o.workers <= 0 || o.steps < 0 || o.port < 0 || o.metrics_port < -1 ||
      o.max_restarts < 0) {
    std::cerr << "hsdp-launch: --workers must be > 0, --steps, --port and "
                 "--max-restarts >= 0, --metrics-port >= -1"
              << std::endl;
    return kExitUsage;
  }
  return std::nullopt;
}

absl::StatusOr<std::string> ResolveWorkerBinary(const std::string& path) {
  std::error_code ec;
  const fs::path abs = fs::absolute(path, ec);
  if (ec) {
    return absl::InvalidArgumentError(
        absl::StrCat("--worker-binary ", path, ": ", ec.message()));
  }
  const fs::file_status st = fs::status(abs, ec);
  if (ec || !fs::exists(st)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--worker-binary ", path, ": no such file"));
  }
  if (!fs::is_regular_file(st)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--worker-binary ", path, ": not a regular file"));
  }
  if (access(abs.c_str(), X_OK) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--worker-binary ", path, ": not executable"));
  }
  return abs.lexically_normal().string();
}

std::string BinDir() {
  std::error_code ec;
  fs::path self = fs::read_symlink("/proc/self/exe", ec);
  return ec ? std::string(".") : self.parent_path().string();
}

}  // namespace hsdp::launch
