#include "coordinator/server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/policy.h"
#include "common/status_util.h"
#include "coordinator/core/coordinator_core.h"
#include "coordinator/core/core_events.h"
#include "coordinator/core/kv_store.h"
#include "coordinator/core/membership.h"
#include "coordinator/core/metrics.h"
#include "coordinator/core/report_book.h"
#include "coordinator/core/state_store.h"
#include "coordinator/service/control_service.h"
#include "coordinator/service/coordinator_service.h"
#include "coordinator/service/dashboard.h"
#include "coordinator/service/http_server.h"
#include "coordinator/service/service_context.h"

namespace hsdp::coordinator {
namespace {

// Keepalive: ping idle connections every 30 s and drop peers that do not answer
// within 10 s, so a worker whose host vanished is noticed by the transport, not
// only by heartbeats. Clients may ping every 10 s even without calls in flight
// (long polls sit idle on the wire).
constexpr int kKeepaliveTimeMs = 30'000;
constexpr int kKeepaliveTimeoutMs = 10'000;
constexpr int kMinClientPingIntervalMs = 10'000;
// Rendezvous values may be up to kMaxKvValueBytes; leave room for the envelope.
constexpr int kMaxMessageBytes = 2 * static_cast<int>(kMaxKvValueBytes);
// Heartbeat sweeps run this many times per timeout.
constexpr int kSweepsPerTimeout = 4;
constexpr absl::Duration kMinSweepPeriod = absl::Milliseconds(20);

// The sweep also forms an ending generation once its reform window passed: as
// fine-grained as the shorter of the two.
absl::Duration SweepPeriod(const JobConfig& job) {
  absl::Duration period = job.heartbeat_timeout / kSweepsPerTimeout;
  if (job.reform_window > absl::ZeroDuration()) {
    period = std::min(period, job.reform_window / kSweepsPerTimeout);
  }
  return std::max(kMinSweepPeriod, period);
}

}  // namespace

std::string WithPort(const std::string& listen, int port) {
  const size_t colon = listen.rfind(':');
  const std::string host =
      colon == std::string::npos ? listen : listen.substr(0, colon);
  return absl::StrCat(host, ":", port);
}

CoordinatorServer::CoordinatorServer() = default;

CoordinatorServer::~CoordinatorServer() { Shutdown(); }

absl::StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Start(
    const JobConfig& job, const ServerOptions& options) {
  std::unique_ptr<CoordinatorServer> s(new CoordinatorServer());
  s->shutdown_deadline_ = options.shutdown_deadline;
  if (job.job_id.empty()) return absl::InvalidArgumentError("job id: empty");
  HSDP_RETURN_IF_ERROR(ValidateMesh(job.mesh, job.world_size));
  if (options.tls_cert_pem.empty() != options.tls_key_pem.empty()) {
    return absl::InvalidArgumentError("TLS needs both a certificate and a key");
  }
  if (!options.tls_client_ca_pem.empty() && options.tls_cert_pem.empty()) {
    return absl::InvalidArgumentError(
        "a client CA (mutual TLS) needs the server's own TLS certificate and "
        "key");
  }

  StateStore* store = nullptr;
  if (!job.state_dir.empty()) {
    StateStore::Options store_options;
    store_options.sync = options.sync_state;
    HSDP_ASSIGN_OR_RETURN(s->state_store_,
                          StateStore::Open(job.state_dir, store_options));
    store = s->state_store_.get();
    if (job.truncate_sealed_after >= 0) {
      HSDP_ASSIGN_OR_RETURN(const int moved, store->TruncateSealedSteps(
                                                 job.truncate_sealed_after));
      std::cerr << "hsdp-coordinator: --truncate-sealed-after "
                << job.truncate_sealed_after << ": moved " << moved
                << " sealed step file(s) into " << job.state_dir
                << "/truncated-*/; the steps after "
                << job.truncate_sealed_after << " are sealed again\n";
    }
  }
  Membership::Options membership_options;
  membership_options.job_id = job.job_id;
  membership_options.world_size = job.world_size;
  membership_options.mesh = job.mesh;
  membership_options.heartbeat_timeout = job.heartbeat_timeout;
  membership_options.min_replicas = job.min_replicas;
  membership_options.join_wait = job.join_wait;
  membership_options.reform_window = job.reform_window;
  // The sweeper runs at least four times per heartbeat timeout: a gap of half
  // of one means the process did not run.
  membership_options.pause_threshold = job.heartbeat_timeout / 2;
  HSDP_ASSIGN_OR_RETURN(s->membership_,
                        Membership::Create(membership_options, store));
  ScheduleLog::Options log_options;
  log_options.world_size = job.world_size;
  log_options.shard_size = job.mesh.shard;
  log_options.read_ahead = job.read_ahead;
  log_options.links = job.links;
  HSDP_ASSIGN_OR_RETURN(s->schedule_log_,
                        ScheduleLog::Create(log_options, job.policy, store));
  // The draining flag is not persisted by the membership: the drain step is.
  if (s->schedule_log_->drain_step() >= 0) s->membership_->SetDraining(true);
  if (s->membership_->has_model() && !s->schedule_log_->has_units()) {
    absl::Status units = s->schedule_log_->SetUnits(s->membership_->units());
    if (!units.ok())
      std::cerr << "hsdp-coordinator: restored model: " << units << "\n";
  }
  // The read-ahead window starts at the last committed step (persisted by
  // Membership; the log does not keep it).
  s->schedule_log_->RecordCommitted(s->membership_->last_committed_step());
  s->kv_store_ = std::make_unique<KvStore>();
  s->metrics_ = std::make_unique<Metrics>();
  if (!options.metrics_listen.empty()) {
    HttpServer::Options http_options;
    http_options.listen = options.metrics_listen;
    absl::StatusOr<std::unique_ptr<HttpServer>> http =
        HttpServer::Start(http_options);
    if (!http.ok()) return AnnotateStatus(http.status(), "metrics");
    s->http_server_ = *std::move(http);
    s->metrics_port_ = s->http_server_->port();
    s->dashboard_url_ = DashboardUrl(options.metrics_listen, s->metrics_port_,
                                     options.dashboard_url);
  }
  s->reports_ = std::make_unique<ReportBook>();
  s->calls_ = std::make_unique<CallTracker>();
  s->traces_ = std::make_unique<TraceCollector>();

  CoordinatorCore core;
  core.membership = s->membership_.get();
  core.schedule_log = s->schedule_log_.get();
  core.kv_store = s->kv_store_.get();
  core.metrics = s->metrics_.get();
  core.reports = s->reports_.get();
  core.traces = s->traces_.get();
  core.dashboard_url = s->dashboard_url_;
  s->events_ = std::make_unique<CoreEvents>(core);
  s->membership_->SetListener(s->events_.get());
  // Restored: the generation's layout is not reported again until the next
  // one forms.
  if (!s->membership_->Status().topology_warnings.empty()) {
    s->schedule_log_->SetShardGroupsCrossHosts(
        s->membership_->generation(),
        s->membership_->current_generation().host_group_size());
  }
  ScheduleFeed::Options feed_options;
  feed_options.push_ahead = options.schedule_push_ahead;
  Membership* membership = s->membership_.get();
  // A member whose process died is not waited for when its generation ends.
  feed_options.on_stream_lost = [membership](int64_t worker_id,
                                             int64_t generation) {
    membership->ScheduleStreamLost(worker_id, generation);
  };
  s->schedule_feed_ =
      std::make_unique<ScheduleFeed>(s->schedule_log_.get(), feed_options);
  ServiceContext service;
  service.calls = s->calls_.get();
  service.schedule_feed = s->schedule_feed_.get();
  s->coordinator_service_ = std::make_unique<CoordinatorServiceImpl>(
      core, service, options.job_token);
  s->control_service_ = std::make_unique<ControlServiceImpl>(
      core, service, options.control_token);
  RefreshMembershipMetrics(core);
  s->metrics_->SetReplicas(
      s->membership_->current_generation().mesh().replicate());
  s->metrics_->SetCommittedStep(s->membership_->last_committed_step());
  s->metrics_->SetPolicyVersion(s->schedule_log_->CurrentPolicy().version);
  if (s->http_server_ != nullptr) {
    Metrics* metrics = s->metrics_.get();
    s->http_server_->Handle("GET", "/metrics", [metrics](const HttpRequest&) {
      HttpResponse response;
      response.content_type = Metrics::kScrapeContentType;
      response.body = metrics->Scrape();
      return response;
    });
    s->dashboard_ = std::make_unique<Dashboard>(core, options.control_token);
    s->dashboard_->Register(*s->http_server_);
  }

  // Both are process-wide switches read by the next ServerBuilder.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  std::shared_ptr<grpc::ServerCredentials> creds;
  if (options.tls_cert_pem.empty()) {
    creds = grpc::InsecureServerCredentials();
  } else {
    grpc::SslServerCredentialsOptions ssl;
    ssl.pem_key_cert_pairs.push_back(
        {options.tls_key_pem, options.tls_cert_pem});
    if (!options.tls_client_ca_pem.empty()) {
      ssl.pem_root_certs = options.tls_client_ca_pem;
      ssl.client_certificate_request =
          GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
    }
    creds = grpc::SslServerCredentials(ssl);
  }
  builder.AddListeningPort(options.listen, creds, &s->port_);
  builder.RegisterService(s->coordinator_service_.get());
  builder.RegisterService(s->control_service_.get());
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveTimeMs);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                             kKeepaliveTimeoutMs);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(
      GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
      kMinClientPingIntervalMs);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  // gRPC binds with SO_REUSEPORT by default: a second coordinator on the same
  // port would start "fine" and split the workers' connections between two
  // jobs. Refuse the port instead.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr || s->port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", options.listen));
  }
  s->address_ = WithPort(options.listen, s->port_);
  grpc::HealthCheckServiceInterface* health =
      s->server_->GetHealthCheckService();
  health->SetServingStatus("", true);
  health->SetServingStatus(kCoordinatorServiceName, true);
  health->SetServingStatus(kControlServiceName, true);

  const absl::Duration sweep_period = SweepPeriod(job);
  s->sweeper_ = std::thread(
      [server = s.get(), sweep_period] { server->SweepLoop(sweep_period); });
  return s;
}

