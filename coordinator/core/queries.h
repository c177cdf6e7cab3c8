// The queries and changes every front end shares (the control service, the
// dashboard), so that both read and change the job the same way: the bodies
// of GetStatus, ListWorkers, GetPolicy, SetPolicy and GetTrace. The caller
// authenticates first. Thread-safe like the core's components.
#ifndef HSDP_COORDINATOR_CORE_QUERIES_H_
#define HSDP_COORDINATOR_CORE_QUERIES_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "coordinator/core/coordinator_core.h"
#include "coordinator/core/schedule_log.h"
#include "coordinator/core/trace_collector.h"
#include "hsdp/v1/control_service.pb.h"
#include "hsdp/v1/policy.pb.h"

namespace hsdp::coordinator {

// Rejects a policy carrying fields this coordinator does not know (a newer
// client's fields would otherwise be dropped silently): INVALID_ARGUMENT naming
// the field number.
absl::Status CheckNoUnknownFields(const hsdp::v1::Policy& policy);

void FillStatus(const CoordinatorCore& core,
                hsdp::v1::GetStatusResponse* response);
void FillWorkers(const CoordinatorCore& core,
                 hsdp::v1::ListWorkersResponse* response);
void FillPolicy(const CoordinatorCore& core,
                hsdp::v1::GetPolicyResponse* response);
// Checks `policy` for unknown fields, validates it and applies it from the
// first unsealed step (ScheduleLog::SetPolicy). Any error leaves the policy
// unchanged.
absl::StatusOr<PolicyInfo> ApplyPolicy(const CoordinatorCore& core,
                                       const hsdp::v1::Policy& policy);

// The core's trace collector; UNIMPLEMENTED when the core has none.
absl::StatusOr<TraceCollector*> CollectorOf(const CoordinatorCore& core);

// Steps first..last of the collected traces as Chrome trace JSON, each step
// expecting the ranks it was sealed for (GetTrace's body). UNIMPLEMENTED when
// the coordinator collects no traces.
absl::StatusOr<RenderedTrace> RenderTrace(const CoordinatorCore& core,
                                          int64_t first_step,
                                          int64_t last_step);

}  // namespace hsdp::coordinator

#endif  // HSDP_COORDINATOR_CORE_QUERIES_H_
