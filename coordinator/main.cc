// hsdp-coordinator: serves one job's control plane. Flags (with env fallbacks)
// as tests/deploy/contract.py lists them; --job-file reads the same settings
// from a file of `name = value` lines (the flag names without dashes, e.g.
// `world-size = 4`); command-line flags win over the file, the file over the
// environment.
#include <signal.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/file_util.h"
#include "common/policy.h"
#include "common/status_util.h"
#include "common/token.h"
#include "coordinator/core/schedule_log.h"
#include "coordinator/server.h"
#include "hsdp/mesh.h"

namespace {

using hsdp::ReadFile;
using hsdp::coordinator::CoordinatorServer;
using hsdp::coordinator::JobConfig;
using hsdp::coordinator::ServerOptions;

constexpr int kExitError = 1;
constexpr int kExitUsage = 2;
// --mesh value that derives the mesh from --ranks-per-host.
constexpr absl::string_view kMeshAuto = "auto";

struct Flags {
  std::string job_id;
  int world_size = 0;
  std::string mesh;
  // With --mesh auto: ranks on each host, the shard degree.
  int ranks_per_host = 0;
  std::string policy_file;
  std::string listen = "0.0.0.0:50051";
  std::string port_file;
  std::string state_dir;
  std::string metrics_listen = "0.0.0.0:9090";
  std::string dashboard_url;
  std::string dashboard_url_file;
  double heartbeat_timeout_s = 10;
  int read_ahead = hsdp::coordinator::kDefaultReadAhead;
  int min_replicas = 1;
  double join_wait_s = 60;
  double reform_window_s = 5;
  // "GBIT_PER_S[,LATENCY_US]"; empty: not declared.
  std::string intra_host_link;
  std::string inter_host_link;
  int64_t truncate_sealed_after = -1;
  std::string tls_cert;
  std::string tls_key;
  std::string tls_client_ca;
  std::string control_token_file;
  std::string job_token_file;
  double shutdown_deadline_s = 10;
  std::string validate_policy;
  bool check_config = false;
};

// --validate-policy: parse and check a policy file without a model (globs are
// checked for matching units once workers join), print its effective values.
int ValidatePolicyFile(const std::string& path) {
  absl::StatusOr<hsdp::v1::Policy> policy = hsdp::ReadPolicyFile(path);
  absl::Status status =
      policy.ok() ? hsdp::ValidatePolicy(*policy, {}) : policy.status();
  if (!status.ok()) {
    std::cerr << "hsdp-coordinator: " << path << ": " << status.message()
              << "\n";
    return kExitError;
  }
  std::cout << hsdp::DescribePolicy(*policy);
  return 0;
}

// --mesh RxS, or --mesh auto with --ranks-per-host G: (world/G) x G, so each
// shard group is the ranks of one host and only replicate groups cross hosts.
absl::StatusOr<hsdp::MeshShape> ResolveMesh(const Flags& f) {
  if (f.ranks_per_host < 0) {
    return absl::InvalidArgumentError("--ranks-per-host must be >= 1");
  }
  if (absl::StripAsciiWhitespace(f.mesh) != kMeshAuto) {
    HSDP_ASSIGN_OR_RETURN(hsdp::MeshShape mesh,
                          hsdp::ParseMeshForWorld(f.mesh, f.world_size));
    // Both given: they must agree, or the shard groups would not be hosts.
    if (f.ranks_per_host != 0 && f.ranks_per_host != mesh.shard) {
      return absl::InvalidArgumentError(
          absl::StrCat("--ranks-per-host ", f.ranks_per_host,
                       " disagrees with --mesh ", hsdp::MeshToString(mesh),
                       " (shard degree ", mesh.shard, "); use --mesh auto"));
    }
    return mesh;
  }
  if (f.ranks_per_host == 0) {
    return absl::InvalidArgumentError(
        "--mesh auto needs --ranks-per-host (the ranks on each host)");
  }
  if (f.world_size % f.ranks_per_host != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--ranks-per-host ", f.ranks_per_host, " does not divide --world-size ",
        f.world_size, " (--mesh auto)"));
  }
  hsdp::MeshShape mesh;
  mesh.replicate = f.world_size / f.ranks_per_host;
  mesh.shard = f.ranks_per_host;
  HSDP_RETURN_IF_ERROR(hsdp::ValidateMesh(mesh, f.world_size));
  return mesh;
}

