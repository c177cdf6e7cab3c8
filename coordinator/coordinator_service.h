// CoordinatorService: the worker-facing gRPC API (join, heartbeat, schedules,
// reports and the rendezvous store) on top of the coordinator core (Membership,
// ScheduleLog, KvStore).
//
// The service is a synchronous gRPC service: the core's long polls
// (ScheduleLog::GetSchedule, KvStore::Get/Wait) are blocking calls with a
// deadline, so a waiting call holds one server thread. Each wait is bounded by
// the call's deadline and by kMaxLongPoll, and Shutdown() of the core
// components releases every waiter at once (UNAVAILABLE) when the server stops.
// (A callback-API version that parked only waiting calls on threads measured no
// faster on the 2-core benchmark, so the simpler synchronous one stayed.)
#ifndef HSDP_COORDINATOR_COORDINATOR_SERVICE_H_
#define HSDP_COORDINATOR_COORDINATOR_SERVICE_H_

#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/status_util.h"
#include "coordinator/bearer_auth.h"
#include "coordinator/grpc_status.h"
#include "coordinator/kv_store.h"
#include "coordinator/membership.h"
#include "coordinator/metrics.h"
#include "coordinator/schedule_feed.h"
#include "coordinator/schedule_log.h"
#include "coordinator/trace_collector.h"
#include "hsdp/v1/coordinator_service.grpc.pb.h"

namespace grpc {
class ServerContext;
}

namespace hsdp::coordinator {

// A long poll never waits longer than this even when the client sets no
// deadline, so a vanished client cannot pin a server thread forever.
inline constexpr absl::Duration kMaxLongPoll = absl::Seconds(60);

// The latest StepReport of every worker (by worker id), for ListWorkers.
// Thread-safe.
class ReportBook {
 public:
  ReportBook() = default;
  ReportBook(const ReportBook&) = delete;
  ReportBook& operator=(const ReportBook&) = delete;

  void Record(const hsdp::v1::StepReport& report) ABSL_LOCKS_EXCLUDED(mu_);
  // False when the worker never reported.
  bool Latest(int64_t worker_id, hsdp::v1::StepReport* report) const
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable absl::Mutex mu_;
  std::map<int64_t, hsdp::v1::StepReport> latest_ ABSL_GUARDED_BY(mu_);
};

// Counts calls being handled, so a graceful shutdown can wait for exactly those
// and then close client connections at once (gRPC's own Shutdown(deadline)
// also waits for idle client connections to go away, which can take the whole
// deadline). Thread-safe.
class CallTracker {
 public:
  CallTracker() = default;
  CallTracker(const CallTracker&) = delete;
  CallTracker& operator=(const CallTracker&) = delete;

  // Marks one call in flight for its lifetime.
  class Scope {
   public:
    explicit Scope(CallTracker* tracker) : tracker_(tracker) {
      absl::MutexLock lock(&tracker_->mu_);
      ++tracker_->active_;
    }
    ~Scope() {
      absl::MutexLock lock(&tracker_->mu_);
      --tracker_->active_;
    }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    CallTracker* const tracker_;
  };

  // True when no call is in flight (waiting at most until `deadline`).
  bool WaitIdle(absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    auto idle = [this]()
                    ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return active_ == 0; };
    return mu_.AwaitWithDeadline(absl::Condition(&idle), deadline);
  }

 private:
  absl::Mutex mu_;
  int active_ ABSL_GUARDED_BY(mu_) = 0;
};

// The components a service works on; owned by the server, shared by both
// services.
struct CoordinatorCore {
  Membership* membership = nullptr;
  ScheduleLog* schedule_log = nullptr;
  KvStore* kv_store = nullptr;
  Metrics* metrics = nullptr;
  ReportBook* reports = nullptr;
  CallTracker* calls = nullptr;
  // Cap on one long poll (in-process fuzzing shortens it).
  absl::Duration max_long_poll = kMaxLongPoll;
  // Where the dashboard is served ("" when it is not), for GetStatus.
  std::string dashboard_url;
  // Serves WatchSchedules; null: UNIMPLEMENTED (workers use GetSchedule).
  ScheduleFeed* schedule_feed = nullptr;
  // Collects the spans of traced steps (hsdpctl trace); null: dropped.
  TraceCollector* traces = nullptr;
};

// Runs a handler body (returning absl::Status) as one tracked call and
// converts its result for the wire.
template <typename Body>
grpc::Status ServeTracked(CallTracker* calls, Body&& body) {
  CallTracker::Scope scope(calls);
  return ToGrpcStatus(body());
}

// Pushes the worker counts, generation and sealed step into the metrics. Called
// after membership changes (join, sweep, finish), not per report, since it
// walks all workers.
void RefreshMembershipMetrics(const CoordinatorCore& core);

// Carries membership events to the other components: a generation that ends
// closes its rendezvous (waiting store calls fail ABORTED); a new one starts
// the schedule log's generation (re-sealing uncommitted steps for its world)
// and drops the old rendezvous keys; commits move the read-ahead window;
// metrics count failures and the time they cost; a shard group that spans
// hosts is logged. Runs under Membership's lock (see MembershipListener);
// thread-safe like the components it calls.
class CoreEvents final : public MembershipListener {
 public:
  explicit CoreEvents(CoordinatorCore core) : core_(core) {}
  CoreEvents(const CoreEvents&) = delete;
  CoreEvents& operator=(const CoreEvents&) = delete;

