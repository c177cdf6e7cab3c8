#include "coordinator/service/coordinator_service.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/codegen/proto_utils.h>
#include <grpcpp/server_context.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_util.h"
#include "common/units.h"
#include "coordinator/core/core_events.h"
#include "coordinator/core/kv_store.h"
#include "coordinator/core/membership.h"
#include "coordinator/core/metrics.h"
#include "coordinator/core/report_book.h"
#include "coordinator/core/schedule_log.h"
#include "coordinator/core/trace_collector.h"
#include "coordinator/service/grpc_status.h"
#include "coordinator/service/report_stream.h"
#include "coordinator/service/schedule_feed.h"
#include "hsdp/mesh.h"

namespace hsdp::coordinator {
namespace {

// Workers heartbeat this many times per timeout, so one delayed beat does not
// lose them.
constexpr int kHeartbeatsPerTimeout = 4;
constexpr absl::Duration kMinHeartbeatInterval = absl::Milliseconds(50);

}  // namespace

CoordinatorServiceImpl::CoordinatorServiceImpl(CoordinatorCore core,
                                               ServiceContext service,
                                               const std::string& job_token)
    : core_(core), service_(service), job_auth_(job_token, "job token") {}

grpc::Status CoordinatorServiceImpl::Join(grpc::ServerContext* context,
                                          const hsdp::v1::JoinRequest* request,
                                          hsdp::v1::JoinResponse* response) {
  return Serve(*context, [&]() -> absl::Status {
    HSDP_RETURN_IF_ERROR(core_.membership->CheckJobId(request->job_id()));
    JoinArgs args;
    if (request->has_rank_hint() && request->rank_hint() >= 0)
      args.rank_hint = request->rank_hint();
    args.hostname = request->hostname();
    args.device = request->device();
    args.model = request->model();
    args.units = UnitListFromProto(request->units());
    args.worker_id = request->worker_id();
    if (request->has_training()) args.training = request->training();
    HSDP_ASSIGN_OR_RETURN(JoinResult joined, core_.membership->Join(args));
    // Every successful join (not only the first) hands the model to the
    // schedule log, so a second worker cannot race to GetSchedule before the
    // first joiner's SetUnits ran. The same list again is a no-op.
    if (!core_.schedule_log->has_units()) {
      absl::Status units =
          core_.schedule_log->SetUnits(core_.membership->units());
      if (!units.ok()) {
        // The units are kept; only a policy override matching none of them is
        // reported.
        std::cerr << "hsdp-coordinator: model of job " << request->job_id()
                  << ": " << units << "\n";
      }
    }
    const absl::Duration interval =
        std::max(kMinHeartbeatInterval,
                 core_.membership->heartbeat_timeout() / kHeartbeatsPerTimeout);
    response->set_worker_id(joined.worker_id);
    response->set_worker_state(joined.state);
    response->set_rank(joined.rank);
    response->set_world_size(joined.generation.worker_ids_size());
    *response->mutable_mesh() = joined.generation.mesh();
    response->set_generation(joined.generation.generation());
    if (joined.member) {
      response->set_replicate_index(joined.coord.replicate_index);
      response->set_shard_index(joined.coord.shard_index);
      response->set_rendezvous_prefix(joined.generation.rendezvous_prefix());
      *response->mutable_generation_info() = joined.generation;
    } else {
      response->set_replicate_index(-1);
      response->set_shard_index(-1);
    }
    response->set_heartbeat_interval_ms(
        static_cast<int32_t>(absl::ToInt64Milliseconds(interval)));
    response->set_last_checkpoint_step(
        core_.schedule_log->last_checkpoint_step());
    RefreshMembershipMetrics(core_);
    return absl::OkStatus();
  });
}

absl::Status CoordinatorServiceImpl::RecordHeartbeat(
    const hsdp::v1::HeartbeatRequest& request,
    hsdp::v1::HeartbeatResponse* response) {
  HSDP_RETURN_IF_ERROR(core_.membership->CheckJobId(request.job_id()));
  HSDP_ASSIGN_OR_RETURN(
      HeartbeatResult beat,
      core_.membership->Heartbeat(request.worker_id(), request.rank(),
                                  request.step()));
  const bool current =
      request.worker_id() == 0 || request.generation() == beat.generation;
  if (request.step() > 0 && beat.rank >= 0 && current) {
    // A worker on step s has completed s - 1. Feeding that to the read-ahead
    // window matters after a coordinator restart: completed steps are not
    // persisted, so without it the first unsealed step would wait for
    // reports that workers only send after getting it.
    hsdp::v1::StepReport progress;
    progress.set_rank(beat.rank);
    progress.set_step(request.step() - 1);
    HSDP_RETURN_IF_ERROR(core_.schedule_log->RecordReport(progress));
  }
  // A generation different from the request's (or a REFORMING job) tells a
  // member to re-form.
  response->set_generation(beat.generation);
  response->set_job_state(beat.job_state);
  response->set_server_time_unix_nanos(absl::GetCurrentTimeNanos());
  response->set_worker_state(beat.worker_state);
  response->set_message(beat.message);
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* CoordinatorServiceImpl::Heartbeat(
    grpc::CallbackServerContext* context,
    const hsdp::v1::HeartbeatRequest* request,
    hsdp::v1::HeartbeatResponse* response) {
  return ServeInline(context,
                     [&]() { return RecordHeartbeat(*request, response); });
}

grpc::Status CoordinatorServiceImpl::Heartbeat(
    grpc::ServerContext* context, const hsdp::v1::HeartbeatRequest* request,
    hsdp::v1::HeartbeatResponse* response) {
  return Serve(*context, [&]() { return RecordHeartbeat(*request, response); });
}

grpc::Status CoordinatorServiceImpl::AwaitGeneration(
    grpc::ServerContext* context,
    const hsdp::v1::AwaitGenerationRequest* request,
    hsdp::v1::AwaitGenerationResponse* response) {
  return Serve(*context, [&]() -> absl::Status {
    HSDP_RETURN_IF_ERROR(core_.membership->CheckJobId(request->job_id()));
    HSDP_ASSIGN_OR_RETURN(
        AwaitResult result,
        core_.membership->AwaitGeneration(
            request->worker_id(), request->generation(),
            LongPollDeadline(*context, service_.max_long_poll)));
    response->set_outcome(result.outcome);
    *response->mutable_generation() = std::move(result.generation);
    response->set_worker_state(result.worker_state);
    response->set_message(std::move(result.message));
    RefreshMembershipMetrics(core_);
    return absl::OkStatus();
  });
}

grpc::Status CoordinatorServiceImpl::ReportFailure(
    grpc::ServerContext* context, const hsdp::v1::ReportFailureRequest* request,
    hsdp::v1::ReportFailureResponse* response) {
  return Serve(*context, [&]() -> absl::Status {
    HSDP_RETURN_IF_ERROR(core_.membership->CheckJobId(request->job_id()));
    if (request->fatal()) {
      HSDP_ASSIGN_OR_RETURN(
          const bool failed,
          core_.membership->FailJob(request->worker_id(), request->step(),
                                    request->detail()));
      response->set_ended(failed);
      return absl::OkStatus();
    }
    HSDP_ASSIGN_OR_RETURN(bool ended,
                          core_.membership->ReportFailure(
                              request->worker_id(), request->generation(),
                              request->step(), request->detail()));
    response->set_ended(ended);
    return absl::OkStatus();
  });
}

grpc::Status CoordinatorServiceImpl::CommitStep(
    grpc::ServerContext* context, const hsdp::v1::CommitStepRequest* request,
    hsdp::v1::CommitStepResponse* response) {
  return Serve(*context, [&]() -> absl::Status {
    HSDP_RETURN_IF_ERROR(core_.membership->CheckJobId(request->job_id()));
    core_.metrics->RecordVote(/*streamed=*/false);
    HSDP_ASSIGN_OR_RETURN(
        CommitResult result,
        core_.membership->CommitStep(
            request->worker_id(), request->generation(), request->step(),
            LongPollDeadline(*context, service_.max_long_poll)));
    response->set_step(result.step);
    response->set_reform_after(result.reform_after);
    return absl::OkStatus();
  });
}

grpc::Status CoordinatorServiceImpl::GetSchedule(
    grpc::ServerContext* context, const hsdp::v1::GetScheduleRequest* request,
    hsdp::v1::GetScheduleResponse* response) {
  const absl::Time start = absl::Now();
  grpc::Status status = Serve(*context, [&]() -> absl::Status {
    HSDP_RETURN_IF_ERROR(core_.membership->CheckJobId(request->job_id()));
    // Clients with worker ids name their generation; the others (rank only)
    // read the current one's.
    HSDP_ASSIGN_OR_RETURN(
        MemberContext member,
        core_.membership->ResolveMember(
            request->worker_id(), request->rank(),
            request->worker_id() != 0
                ? std::optional<int64_t>(request->generation())
                : std::nullopt));
    HSDP_ASSIGN_OR_RETURN(
        ScheduleRead read,
        core_.schedule_log->GetSchedule(
            request->step(), member.generation,
            LongPollDeadline(*context, service_.max_long_poll)));
    if (read.drained) {
      response->set_drained(true);
      return absl::OkStatus();
    }
    // The sealed message is immutable; its copy serializes to the sealed bytes.
    *response->mutable_schedule() = read.sealed->schedule;
    return absl::OkStatus();
  });
  core_.metrics->ObserveScheduleLatency(
      absl::ToDoubleSeconds(absl::Now() - start));
  if (status.ok())
    core_.metrics->SetSealedStep(core_.schedule_log->sealed_step());
  return status;
}

grpc::ServerWriteReactor<grpc::ByteBuffer>*
CoordinatorServiceImpl::WatchSchedules(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* raw_request) {
  // A stream has no Serve(): the same checks, in the same order.
  absl::Status checked = job_auth_.Check(*context);
  hsdp::v1::WatchSchedulesRequest request;
  if (checked.ok()) {
    grpc::ByteBuffer bytes(*raw_request);  // shares the slices
    if (!grpc::SerializationTraits<
             hsdp::v1::WatchSchedulesRequest>::Deserialize(&bytes, &request)
             .ok()) {
      checked = absl::InvalidArgumentError(
          "WatchSchedulesRequest: not a valid message");
    }
  }
  if (checked.ok()) checked = core_.membership->CheckJobId(request.job_id());
  // A StatusOr may not hold an OK status: start from an error that the
  // lookup below replaces.
  absl::StatusOr<MemberContext> member = absl::UnknownError("not resolved");
  if (checked.ok()) {
    member = core_.membership->ResolveMember(
        request.worker_id(), request.rank(),
        request.worker_id() != 0 ? std::optional<int64_t>(request.generation())
                                 : std::nullopt);
    checked = member.status();
  }
  if (checked.ok() && service_.schedule_feed == nullptr) {
    checked = absl::UnimplementedError("this coordinator pushes no schedules");
  }
  if (!checked.ok()) return RefuseWatch(ToGrpcStatus(checked));
  return service_.schedule_feed->Subscribe(request, member->generation);
}

absl::Status CoordinatorServiceImpl::RecordReport(
    const hsdp::v1::ReportStepRequest& request) {
  HSDP_RETURN_IF_ERROR(core_.membership->CheckJobId(request.job_id()));
  hsdp::v1::StepReport report = request.report();
  // A report is as good as a heartbeat (and checks the worker is known and
  // not lost).
  HSDP_ASSIGN_OR_RETURN(HeartbeatResult beat,
                        core_.membership->Heartbeat(
                            report.worker_id(), report.rank(), report.step()));
  report.set_worker_id(beat.worker_id);
  // Only the current generation's steps move its read-ahead window; a late
  // report of an ended one still shows in ListWorkers and the metrics.
  if (beat.rank >= 0 && (request.report().worker_id() == 0 ||
                         report.generation() == beat.generation)) {
    report.set_rank(beat.rank);
    HSDP_RETURN_IF_ERROR(core_.schedule_log->RecordReport(report));
  }
  if (report.trace_size() > 0) {
    // Spans go to the trace collector only: the report book and the
    // metrics keep per-step numbers.
    if (core_.traces != nullptr && beat.rank >= 0) {
      report.set_rank(beat.rank);
      core_.traces->Record(report);
    }
    report.clear_trace();
  }
  core_.metrics->RecordReport(report);
  const int rank = report.rank();
  core_.reports->Record(std::move(report));  // the last use: no copy
  if (request.finished()) {
    HSDP_RETURN_IF_ERROR(core_.membership->MarkFinished(beat.worker_id, rank));
    RefreshMembershipMetrics(core_);
  }
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* CoordinatorServiceImpl::ReportStep(
    grpc::CallbackServerContext* context,
    const hsdp::v1::ReportStepRequest* request,
    hsdp::v1::ReportStepResponse* /*response*/) {
  return ServeInline(context, [&]() { return RecordReport(*request); });
}

grpc::ServerReadReactor<hsdp::v1::StreamReportsRequest>*
CoordinatorServiceImpl::StreamReports(
    grpc::CallbackServerContext* context,
    hsdp::v1::StreamReportsResponse* /*response*/) {
  return ReadReports(context, job_auth_.Check(*context),
                     [this](const hsdp::v1::StreamReportsRequest& message) {
                       CallTracker::Scope in_flight(service_.calls);
                       return RecordStreamed(message);
                     });
}

absl::Status CoordinatorServiceImpl::RecordStreamed(
    const hsdp::v1::StreamReportsRequest& message) {
  // One worker's part: its report, the end of its stream to a relay, then
  // its vote (not counted after a report that failed, as the worker's next
  // call would not be either).
  auto record_one = [this](const hsdp::v1::StreamReportsRequest& one) {
    if (one.has_report()) HSDP_RETURN_IF_ERROR(RecordReport(one.report()));
    if (one.has_stream_lost()) {
      const hsdp::v1::ScheduleStreamLost& lost = one.stream_lost();
      HSDP_RETURN_IF_ERROR(core_.membership->CheckJobId(lost.job_id()));
      core_.membership->ScheduleStreamLost(lost.worker_id(), lost.generation());
    }
    if (one.has_vote()) return RecordVote(one.vote());
    return absl::OkStatus();
  };
  absl::Status first = record_one(message);
  if (message.relayed_size() > 0) {
    core_.metrics->RecordRelayed(message.relayed_size());
  }
  // A relay's batch holds several workers: one worker's error must not drop
  // the others' reports and votes, so every part is recorded before the
  // stream ends with the first error.
  for (const hsdp::v1::StreamReportsRequest& relayed : message.relayed()) {
    absl::Status s =
        relayed.relayed_size() > 0
            ? absl::InvalidArgumentError(
                  "StreamReportsRequest.relayed: a relayed message carries no "
                  "relayed messages of its own")
            : record_one(relayed);
    if (first.ok()) first = std::move(s);
  }
  return first;
}

absl::Status CoordinatorServiceImpl::RecordVote(
    const hsdp::v1::CommitStepRequest& vote) {
  absl::Status counted = core_.membership->CheckJobId(vote.job_id());
  if (counted.ok()) {
    core_.metrics->RecordVote(/*streamed=*/true);
    // The answer, now or once the last vote comes, is the feed's to send.
    counted =
        core_.membership->Vote(vote.worker_id(), vote.generation(), vote.step())
            .status();
  }
  if (!counted.ok() && service_.schedule_feed != nullptr) {
    // The voter waits for the commit on its schedule stream: end it, so the
    // voter asks CommitStep, which answers with this error.
    service_.schedule_feed->EndStreamOf(vote.worker_id(), vote.generation(),
                                        ToGrpcStatus(counted));
  }
  return counted;
}

grpc::Status CoordinatorServiceImpl::ReportStep(
    grpc::ServerContext* context, const hsdp::v1::ReportStepRequest* request,
    hsdp::v1::ReportStepResponse* /*response*/) {
  return Serve(*context, [&]() { return RecordReport(*request); });
}

absl::Status CoordinatorServiceImpl::CheckStoreScope(absl::string_view job_id,
                                                     int64_t generation) const {
  HSDP_RETURN_IF_ERROR(core_.membership->CheckJobId(job_id));
  const int64_t current = core_.membership->generation();
  const hsdp::v1::JobState state = core_.membership->job_state();
  if (generation != current || state == hsdp::v1::JOB_STATE_REFORMING ||
      state == hsdp::v1::JOB_STATE_FAILED) {
    return absl::AbortedError(absl::StrCat(
        "generation ", generation, " is not the current, running generation (",
        current, ", ", hsdp::v1::JobState_Name(state),
        "): abort the communicators and re-form"));
  }
  return absl::OkStatus();
}

grpc::Status CoordinatorServiceImpl::StoreSet(
    grpc::ServerContext* context, const hsdp::v1::StoreSetRequest* request,
    hsdp::v1::StoreSetResponse* /*response*/) {
  return Serve(*context, [&]() -> absl::Status {
    HSDP_RETURN_IF_ERROR(
        CheckStoreScope(request->job_id(), request->generation()));
    return core_.kv_store->Set(request->job_id(), request->generation(),
                               request->key(), request->value());
  });
}

namespace {

// The store wait: the request's timeout, but never past the call's own (capped)
// deadline.
absl::Duration StoreTimeout(const grpc::ServerContext& context,
                            absl::Duration max_wait, int32_t timeout_ms) {
  const absl::Duration call_left =
      LongPollDeadline(context, max_wait) - absl::Now();
  return std::min(absl::Milliseconds(timeout_ms), call_left);
}

}  // namespace

grpc::Status CoordinatorServiceImpl::StoreGet(
    grpc::ServerContext* context, const hsdp::v1::StoreGetRequest* request,
    hsdp::v1::StoreGetResponse* response) {
  return Serve(*context, [&]() -> absl::Status {
    HSDP_RETURN_IF_ERROR(
        CheckStoreScope(request->job_id(), request->generation()));
    HSDP_ASSIGN_OR_RETURN(
        std::string value,
        core_.kv_store->Get(request->job_id(), request->generation(),
                            request->key(),
                            StoreTimeout(*context, service_.max_long_poll,
                                         request->timeout_ms())));
    response->set_value(std::move(value));
    return absl::OkStatus();
  });
}

grpc::Status CoordinatorServiceImpl::StoreWait(
    grpc::ServerContext* context, const hsdp::v1::StoreWaitRequest* request,
    hsdp::v1::StoreWaitResponse* /*response*/) {
  return Serve(*context, [&]() -> absl::Status {
    HSDP_RETURN_IF_ERROR(
        CheckStoreScope(request->job_id(), request->generation()));
    const std::vector<std::string> keys(request->keys().begin(),
                                        request->keys().end());
    return core_.kv_store->Wait(
        request->job_id(), request->generation(), keys,
        StoreTimeout(*context, service_.max_long_poll, request->timeout_ms()));
  });
}

void CoordinatorServiceImpl::Tick() {
  const std::vector<int64_t> lost = core_.membership->Tick();
  if (!lost.empty()) {
    std::cerr << "hsdp-coordinator: lost " << lost.size()
              << " worker(s) (first: worker " << lost.front() << ")\n";
  }
  RefreshMembershipMetrics(core_);
}

}  // namespace hsdp::coordinator