// --intra-host-link / --inter-host-link: "GBIT_PER_S[,LATENCY_US]" (e.g.
// "1,50": 1 Gbit/s, 50 us per all-gather); empty: not declared.
absl::StatusOr<hsdp::coordinator::LinkCost> ParseLink(const std::string& flag,
                                                      const std::string& text) {
  hsdp::coordinator::LinkCost link;
  if (text.empty()) return link;
  const std::vector<std::string> parts = absl::StrSplit(text, ',');
  double gbit = 0, latency_us = 0;
  if (parts.size() > 2 || !absl::SimpleAtod(parts[0], &gbit) || gbit <= 0 ||
      !std::isfinite(gbit) ||
      (parts.size() == 2 && (!absl::SimpleAtod(parts[1], &latency_us) ||
                             latency_us < 0 || !std::isfinite(latency_us)))) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " '", text,
                     "': expected GBIT_PER_S[,LATENCY_US] with a bandwidth "
                     "> 0 and a latency >= 0, e.g. 1,50"));
  }
  link.bytes_per_second = gbit * 1e9 / 8;
  link.latency_seconds = latency_us * 1e-6;
  return link;
}

absl::StatusOr<JobConfig> BuildJobConfig(const Flags& f) {
  JobConfig job;
  job.job_id = f.job_id;
  if (job.job_id.empty())
    return absl::InvalidArgumentError("--job-id is required");
  if (f.world_size < 1)
    return absl::InvalidArgumentError("--world-size must be >= 1");
  job.world_size = f.world_size;
  HSDP_ASSIGN_OR_RETURN(job.mesh, ResolveMesh(f));
  if (!f.policy_file.empty()) {
    HSDP_ASSIGN_OR_RETURN(job.policy, hsdp::ReadPolicyFile(f.policy_file));
    HSDP_RETURN_IF_ERROR(hsdp::AnnotateStatus(
        hsdp::ValidatePolicy(job.policy, {}), f.policy_file));
  }
  job.state_dir = f.state_dir;
  if (f.heartbeat_timeout_s <= 0) {
    return absl::InvalidArgumentError("--heartbeat-timeout must be > 0");
  }
  job.heartbeat_timeout = absl::Seconds(f.heartbeat_timeout_s);
  if (f.read_ahead < 0)
    return absl::InvalidArgumentError("--read-ahead must be >= 0");
  job.read_ahead = f.read_ahead;
  if (f.min_replicas < 1 || f.min_replicas > job.mesh.replicate) {
    return absl::InvalidArgumentError(
        absl::StrCat("--min-replicas ", f.min_replicas, " is outside [1, ",
                     job.mesh.replicate, "] (the mesh's replica groups)"));
  }
  job.min_replicas = f.min_replicas;
  if (f.join_wait_s < 0)
    return absl::InvalidArgumentError("--join-wait must be >= 0");
  job.join_wait = absl::Seconds(f.join_wait_s);
  if (f.reform_window_s < 0)
    return absl::InvalidArgumentError("--reform-window must be >= 0");
  job.reform_window = absl::Seconds(f.reform_window_s);
  HSDP_ASSIGN_OR_RETURN(job.links.intra_host,
                        ParseLink("--intra-host-link", f.intra_host_link));
  HSDP_ASSIGN_OR_RETURN(job.links.inter_host,
                        ParseLink("--inter-host-link", f.inter_host_link));
  if (f.truncate_sealed_after >= 0 && job.state_dir.empty()) {
    return absl::InvalidArgumentError(
        "--truncate-sealed-after needs --state-dir");
  }
  job.truncate_sealed_after = f.truncate_sealed_after;
  return job;
}

