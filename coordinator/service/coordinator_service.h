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
#ifndef HSDP_COORDINATOR_SERVICE_COORDINATOR_SERVICE_H_
#define HSDP_COORDINATOR_SERVICE_COORDINATOR_SERVICE_H_

#include <string>
#include <utility>

#include "common/status_util.h"
#include "coordinator/core/coordinator_core.h"
#include "coordinator/service/bearer_auth.h"
#include "coordinator/service/service_context.h"
#include "hsdp/v1/coordinator_service.grpc.pb.h"

namespace grpc {
class ServerContext;
}

namespace hsdp::coordinator {

// Thread-safe: all state lives in the (thread-safe) core components; the job
// token is immutable. WatchSchedules is a callback-API stream (no thread per
// stream); the other methods are synchronous.
//
// Authentication: with a job token, every call must carry `authorization:
// Bearer <job token>`; a call without it or with another token is
// UNAUTHENTICATED and reads or changes nothing.
// The generated service with the quick per-step calls (Heartbeat,
// ReportStep, StreamReports) on the callback API and WatchSchedules raw (see
// below).
using CoordinatorServiceBase =
    hsdp::v1::CoordinatorService::WithCallbackMethod_Heartbeat<
        hsdp::v1::CoordinatorService::WithCallbackMethod_ReportStep<
            hsdp::v1::CoordinatorService::WithCallbackMethod_StreamReports<
                hsdp::v1::CoordinatorService::
                    WithRawCallbackMethod_WatchSchedules<
                        hsdp::v1::CoordinatorService::Service>>>>;

class CoordinatorServiceImpl final : public CoordinatorServiceBase {
 public:
  // An empty `job_token` leaves the service open (local tests and runs).
  CoordinatorServiceImpl(CoordinatorCore core, ServiceContext service,
                         const std::string& job_token = "");
  CoordinatorServiceImpl(const CoordinatorServiceImpl&) = delete;
  CoordinatorServiceImpl& operator=(const CoordinatorServiceImpl&) = delete;

  grpc::Status Join(grpc::ServerContext* context,
                    const hsdp::v1::JoinRequest* request,
                    hsdp::v1::JoinResponse* response) override;
  // Heartbeat and ReportStep never wait: served inline on gRPC's thread
  // (the callback API), without handing the call to a synchronous server
  // thread. (ReportStep fsyncs only for the rare report that completes a
  // checkpoint or finishes the worker.) The synchronous overloads run the same
  // bodies for in-process callers (the fuzzer).
  using CoordinatorServiceBase::Heartbeat;
  grpc::ServerUnaryReactor* Heartbeat(
      grpc::CallbackServerContext* context,
      const hsdp::v1::HeartbeatRequest* request,
      hsdp::v1::HeartbeatResponse* response) override;
  grpc::Status Heartbeat(grpc::ServerContext* context,
                         const hsdp::v1::HeartbeatRequest* request,
                         hsdp::v1::HeartbeatResponse* response) override;
  // One reader per stream (report_stream.h); each report is recorded as
  // ReportStep records it, each vote counted as CommitStep counts it (the
  // commit goes out on the schedule feed).
  using CoordinatorServiceBase::StreamReports;
  grpc::ServerReadReactor<hsdp::v1::StreamReportsRequest>* StreamReports(
      grpc::CallbackServerContext* context,
      hsdp::v1::StreamReportsResponse* response) override;
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
  using CoordinatorServiceBase::WatchSchedules;
  // Raw: the request arrives serialized, and every stream writes the bytes
  // the feed serialized once per step (schedule_feed.h).
  grpc::ServerWriteReactor<grpc::ByteBuffer>* WatchSchedules(
      grpc::CallbackServerContext* context,
      const grpc::ByteBuffer* request) override;
  using CoordinatorServiceBase::ReportStep;
  grpc::ServerUnaryReactor* ReportStep(
      grpc::CallbackServerContext* context,
      const hsdp::v1::ReportStepRequest* request,
      hsdp::v1::ReportStepResponse* response) override;
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
  grpc::Status Serve(const grpc::ServerContextBase& context, Body&& body) {
    return ServeTracked(service_.calls, [&]() -> absl::Status {
      HSDP_RETURN_IF_ERROR(job_auth_.Check(context));
      return body();
    });
  }

  // Heartbeat's and ReportStep's bodies.
  absl::Status RecordHeartbeat(const hsdp::v1::HeartbeatRequest& request,
                               hsdp::v1::HeartbeatResponse* response);
  absl::Status RecordReport(const hsdp::v1::ReportStepRequest& request);
  // A vote on the report stream (Membership::Vote); a refused one also ends
  // the voter's schedule stream.
  absl::Status RecordVote(const hsdp::v1::CommitStepRequest& vote);
  // One message of a report stream: its report and vote, then each relayed
  // worker's (all recorded; the first error is returned).
  absl::Status RecordStreamed(const hsdp::v1::StreamReportsRequest& message);
  // Runs `body` (returning absl::Status) as Serve does and finishes the
  // callback call with its result.
  template <typename Body>
  grpc::ServerUnaryReactor* ServeInline(grpc::CallbackServerContext* context,
                                        Body&& body) {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(Serve(*context, std::forward<Body>(body)));
    return reactor;
  }

  // Store calls must name the current, running generation: a stale worker
  // must re-form (ABORTED), not read or clobber another generation's
  // rendezvous.
  absl::Status CheckStoreScope(absl::string_view job_id,
                               int64_t generation) const;

  const CoordinatorCore core_;
  const ServiceContext service_;
  const BearerAuth job_auth_;
};

}  // namespace hsdp::coordinator

#endif  // HSDP_COORDINATOR_SERVICE_COORDINATOR_SERVICE_H_
