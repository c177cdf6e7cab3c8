#include "coordinator/core/queries.h"

#include <google/protobuf/unknown_field_set.h>

#include <algorithm>
#include <iostream>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/mesh_proto.h"
#include "common/status_util.h"
#include "coordinator/core/membership.h"
#include "coordinator/core/metrics.h"
#include "coordinator/core/report_book.h"
#include "coordinator/core/schedule_log.h"
#include "hsdp/mesh.h"

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

}  // namespace hsdp::coordinator