absl::StatusOr<ServerOptions> BuildServerOptions(const Flags& f) {
  ServerOptions options;
  options.listen = f.listen;
  options.metrics_listen = f.metrics_listen;
  options.dashboard_url = f.dashboard_url;
  if (f.tls_cert.empty() != f.tls_key.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  }
  if (!f.tls_cert.empty()) {
    HSDP_ASSIGN_OR_RETURN(options.tls_cert_pem, ReadFile(f.tls_cert));
    HSDP_ASSIGN_OR_RETURN(options.tls_key_pem, ReadFile(f.tls_key));
  }
  if (!f.tls_client_ca.empty()) {
    if (f.tls_cert.empty()) {
      return absl::InvalidArgumentError(
          "--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key");
    }
    HSDP_ASSIGN_OR_RETURN(options.tls_client_ca_pem, ReadFile(f.tls_client_ca));
  }
  // The job token comes from a file or the environment only: argv is visible
  // to every user of the machine.
  HSDP_ASSIGN_OR_RETURN(
      options.job_token,
      hsdp::ResolveToken(f.job_token_file, hsdp::kJobTokenFileEnv,
                         hsdp::kJobTokenEnv));
  if (!f.control_token_file.empty()) {
    HSDP_ASSIGN_OR_RETURN(std::string token, ReadFile(f.control_token_file));
    options.control_token = std::string(absl::StripAsciiWhitespace(token));
    if (options.control_token.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "control token file ", f.control_token_file, " is empty"));
    }
  }
  if (f.shutdown_deadline_s < 0) {
    return absl::InvalidArgumentError("--shutdown-deadline must be >= 0");
  }
  options.shutdown_deadline = absl::Seconds(f.shutdown_deadline_s);
  return options;
}

std::string DescribeLink(const hsdp::coordinator::LinkCost& link) {
  if (!link.declared()) return "(not declared)";
  return absl::StrCat(link.bytes_per_second * 8 / 1e9, " Gbit/s, ",
                      link.latency_seconds * 1e6, " us");
}

// --check-config: the effective job and serving settings (secrets as set or
// not).
void PrintConfig(const JobConfig& job, const ServerOptions& options,
                 std::ostream& out) {
  auto set = [](const std::string& s) { return s.empty() ? "no" : "yes"; };
  out << "job id:            " << job.job_id << "\n"
      << "world size:        " << job.world_size << "\n"
      << "mesh:              " << hsdp::MeshToString(job.mesh) << "\n"
      << "state dir:         "
      << (job.state_dir.empty() ? "(none)" : job.state_dir) << "\n"
      << "heartbeat timeout: " << absl::FormatDuration(job.heartbeat_timeout)
      << "\n"
      << "read ahead:        " << job.read_ahead << "\n"
      << "intra-host link:   " << DescribeLink(job.links.intra_host) << "\n"
      << "inter-host link:   " << DescribeLink(job.links.inter_host) << "\n"
      << "listen:            " << options.listen << "\n"
      << "metrics listen:    " << options.metrics_listen << "\n"
      << "tls:               " << set(options.tls_cert_pem) << "\n"
      << "tls client ca:     " << set(options.tls_client_ca_pem) << "\n"
      << "control token:     " << set(options.control_token) << "\n"
      << "job token:         " << set(options.job_token) << "\n"
      << "policy:\n"
      << hsdp::DescribePolicy(job.policy);
}

}  // namespace

