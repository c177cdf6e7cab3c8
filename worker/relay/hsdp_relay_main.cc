// hsdp-relay: one per host, beside the host's workers. They open their schedule
// and report streams to it (hsdp-worker --relay ADDRESS) and it holds one pair
// for the whole host to the coordinator (host_relay.h), so the coordinator's
// messages per step grow with hosts, not ranks. Workers' calls still go to the
// coordinator, and a worker whose relay is gone carries on with those calls.
//
//   hsdp-relay --coordinator HOST:PORT [--listen unix:/run/hsdp-relay.sock]
#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <cstdio>
#include <memory>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "common/token.h"
#include "worker/agent/agent.h"
#include "worker/relay/host_relay.h"

int main(int argc, char** argv) {
  CLI::App app{
      "hsdp-relay: carries the schedule and report streams of one host's "
      "workers to the coordinator over one pair of streams",
      "hsdp-relay"};
  std::string coordinator = "localhost:50051";
  std::string listen = "127.0.0.1:50052";
  hsdp::agent::AgentSecurityFiles files;
  int keep = 64;
  app.add_option("--coordinator", coordinator, "coordinator HOST:PORT")
      ->envname("HSDP_COORDINATOR");
  app.add_option("--listen", listen,
                 "where the host's workers reach it: HOST:PORT or unix:PATH "
                 "(give the workers the same as --relay); keep it local")
      ->envname("HSDP_RELAY");
  app.add_option("--job-token-file", files.job_token_file,
                 "file holding the job's worker token (else "
                 "HSDP_JOB_TOKEN_FILE, else HSDP_JOB_TOKEN): sent to the "
                 "coordinator and asked of the workers");
  app.add_option("--tls-ca", files.tls_ca,
                 "PEM CA of the coordinator's certificate (TLS)")
      ->envname("HSDP_TLS_CA");
  app.add_option("--tls-client-cert", files.tls_client_cert,
                 "the relay's PEM certificate (mutual TLS)")
      ->envname("HSDP_TLS_CLIENT_CERT");
  app.add_option("--tls-client-key", files.tls_client_key,
                 "the relay's PEM private key (mutual TLS)")
      ->envname("HSDP_TLS_CLIENT_KEY");
  app.add_option("--keep-messages", keep,
                 "schedule messages kept per generation for workers that "
                 "open their stream late")
      ->check(CLI::Range(1, 1 << 20));
  CLI11_PARSE(app, argc, argv);

  hsdp::agent::AgentOptions options;
  options.coordinator = coordinator;
  if (absl::Status s = hsdp::agent::LoadAgentSecurityFiles(files, &options);
      !s.ok()) {
    std::fprintf(stderr, "hsdp-relay: %s\n", s.ToString().c_str());
    return 2;
  }
  absl::Status setup;
  std::shared_ptr<grpc::Channel> upstream = hsdp::agent::MakeCoordinatorChannel(
      options, coordinator, /*secure=*/true, &setup);
  if (!setup.ok()) {
    std::fprintf(stderr, "hsdp-relay: %s\n", setup.ToString().c_str());
    return 2;
  }
  std::string token = options.job_token;
  if (token.empty()) {
    absl::StatusOr<std::string> from_env =
        hsdp::ResolveToken("", hsdp::kJobTokenFileEnv, hsdp::kJobTokenEnv);
    if (from_env.ok()) token = *std::move(from_env);
  }

  // Block the stop signals before any thread exists, so only sigwait gets
  // them.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  hsdp::relay::HostRelay relay(upstream, {token, keep});
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(listen, grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&relay);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) {
    std::fprintf(stderr, "hsdp-relay: cannot listen on %s\n", listen.c_str());
    return 1;
  }
  std::fprintf(stderr, "hsdp-relay: listening on %s, relaying to %s\n",
               listen.c_str(), coordinator.c_str());
  int sig = 0;
  sigwait(&stop_signals, &sig);
  relay.Stop();
  server->Shutdown();
  const hsdp::relay::HostRelay::Stats stats = relay.stats();
  std::fprintf(
      stderr,
      "hsdp-relay: stopped; carried %lld local messages in %lld "
      "upstream ones, %lld local schedule streams over %lld upstream\n",
      static_cast<long long>(stats.relayed),
      static_cast<long long>(stats.upstream_messages),
      static_cast<long long>(stats.local_watches),
      static_cast<long long>(stats.upstream_watches));
  return 0;
}
