#include "coordinator/control_service.h"

#include <google/protobuf/unknown_field_set.h>
#include <grpcpp/server_context.h>

#include <algorithm>
#include <iostream>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/mesh.h"
#include "common/status_util.h"
#include "coordinator/grpc_status.h"

namespace hsdp::coordinator {
namespace {

absl::Status UnknownFieldsError(const google::protobuf::Message& message,
                                absl::string_view path) {
  const google::protobuf::UnknownFieldSet& fields =
      message.GetReflection()->GetUnknownFields(message);
  if (fields.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(path, ": unknown field number ", fields.field(0).number(),
                   " (client newer than this coordinator?)"));
}

}  // namespace

absl::Status CheckNoUnknownFields(const hsdp::v1::Policy& policy) {
  HSDP_RETURN_IF_ERROR(UnknownFieldsError(policy, "policy"));
  for (int i = 0; i < policy.overrides_size(); ++i) {
    HSDP_RETURN_IF_ERROR(UnknownFieldsError(
        policy.overrides(i), absl::StrCat("policy.overrides[", i, "]")));
  }
  return absl::OkStatus();
}

void FillStatus(const CoordinatorCore& core,
                hsdp::v1::GetStatusResponse* response) {
  const Membership& m = *core.membership;
  const ScheduleLog& log = *core.schedule_log;
  const MembershipStatus elastic = m.Status();
  response->set_job_id(m.job_id());
  response->set_state(elastic.job_state);
  response->set_world_size(m.world_size());
  *response->mutable_mesh() = MeshToProto(m.mesh());
  response->set_workers_alive(elastic.members_alive);
  response->set_generation(elastic.generation);
  response->set_message(elastic.message);
  response->set_last_committed_step(elastic.last_committed_step);
  response->set_replicas(elastic.replicas);
  response->set_min_replicas(m.options().min_replicas);
  response->set_workers_standby(elastic.standby);
  response->set_workers_joining(elastic.joining);
  response->set_failures(elastic.failures);
  if (elastic.last_failure.has_value()) {
    *response->mutable_last_failure() = *elastic.last_failure;
  }
  response->set_sealed_step(log.sealed_step());
  response->set_policy_version(log.CurrentPolicy().version);
  response->set_last_checkpoint_step(log.last_checkpoint_step());
  response->set_drain_step(log.drain_step());
  response->set_model(m.model());
  response->set_unit_count(static_cast<int32_t>(m.units().size()));
  if (auto training = m.training()) *response->mutable_training() = *training;
  response->set_dashboard_url(core.dashboard_url);
  for (const std::string& warning : elastic.topology_warnings) {
    response->add_topology_warnings(warning);
  }
}

void FillWorkers(const CoordinatorCore& core,
                 hsdp::v1::ListWorkersResponse* response) {
  for (const WorkerSnapshot& w : core.membership->Workers()) {
    hsdp::v1::WorkerInfo* info = response->add_workers();
    info->set_worker_id(w.worker_id);
    info->set_rank(w.rank);
    info->set_state(w.state);
    info->set_hostname(w.hostname);
    info->set_device(w.device);
    info->set_replicate_index(w.rank >= 0 ? w.coord.replicate_index : -1);
    info->set_shard_index(w.rank >= 0 ? w.coord.shard_index : -1);
    info->set_heartbeat_age_ms(absl::ToInt64Milliseconds(w.heartbeat_age));
    info->set_generation(w.generation);
    info->set_role(w.role);
    for (const auto& event : w.history) *info->add_history() = event;
    hsdp::v1::StepReport report;
    if (core.reports->Latest(w.worker_id, &report))
      *info->mutable_last_report() = report;
  }
}

void FillPolicy(const CoordinatorCore& core,
                hsdp::v1::GetPolicyResponse* response) {
  PolicyInfo current = core.schedule_log->CurrentPolicy();
  *response->mutable_policy() = std::move(current.policy);
  response->set_policy_version(current.version);
  response->set_effective_step(current.effective_step);
}

absl::StatusOr<PolicyInfo> ApplyPolicy(const CoordinatorCore& core,
                                       const hsdp::v1::Policy& policy) {
  HSDP_RETURN_IF_ERROR(CheckNoUnknownFields(policy));
  HSDP_ASSIGN_OR_RETURN(PolicyInfo applied,
                        core.schedule_log->SetPolicy(policy));
  core.metrics->SetPolicyVersion(applied.version);
  std::cerr << "hsdp-coordinator: policy version " << applied.version
            << " applies from step " << applied.effective_step << "\n";
  return applied;
}

ControlServiceImpl::ControlServiceImpl(CoordinatorCore core,
                                       const std::string& control_token)
    : core_(core), auth_(control_token, "control token") {}

absl::Status ControlServiceImpl::Authenticate(
    const grpc::ServerContext& context) const {
  return auth_.Check(context);
}

grpc::Status ControlServiceImpl::GetStatus(
    grpc::ServerContext* context, const hsdp::v1::GetStatusRequest* /*request*/,
    hsdp::v1::GetStatusResponse* response) {
  return ServeTracked(core_.calls, [&]() -> absl::Status {
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
  return ServeTracked(core_.calls, [&]() -> absl::Status {
    // First, so an unauthenticated call reads or changes nothing.
    HSDP_RETURN_IF_ERROR(Authenticate(*context));
    FillWorkers(core_, response);
    return absl::OkStatus();
  });
}

grpc::Status ControlServiceImpl::GetPolicy(
    grpc::ServerContext* context, const hsdp::v1::GetPolicyRequest* /*request*/,
    hsdp::v1::GetPolicyResponse* response) {
  return ServeTracked(core_.calls, [&]() -> absl::Status {
    // First, so an unauthenticated call reads or changes nothing.
    HSDP_RETURN_IF_ERROR(Authenticate(*context));
    FillPolicy(core_, response);
    return absl::OkStatus();
  });
}

grpc::Status ControlServiceImpl::SetPolicy(
    grpc::ServerContext* context, const hsdp::v1::SetPolicyRequest* request,
    hsdp::v1::SetPolicyResponse* response) {
  return ServeTracked(core_.calls, [&]() -> absl::Status {
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
  return ServeTracked(core_.calls, [&]() -> absl::Status {
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
  return ServeTracked(core_.calls, [&]() -> absl::Status {
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
  return ServeTracked(core_.calls, [&]() -> absl::Status {
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

absl::StatusOr<TraceCollector*> CollectorOf(const CoordinatorCore& core) {
  // Every hsdp-coordinator has one; only cores assembled without it (tests,
  // benchmarks) answer this.
  if (core.traces == nullptr) {
    return absl::UnimplementedError("this coordinator collects no traces");
  }
  return core.traces;
}

absl::StatusOr<RenderedTrace> RenderTrace(const CoordinatorCore& core,
                                          int64_t first_step,
                                          int64_t last_step) {
  HSDP_ASSIGN_OR_RETURN(TraceCollector * traces, CollectorOf(core));
  // A step's ranks: the world size it was sealed for (0 until sealed).
  auto expected = [&core](int64_t step) -> int {
    absl::StatusOr<std::shared_ptr<const SealedSchedule>> sealed =
        core.schedule_log->GetSealed(step);
    if (!sealed.ok() || !(*sealed)->schedule.trace()) return 0;
    return std::max(1, (*sealed)->schedule.world_size());
  };
  return traces->Render(first_step, last_step, expected);
}

grpc::Status ControlServiceImpl::GetTrace(
    grpc::ServerContext* context, const hsdp::v1::GetTraceRequest* request,
    hsdp::v1::GetTraceResponse* response) {
  return ServeTracked(core_.calls, [&]() -> absl::Status {
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
  return ServeTracked(core_.calls, [&]() -> absl::Status {
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
  return ServeTracked(core_.calls, [&]() -> absl::Status {
    // First, so an unauthenticated call reads or changes nothing.
    HSDP_RETURN_IF_ERROR(Authenticate(*context));
    HSDP_ASSIGN_OR_RETURN(int64_t last_step, core_.schedule_log->Drain());
    response->set_last_step(last_step);
    core_.membership->SetDraining(true);
    return absl::OkStatus();
  });
}

}  // namespace hsdp::coordinator