int main(int argc, char** argv) {
  // Debian's Abseil is built with Mutex deadlock detection on: a lock-order
  // graph update on every lock (~5% of the coordinator's CPU under load, gRPC's
  // own mutexes included). Lock order is checked in tests, not in production.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  CLI::App app{"hsdp-coordinator: the control plane of one hsdp training job",
               "hsdp-coordinator"};
  Flags f;
  app.set_config("--job-file", "",
                 "File of `name = value` lines setting the flags below");
  app.add_option("--job-id", f.job_id, "Job id")->envname("HSDP_JOB_ID");
  app.add_option("--world-size", f.world_size, "Number of ranks")
      ->envname("HSDP_WORLD_SIZE");
  app.add_option("--mesh", f.mesh,
                 "Mesh RxS (default 1xWORLD), or auto: (WORLD/G)xG with G "
                 "from --ranks-per-host")
      ->envname("HSDP_MESH");
  app.add_option("--ranks-per-host", f.ranks_per_host,
                 "With --mesh auto: ranks on each host, the shard degree G "
                 "(must divide --world-size)")
      ->envname("HSDP_RANKS_PER_HOST");
  app.add_option("--policy-file", f.policy_file,
                 "Initial policy (JSON or text format)")
      ->envname("HSDP_POLICY_FILE");
  app.add_option("--listen", f.listen, "gRPC HOST:PORT (port 0: ephemeral)")
      ->envname("HSDP_LISTEN");
  app.add_option("--port-file", f.port_file,
                 "Write the bound port to this file");
  app.add_option("--state-dir", f.state_dir,
                 "Persist state here (survives restarts)")
      ->envname("HSDP_STATE_DIR");
  // No environment fallback: an operator's repair, named on the command line
  // of one start.
  app.add_option("--truncate-sealed-after", f.truncate_sealed_after,
                 "Repair a state directory refused at start: move the sealed "
                 "step files after STEP aside and seal those steps again "
                 "(refused if a later step committed)");
  app.add_option("--metrics-listen", f.metrics_listen,
                 "HOST:PORT of /metrics and the dashboard (\"\": off)")
      ->envname("HSDP_METRICS_LISTEN");
  app.add_option("--dashboard-url", f.dashboard_url,
                 "Dashboard URL hsdpctl status shows (default: "
                 "http://HOST:PORT/ of --metrics-listen)")
      ->envname("HSDP_DASHBOARD_URL");
  app.add_option("--dashboard-url-file", f.dashboard_url_file,
                 "Write the dashboard URL to this file");
  app.add_option("--heartbeat-timeout", f.heartbeat_timeout_s,
                 "Seconds before a worker is lost")
      ->envname("HSDP_HEARTBEAT_TIMEOUT");
  app.add_option("--read-ahead", f.read_ahead, "Steps workers may read ahead");
  app.add_option("--min-replicas", f.min_replicas,
                 "Fewest replica groups a generation may train with")
      ->envname("HSDP_MIN_REPLICAS");
  app.add_option("--join-wait", f.join_wait_s,
                 "Seconds a joining worker (or an eviction) waits for a step "
                 "boundary")
      ->envname("HSDP_JOIN_WAIT");
  app.add_option("--reform-window", f.reform_window_s,
                 "Seconds an ending generation waits at most for a member "
                 "whose connection is up to report in (one whose connection "
                 "closed is not waited for)")
      ->envname("HSDP_REFORM_WINDOW");
  app.add_option("--intra-host-link", f.intra_host_link,
                 "What an all-gather costs within a host, GBIT_PER_S[,"
                 "LATENCY_US]: the memory-budget planner weighs the blocks "
                 "it keeps unsharded by it")
      ->envname("HSDP_INTRA_HOST_LINK");
  app.add_option("--inter-host-link", f.inter_host_link,
                 "The same across hosts, used when a shard group spans hosts")
      ->envname("HSDP_INTER_HOST_LINK");
  app.add_option("--tls-cert", f.tls_cert, "PEM certificate (TLS)")
      ->envname("HSDP_TLS_CERT");
  app.add_option("--tls-key", f.tls_key, "PEM private key (TLS)")
      ->envname("HSDP_TLS_KEY");
  app.add_option("--tls-client-ca", f.tls_client_ca,
                 "PEM CA: require client certificates it signed (mutual TLS)")
      ->envname("HSDP_TLS_CLIENT_CA");
  app.add_option("--control-token-file", f.control_token_file,
                 "Require this bearer token on ControlService calls")
      ->envname("HSDP_CONTROL_TOKEN_FILE");
  app.add_option("--job-token-file", f.job_token_file,
                 "Require this bearer token on every worker call "
                 "(CoordinatorService); or env HSDP_JOB_TOKEN")
      ->envname(hsdp::kJobTokenFileEnv);
  app.add_option("--shutdown-deadline", f.shutdown_deadline_s,
                 "Seconds in-flight calls get on SIGTERM");
  app.add_option(
      "--validate-policy", f.validate_policy,
      "Validate a policy file, print it and exit (0 valid, 1 invalid)");
  app.add_flag("--check-config", f.check_config,
               "Check the flags, job file and environment, print the job and "
               "exit (0 valid, 2 invalid)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::string what = e.what();
    for (char& c : what) {
      if (c == '\n') c = ' ';
    }
    std::cerr << "hsdp-coordinator: " << what << "\n";
    return kExitUsage;
  }
  if (!f.validate_policy.empty()) return ValidatePolicyFile(f.validate_policy);

  absl::StatusOr<JobConfig> job = BuildJobConfig(f);
  if (!job.ok()) {
    std::cerr << "hsdp-coordinator: " << job.status().message() << "\n";
    return kExitUsage;
  }
  absl::StatusOr<ServerOptions> options = BuildServerOptions(f);
  if (!options.ok()) {
    std::cerr << "hsdp-coordinator: " << options.status().message() << "\n";
    return kExitUsage;
  }
  if (f.check_config) {
    PrintConfig(*job, *options, std::cout);
    return 0;
  }

  // Block the stop signals before any thread exists, so every thread inherits
  // the mask and only the sigwait below receives them.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  absl::StatusOr<std::unique_ptr<CoordinatorServer>> server =
      CoordinatorServer::Start(*job, *options);
  if (!server.ok()) {
    std::cerr << "hsdp-coordinator: " << server.status() << "\n";
    return kExitError;
  }
  // Before the port file: whoever waits for that one finds this one too.
  if (!f.dashboard_url_file.empty() && !(*server)->dashboard_url().empty()) {
    absl::Status written = hsdp::WriteFileAtomically(
        f.dashboard_url_file, absl::StrCat((*server)->dashboard_url(), "\n"),
        /*sync=*/false);
    if (!written.ok()) {
      std::cerr << "hsdp-coordinator: --dashboard-url-file: " << written
                << "\n";
      return kExitError;
    }
  }
  if (!f.port_file.empty()) {
    absl::Status written = hsdp::WriteFileAtomically(
        f.port_file, absl::StrCat((*server)->port(), "\n"), /*sync=*/false);
    if (!written.ok()) {
      std::cerr << "hsdp-coordinator: --port-file: " << written << "\n";
      return kExitError;
    }
  }
  std::cerr << "hsdp-coordinator: job " << job->job_id << ", world "
            << job->world_size << ", mesh " << hsdp::MeshToString(job->mesh)
            << ", policy version "
            << (*server)->schedule_log().CurrentPolicy().version
            << ", sealed step " << (*server)->schedule_log().sealed_step();
  if ((*server)->metrics_port() != 0) {
    std::cerr << ", metrics on port " << (*server)->metrics_port()
              << ", dashboard " << (*server)->dashboard_url();
  }
  std::cerr << "\n";
  if (options->job_token.empty()) {
    std::cerr << "hsdp-coordinator: warning: no job token (--job-token-file, "
                 "HSDP_JOB_TOKEN): anyone who reaches the port can join the "
                 "job and use its rendezvous store\n";
  }
  std::cout << "listening on " << (*server)->address() << std::endl;

  int sig = 0;
  sigwait(&stop_signals, &sig);
  std::cerr << "hsdp-coordinator: " << (sig == SIGTERM ? "SIGTERM" : "SIGINT")
            << ": shutting down\n";
  (*server)->Shutdown();
  return 0;
}