  void OnGenerationEnded(int64_t generation,
                         hsdp::v1::FailureCause cause) override;
  void OnGenerationFormed(const hsdp::v1::Generation& generation) override;
  void OnShardGroupsAcrossHosts(
      int64_t generation, const std::vector<std::string>& warnings) override;
  int64_t LastCheckpointStep() override;
  void OnStepCommitted(int64_t generation, int64_t step) override;
  void OnRecovered(const hsdp::v1::FailureRecord& failure) override;

 private:
  const CoordinatorCore core_;
};

// The deadline of a blocking call: the call's own deadline, capped at now +
// `cap`.
absl::Time LongPollDeadline(const grpc::ServerContext& context,
                            absl::Duration cap = kMaxLongPoll);

// Thread-safe: all state lives in the (thread-safe) core components; the job
// token is immutable. WatchSchedules is a callback-API stream (no thread per
// stream); the other methods are synchronous.
//
// Authentication: with a job token, every call must carry `authorization:
// Bearer <job token>`; a call without it or with another token is
// UNAUTHENTICATED and reads or changes nothing.
class CoordinatorServiceImpl final
    : public hsdp::v1::CoordinatorService::WithCallbackMethod_WatchSchedules<
          hsdp::v1::CoordinatorService::Service> {
 public:
  // An empty `job_token` leaves the service open (local tests and runs).
  explicit CoordinatorServiceImpl(CoordinatorCore core,
                                  const std::string& job_token = "");
  CoordinatorServiceImpl(const CoordinatorServiceImpl&) = delete;
  CoordinatorServiceImpl& operator=(const CoordinatorServiceImpl&) = delete;

  grpc::Status Join(grpc::ServerContext* context,
                    const hsdp::v1::JoinRequest* request,
                    hsdp::v1::JoinResponse* response) override;
  grpc::Status Heartbeat(grpc::ServerContext* context,
                         const hsdp::v1::HeartbeatRequest* request,
                         hsdp::v1::HeartbeatResponse* response) override;
  grpc::Status AwaitGeneration(
      grpc::ServerContext* context,
      const hsdp::v1::AwaitGenerationRequest* request,
      hsdp::v1::AwaitGenerationResponse* response) override;
  grpc::Status ReportFailure(
      grpc::ServerContext* context,
      const hsdp::v1::ReportFailureRequest* request,
      hsdp::v1::ReportFailureResponse* response) override;
  grpc::Status CommitStep(grpc::ServerContext* context,
                          const hsdp::v1::CommitStepRequest* request,
                          hsdp::v1::CommitStepResponse* response) override;
  grpc::Status GetSchedule(grpc::ServerContext* context,
                           const hsdp::v1::GetScheduleRequest* request,
                           hsdp::v1::GetScheduleResponse* response) override;
  // Keeps the generated synchronous overload (disabled by the base) visible
  // beside the callback override.
  using hsdp::v1::CoordinatorService::WithCallbackMethod_WatchSchedules<
      hsdp::v1::CoordinatorService::Service>::WatchSchedules;
  grpc::ServerWriteReactor<hsdp::v1::WatchSchedulesResponse>* WatchSchedules(
      grpc::CallbackServerContext* context,
      const hsdp::v1::WatchSchedulesRequest* request) override;
  grpc::Status ReportStep(grpc::ServerContext* context,
                          const hsdp::v1::ReportStepRequest* request,
                          hsdp::v1::ReportStepResponse* response) override;
  grpc::Status StoreSet(grpc::ServerContext* context,
                        const hsdp::v1::StoreSetRequest* request,
                        hsdp::v1::StoreSetResponse* response) override;
  grpc::Status StoreGet(grpc::ServerContext* context,
                        const hsdp::v1::StoreGetRequest* request,
                        hsdp::v1::StoreGetResponse* response) override;
  grpc::Status StoreWait(grpc::ServerContext* context,
                         const hsdp::v1::StoreWaitRequest* request,
                         hsdp::v1::StoreWaitResponse* response) override;

  // Membership's time-driven work (lost workers, the confirm window, joiners
  // waiting for a step boundary). The server calls it periodically.
  void Tick();

 private:
  // Every handler body runs through here: the job token is checked before the
  // body sees the request. (gRPC C++ server interceptors cannot refuse a call,
  // so the check sits on the handler path; coordinator_auth_test calls every
  // method of the service's descriptor to catch a handler that skips it.)
  template <typename Body>
  grpc::Status Serve(const grpc::ServerContext& context, Body&& body) {
    return ServeTracked(core_.calls, [&]() -> absl::Status {
      HSDP_RETURN_IF_ERROR(job_auth_.Check(context));
      return body();
    });
  }

  // Store calls must name the current, running generation: a stale worker
  // must re-form (ABORTED), not read or clobber another generation's
  // rendezvous.
  absl::Status CheckStoreScope(absl::string_view job_id,
                               int64_t generation) const;

  const CoordinatorCore core_;
  const BearerAuth job_auth_;
};

}  // namespace hsdp::coordinator

#endif  // HSDP_COORDINATOR_COORDINATOR_SERVICE_H_
