// hsdp-launch's command line: its options, their parsing and checks, and where
// the coordinator and worker binaries are.
#ifndef HSDP_DEPLOY_LAUNCH_LAUNCH_OPTIONS_H_
#define HSDP_DEPLOY_LAUNCH_LAUNCH_OPTIONS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace hsdp::launch {

constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;
// Restarts of dead workers in all, unless --max-restarts says otherwise.
constexpr int kDefaultMaxRestarts = 3;

struct Options {
  int workers = 0;
  std::string mesh;
  // Empty: the worker's default model (hsdp-worker: gpt-tiny); not passed on.
  std::string model;
  int64_t steps = 100;
  std::string policy_file;
  int port = 0;
  // /metrics and the dashboard; 0: a free port, -1: none.
  int metrics_port = 0;
  std::string control_token_file;
  std::string job_id = "local";
  std::string run_dir;
  std::string bin_dir;
  // Empty: hsdp-worker next to the coordinator.
  std::string worker_binary;
  // Restarts of dead workers in all; 0: the first failure stops the job.
  int max_restarts = kDefaultMaxRestarts;
  // Run one hsdp-relay and send the workers' streams through it.
  bool relay = false;
  std::vector<std::string> worker_args;
};

// Parses the command line into `o`: flags hsdp-launch does not know, and
// everything after `--`, go to every worker. nullopt when the launch goes on;
// otherwise the exit code (0 after --help; kExitUsage after a bad flag or
// value, with the message on stderr).
std::optional<int> ParseOptions(int argc, char** argv, Options& o);

// --worker-binary: an absolute path to an executable regular file, or a
// one-line INVALID_ARGUMENT naming the flag. Made absolute because the workers
// are started with execv (no PATH search).
absl::StatusOr<std::string> ResolveWorkerBinary(const std::string& path);

// The directory of this executable ("." when it cannot be read).
std::string BinDir();

}  // namespace hsdp::launch

#endif  // HSDP_DEPLOY_LAUNCH_LAUNCH_OPTIONS_H_
