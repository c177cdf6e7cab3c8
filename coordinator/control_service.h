// ControlService: the operator-facing gRPC API (hsdpctl). When a control token
// is configured every call must carry `authorization: Bearer <token>`; a
// missing or wrong token is UNAUTHENTICATED and the call does nothing.
#ifndef HSDP_COORDINATOR_CONTROL_SERVICE_H_
#define HSDP_COORDINATOR_CONTROL_SERVICE_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "coordinator/bearer_auth.h"
#include "coordinator/coordinator_service.h"
#include "coordinator/trace_collector.h"
#include "hsdp/v1/control_service.grpc.pb.h"

namespace hsdp::coordinator {

// Rejects a policy carrying fields this coordinator does not know (a newer
// client's fields would otherwise be dropped silently): INVALID_ARGUMENT naming
// the field number.
absl::Status CheckNoUnknownFields(const hsdp::v1::Policy& policy);

// The bodies of GetStatus, ListWorkers, GetPolicy and SetPolicy, shared with
// the dashboard so that both read and change the job the same way. The caller
// authenticates first.
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

// Thread-safe: all state lives in the (thread-safe) core components; the token
// is immutable.
class ControlServiceImpl final : public hsdp::v1::ControlService::Service {
 public:
  // An empty `control_token` disables authentication.
  ControlServiceImpl(CoordinatorCore core, const std::string& control_token);
  ControlServiceImpl(const ControlServiceImpl&) = delete;
  ControlServiceImpl& operator=(const ControlServiceImpl&) = delete;

  grpc::Status GetStatus(grpc::ServerContext* context,
                         const hsdp::v1::GetStatusRequest* request,
                         hsdp::v1::GetStatusResponse* response) override;
  grpc::Status ListWorkers(grpc::ServerContext* context,
                           const hsdp::v1::ListWorkersRequest* request,
                           hsdp::v1::ListWorkersResponse* response) override;
  grpc::Status GetPolicy(grpc::ServerContext* context,
                         const hsdp::v1::GetPolicyRequest* request,
                         hsdp::v1::GetPolicyResponse* response) override;
  grpc::Status SetPolicy(grpc::ServerContext* context,
                         const hsdp::v1::SetPolicyRequest* request,
                         hsdp::v1::SetPolicyResponse* response) override;
  grpc::Status GetSchedule(
      grpc::ServerContext* context,
      const hsdp::v1::ControlServiceGetScheduleRequest* request,
      hsdp::v1::ControlServiceGetScheduleResponse* response) override;
  grpc::Status RequestCheckpoint(
      grpc::ServerContext* context,
      const hsdp::v1::RequestCheckpointRequest* request,
      hsdp::v1::RequestCheckpointResponse* response) override;
  grpc::Status Drain(grpc::ServerContext* context,
                     const hsdp::v1::DrainRequest* request,
                     hsdp::v1::DrainResponse* response) override;
  grpc::Status StartTrace(grpc::ServerContext* context,
                          const hsdp::v1::StartTraceRequest* request,
                          hsdp::v1::StartTraceResponse* response) override;
  grpc::Status GetTrace(grpc::ServerContext* context,
                        const hsdp::v1::GetTraceRequest* request,
                        hsdp::v1::GetTraceResponse* response) override;
  grpc::Status EvictWorker(grpc::ServerContext* context,
                           const hsdp::v1::EvictWorkerRequest* request,
                           hsdp::v1::EvictWorkerResponse* response) override;

 private:
  absl::Status Authenticate(const grpc::ServerContext& context) const;

  const CoordinatorCore core_;
  const BearerAuth auth_;
};

}  // namespace hsdp::coordinator

#endif  // HSDP_COORDINATOR_CONTROL_SERVICE_H_
