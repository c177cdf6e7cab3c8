#include "coordinator/control_service.h"

#include <google/protobuf/unknown_field_set.h>
#include <grpcpp/server_context.h>

#include <algorithm>
#include <iostream>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/mesh.h"
#include "common/status_util.h"
#include "coordinator/grpc_status.h"

namespace hsdp::coordinator {
namespace {

constexpr char kAuthorizationHeader[] = "authorization";

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
  response->set_job_id(m.job_id());
  response->set_state(m.job_state());
  response->set_world_size(m.world_size());
  *response->mutable_mesh() = MeshToProto(m.mesh());
  response->set_workers_alive(m.workers_alive());
  response->set_generation(m.generation());
  response->set_sealed_step(log.sealed_step());
  response->set_policy_version(log.CurrentPolicy().version);
  response->set_last_checkpoint_step(log.last_checkpoint_step());
  response->set_drain_step(log.drain_step());
  response->set_model(m.model());
  response->set_unit_count(static_cast<int32_t>(m.units().size()));
  response->set_dashboard_url(core.dashboard_url);
}

void FillWorkers(const CoordinatorCore& core,
                 hsdp::v1::ListWorkersResponse* response) {
  for (const WorkerSnapshot& w : core.membership->Workers()) {
    hsdp::v1::WorkerInfo* info = response->add_workers();
    info->set_rank(w.rank);
    info->set_state(w.state);
    info->set_hostname(w.hostname);
    info->set_device(w.device);
    info->set_replicate_index(w.coord.replicate_index);
    info->set_shard_index(w.coord.shard_index);
    info->set_heartbeat_age_ms(absl::ToInt64Milliseconds(w.heartbeat_age));
    hsdp::v1::StepReport report;
    if (core.reports->Latest(w.rank, &report))
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
                                       std::string control_token)
    : core_(core), token_(control_token) {}

absl::Status ControlServiceImpl::Authenticate(
    const grpc::ServerContext& context) const {
  const auto& metadata = context.client_metadata();
  auto it = metadata.find(kAuthorizationHeader);
  if (it == metadata.end()) return token_.Check(std::nullopt);
  return token_.Check(absl::string_view(it->second.data(), it->second.size()));
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
    HSDP_ASSIGN_OR_RETURN(std::shared_ptr<const SealedSchedule> sealed,
                          core_.schedule_log->GetSealed(request->step()));
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