void CoordinatorServer::SweepLoop(absl::Duration period) {
  while (!stop_sweeping_.WaitForNotificationWithTimeout(period)) {
    coordinator_service_->Tick();
  }
}

void CoordinatorServer::StopServing() {
  {
    absl::MutexLock lock(&mu_);
    if (stopped_serving_ || server_ == nullptr) return;
    stopped_serving_ = true;
  }
  // Load balancers and kubelet probes see NOT_SERVING first (the default
  // health service flips every service and ignores later changes).
  server_->GetHealthCheckService()->Shutdown();
  // Release long polls so they answer UNAVAILABLE now instead of running into
  // the deadline.
  schedule_feed_->Shutdown();
  schedule_log_->Shutdown();
  kv_store_->Shutdown();
  membership_->Shutdown();
}

void CoordinatorServer::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (shutting_down_) return;
    shutting_down_ = true;
  }
  if (server_ != nullptr) {
    StopServing();
    // Our calls get until the deadline; then Shutdown(now) cancels any left
    // and drops connections without waiting for idle clients to hang up.
    calls_->WaitIdle(absl::Now() + shutdown_deadline_);
    server_->Shutdown(std::chrono::system_clock::now());
    server_->Wait();
  }
  if (sweeper_.joinable()) {
    stop_sweeping_.Notify();
    sweeper_.join();
  }
  // /metrics and the dashboard answer until the end of the graceful stop.
  http_server_.reset();
  shut_down_.Notify();
}

void CoordinatorServer::Wait() { shut_down_.WaitForNotification(); }

}  // namespace hsdp::coordinator
