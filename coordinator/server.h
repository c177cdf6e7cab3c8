// Assembles a running coordinator: state store, membership, schedule log,
// rendezvous store, metrics, and one gRPC server carrying CoordinatorService,
// ControlService, the gRPC health service (per-service status) and reflection;
// plus, on the metrics port, an HTTP server with /metrics and the dashboard.
#ifndef HSDP_COORDINATOR_SERVER_H_
#define HSDP_COORDINATOR_SERVER_H_

#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "coordinator/core/schedule_log.h"
#include "coordinator/core/trace_collector.h"
#include "coordinator/service/schedule_feed.h"
#include "hsdp/mesh.h"
#include "hsdp/v1/policy.pb.h"

namespace grpc {
class Server;
}

namespace hsdp::coordinator {

class CallTracker;
class ControlServiceImpl;
class CoordinatorServiceImpl;
class CoreEvents;
class Dashboard;
class HttpServer;
class KvStore;
class Membership;
class Metrics;
class ReportBook;
class StateStore;

// Service names the health service reports on (plus "" for the whole server).
inline constexpr char kCoordinatorServiceName[] = "hsdp.v1.CoordinatorService";
inline constexpr char kControlServiceName[] = "hsdp.v1.ControlService";

// What the job is: from flags or a job file.
struct JobConfig {
  std::string job_id;
  int world_size = 1;
  MeshShape mesh;
  hsdp::v1::Policy policy;
  // Empty: no persistence.
  std::string state_dir;
  absl::Duration heartbeat_timeout = absl::Seconds(10);
  int read_ahead = kDefaultReadAhead;
  // Elastic settings (see coordinator/core/membership.h): the fewest replica
  // groups a generation may have, how long a joiner or an eviction waits for
  // a step boundary, how long an ending generation waits at most for a
  // member whose connection is up to report in.
  int min_replicas = 1;
  absl::Duration join_wait = absl::Seconds(60);
  absl::Duration reform_window = absl::Seconds(5);
  // What an all-gather costs within a host and across hosts (undeclared: the
  // memory-budget planner keeps the most blocks that fit; see planner.h).
  LinkCosts links;
  // >= 0: before restoring, move every sealed step file after this step
  // aside (StateStore::TruncateSealedSteps). An operator's repair of a
  // damaged state directory; never done otherwise.
  int64_t truncate_sealed_after = -1;
};

// How it is served.
struct ServerOptions {
  // HOST:PORT; port 0 picks a free port (see CoordinatorServer::port()).
  std::string listen = "0.0.0.0:50051";
  // HOST:PORT for /metrics and the dashboard; empty: neither is served.
  std::string metrics_listen;
  // The dashboard URL GetStatus reports; empty: derived from metrics_listen
  // (see DashboardUrl). For clusters, where the bound address is not the one
  // people open.
  std::string dashboard_url;
  // PEM contents; both set: TLS, both empty: plaintext.
  std::string tls_cert_pem;
  std::string tls_key_pem;
  // PEM CA certificate(s); set (needs TLS): every client must present a
  // certificate this CA signed (mutual TLS), workers and hsdpctl alike.
  std::string tls_client_ca_pem;
  // Empty: ControlService is open.
  std::string control_token;
  // Empty: CoordinatorService (workers, rendezvous store) is open. Set: every
  // CoordinatorService call must carry it (`authorization: Bearer <token>`).
  std::string job_token;
  // How long Shutdown() lets in-flight calls finish before cancelling them.
  absl::Duration shutdown_deadline = absl::Seconds(10);
  // fsync state writes (tests and benchmarks that never crash the machine may
  // skip it).
  bool sync_state = true;
  // WatchSchedules pushes step s once the slowest rank completed s - 1 -
  // schedule_push_ahead (coordinator/service/schedule_feed.h).
  int schedule_push_ahead = kDefaultPushAhead;
};

// Thread-safe: Shutdown() may be called from any thread (e.g. a signal-waiting
// one), any number of times; the accessors are immutable after Start().
class CoordinatorServer {
 public:
  // Builds everything and starts serving. Errors: INVALID_ARGUMENT for a bad
  // job spec (mesh not matching the world, invalid policy) or TLS settings,
  // FAILED_PRECONDITION when the state directory belongs to another job or is
  // in use by another coordinator, UNAVAILABLE when a port cannot be bound.
  static absl::StatusOr<std::unique_ptr<CoordinatorServer>> Start(
      const JobConfig& job, const ServerOptions& options);
  ~CoordinatorServer();
  CoordinatorServer(const CoordinatorServer&) = delete;
  CoordinatorServer& operator=(const CoordinatorServer&) = delete;

  // The bound port and "HOST:PORT" with it (the listen host, port resolved).
  int port() const { return port_; }
  const std::string& address() const { return address_; }
  // Bound metrics port, or 0.
  int metrics_port() const { return metrics_port_; }
  // The dashboard's URL, or "" when there is no metrics port.
  const std::string& dashboard_url() const { return dashboard_url_; }

  // First phase of a graceful stop: health turns NOT_SERVING for every service
  // (probes and load balancers stop sending work), waiting long polls are
  // released with UNAVAILABLE, and from then on GetSchedule and the store's
  // Get/Wait answer UNAVAILABLE at once (workers retry against the next
  // coordinator). The other calls are still answered. Idempotent.
  void StopServing() ABSL_LOCKS_EXCLUDED(mu_);

  // Graceful stop: StopServing(), then the calls in flight get up to the
  // shutdown deadline to finish, then the gRPC server shuts down (cancelling
  // what is left, closing connections). Idempotent.
  void Shutdown() ABSL_LOCKS_EXCLUDED(mu_);

  // Blocks until Shutdown() completed.
  void Wait();

  // For in-process tests and the benchmark.
  Metrics& metrics() { return *metrics_; }
  ScheduleLog& schedule_log() { return *schedule_log_; }
  Membership& membership() { return *membership_; }

 private:
  CoordinatorServer();
  void SweepLoop(absl::Duration period);

  std::unique_ptr<StateStore> state_store_;
  std::unique_ptr<Membership> membership_;
  std::unique_ptr<ScheduleLog> schedule_log_;
  std::unique_ptr<KvStore> kv_store_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<ReportBook> reports_;
  std::unique_ptr<CallTracker> calls_;
  std::unique_ptr<CoreEvents> events_;
  std::unique_ptr<CoordinatorServiceImpl> coordinator_service_;
  std::unique_ptr<ControlServiceImpl> control_service_;
  std::unique_ptr<Dashboard> dashboard_;
  // Before server_: streams report their end to it until the server is gone.
  std::unique_ptr<ScheduleFeed> schedule_feed_;
  std::unique_ptr<TraceCollector> traces_;
  std::unique_ptr<grpc::Server> server_;
  // Last, so it stops (waiting for its handlers) before what they use goes.
  std::unique_ptr<HttpServer> http_server_;
  int port_ = 0;
  std::string address_;
  int metrics_port_ = 0;
  std::string dashboard_url_;
  absl::Duration shutdown_deadline_;

  absl::Notification stop_sweeping_;
  std::thread sweeper_;
  absl::Notification shut_down_;
  absl::Mutex mu_;
  bool stopped_serving_ ABSL_GUARDED_BY(mu_) = false;
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
};

// "HOST:PORT" with PORT replaced by `port` ("0.0.0.0:0", 4242 ->
// "0.0.0.0:4242"; IPv6 "[::]:0" works too).
std::string WithPort(const std::string& listen, int port);

}  // namespace hsdp::coordinator

#endif  // HSDP_COORDINATOR_SERVER_H_
