// ControlService: the operator-facing gRPC API (hsdpctl). When a control token
// is configured every call must carry `authorization: Bearer <token>`; a
// missing or wrong token is UNAUTHENTICATED and the call does nothing.
#ifndef HSDP_COORDINATOR_SERVICE_CONTROL_SERVICE_H_
#define HSDP_COORDINATOR_SERVICE_CONTROL_SERVICE_H_

#include <string>

#include "absl/status/status.h"
#include "coordinator/core/coordinator_core.h"
#include "coordinator/service/bearer_auth.h"
#include "coordinator/service/service_context.h"
#include "hsdp/v1/control_service.grpc.pb.h"

namespace hsdp::coordinator {

// Thread-safe: all state lives in the (thread-safe) core components; the token
// is immutable.
class ControlServiceImpl final : public hsdp::v1::ControlService::Service {
 public:
  // An empty `control_token` disables authentication.
  ControlServiceImpl(CoordinatorCore core, ServiceContext service,
                     const std::string& control_token);
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
  const ServiceContext service_;
  const BearerAuth auth_;
};

}  // namespace hsdp::coordinator

#endif  // HSDP_COORDINATOR_SERVICE_CONTROL_SERVICE_H_
