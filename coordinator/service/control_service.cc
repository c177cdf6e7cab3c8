#include "coordinator/service/control_service.h"

#include <grpcpp/server_context.h>

#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "common/status_util.h"
#include "coordinator/core/core_events.h"
#include "coordinator/core/membership.h"
#include "coordinator/core/queries.h"
#include "coordinator/core/schedule_log.h"

namespace hsdp::coordinator {

ControlServiceImpl::ControlServiceImpl(CoordinatorCore core,
                                       ServiceContext service,
                                       const std::string& control_token)
    : core_(core), service_(service), auth_(control_token, "control token") {}

absl::Status ControlServiceImpl::Authenticate(
    const grpc::ServerContext& context) const {
  return auth_.Check(context);
}

grpc::Status ControlServiceImpl::GetStatus(
    grpc::ServerContext* context, const hsdp::v1::GetStatusRequest* /*request*/,
    hsdp::v1::GetStatusResponse* response) {
  return ServeTracked(service_.calls, [&]() -> absl::Status {
    // First, so an unauthenticated call reads or changes nothing.
    HSDP_RETURN_IF_ERROR(Authenticate(*context));
    FillStatus(core_, response);
    return absl::OkStatus();
  });
}

grpc::Status ControlServiceImpl::ListWorkers(
    grpc::ServerContext* context,
    const hsdp::v1::ListWorkersRequest* /*request*/,
    hsdp::v1::ListWorkersResponse* response) {
  return ServeTracked(service_.calls, [&]() -> absl::Status {
    // First, so an unauthenticated call reads or changes nothing.
    HSDP_RETURN_IF_ERROR(Authenticate(*context));
    FillWorkers(core_, response);
    return absl::OkStatus();
  });
}

grpc::Status ControlServiceImpl::GetPolicy(
    grpc::ServerContext* context, const hsdp::v1::GetPolicyRequest* /*request*/,
    hsdp::v1::GetPolicyResponse* response) {
  return ServeTracked(service_.calls, [&]() -> absl::Status {
    // First, so an unauthenticated call reads or changes nothing.
    HSDP_RETURN_IF_ERROR(Authenticate(*context));
    FillPolicy(core_, response);
    return absl::OkStatus();
  });
}

grpc::Status ControlServiceImpl::SetPolicy(
    grpc::ServerContext* context, const hsdp::v1::SetPolicyRequest* request,
    hsdp::v1::SetPolicyResponse* response) {
  return ServeTracked(service_.calls, [&]() -> absl::Status {
    // First, so an unauthenticated call reads or changes nothing.
    HSDP_RETURN_IF_ERROR(Authenticate(*context));
    if (!request->has_policy())
      return absl::InvalidArgumentError("policy: missing");
    HSDP_ASSIGN_OR_RETURN(PolicyInfo applied,
                          ApplyPolicy(core_, request->policy()));
    response->set_policy_version(applied.version);
    response->set_effective_step(applied.effective_step);
    return absl::OkStatus();
  });
}

grpc::Status ControlServiceImpl::GetSchedule(
    grpc::ServerContext* context,
    const hsdp::v1::ControlServiceGetScheduleRequest* request,
    hsdp::v1::ControlServiceGetScheduleResponse* response) {
  return ServeTracked(service_.calls, [&]() -> absl::Status {
    // First, so an unauthenticated call reads or changes nothing.
    HSDP_RETURN_IF_ERROR(Authenticate(*context));
    HSDP_ASSIGN_OR_RETURN(
        std::shared_ptr<const SealedSchedule> sealed,
        core_.schedule_log->GetSealed(
            request->step(), request->has_generation()
                                 ? std::optional<int64_t>(request->generation())
                                 : std::nullopt));
    *response->mutable_schedule() = sealed->schedule;
    return absl::OkStatus();
  });
}

grpc::Status ControlServiceImpl::RequestCheckpoint(
    grpc::ServerContext* context,
    const hsdp::v1::RequestCheckpointRequest* /*request*/,
    hsdp::v1::RequestCheckpointResponse* response) {
  return ServeTracked(service_.calls, [&]() -> absl::Status {
    // First, so an unauthenticated call reads or changes nothing.
    HSDP_RETURN_IF_ERROR(Authenticate(*context));
    HSDP_ASSIGN_OR_RETURN(int64_t step,
                          core_.schedule_log->RequestCheckpoint());
    response->set_step(step);
    return absl::OkStatus();
  });
}

grpc::Status ControlServiceImpl::StartTrace(
    grpc::ServerContext* context, const hsdp::v1::StartTraceRequest* request,
    hsdp::v1::StartTraceResponse* response) {
  return ServeTracked(service_.calls, [&]() -> absl::Status {
    HSDP_RETURN_IF_ERROR(Authenticate(*context));
    HSDP_RETURN_IF_ERROR(CollectorOf(core_).status());
    HSDP_ASSIGN_OR_RETURN(
        auto range, core_.schedule_log->RequestTrace(request->first_step(),
                                                     request->last_step()));
    response->set_first_step(range.first);
    response->set_last_step(range.second);
    return absl::OkStatus();
  });
}

grpc::Status ControlServiceImpl::GetTrace(
    grpc::ServerContext* context, const hsdp::v1::GetTraceRequest* request,
    hsdp::v1::GetTraceResponse* response) {
  return ServeTracked(service_.calls, [&]() -> absl::Status {
    HSDP_RETURN_IF_ERROR(Authenticate(*context));
    HSDP_ASSIGN_OR_RETURN(
        RenderedTrace trace,
        RenderTrace(core_, request->first_step(), request->last_step()));
    response->set_complete(trace.complete);
    response->set_chrome_trace_json(std::move(trace.chrome_json));
    response->set_rank_steps_reported(trace.rank_steps_reported);
    response->set_rank_steps_expected(trace.rank_steps_expected);
    response->set_max_clock_error_nanos(trace.max_clock_error_nanos);
    return absl::OkStatus();
  });
}

grpc::Status ControlServiceImpl::EvictWorker(
    grpc::ServerContext* context, const hsdp::v1::EvictWorkerRequest* request,
    hsdp::v1::EvictWorkerResponse* response) {
  return ServeTracked(service_.calls, [&]() -> absl::Status {
    // First, so an unauthenticated call reads or changes nothing.
    HSDP_RETURN_IF_ERROR(Authenticate(*context));
    std::optional<int> rank;
    std::optional<int64_t> worker_id;
    switch (request->target_case()) {
      case hsdp::v1::EvictWorkerRequest::kRank:
        rank = request->rank();
        break;
      case hsdp::v1::EvictWorkerRequest::kWorkerId:
        worker_id = request->worker_id();
        break;
      default:
        return absl::InvalidArgumentError("target: set rank or worker_id");
    }
    HSDP_ASSIGN_OR_RETURN(EvictResult evicted,
                          core_.membership->Evict(rank, worker_id));
    response->set_worker_id(evicted.worker_id);
    response->set_generation(evicted.generation);
    std::cerr << "hsdp-coordinator: worker " << evicted.worker_id
              << " evicted by an operator\n";
    RefreshMembershipMetrics(core_);
    return absl::OkStatus();
  });
}

grpc::Status ControlServiceImpl::Drain(
    grpc::ServerContext* context, const hsdp::v1::DrainRequest* /*request*/,
    hsdp::v1::DrainResponse* response) {
  return ServeTracked(service_.calls, [&]() -> absl::Status {
    // First, so an unauthenticated call reads or changes nothing.
    HSDP_RETURN_IF_ERROR(Authenticate(*context));
    HSDP_ASSIGN_OR_RETURN(int64_t last_step, core_.schedule_log->Drain());
    response->set_last_step(last_step);
    core_.membership->SetDraining(true);
    return absl::OkStatus();
  });
}

}  // namespace hsdp::coordinator
