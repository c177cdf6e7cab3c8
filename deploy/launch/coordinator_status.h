// The coordinator's status as hsdp-launch reads it: GetStatus over gRPC, with
// the control token when the job has one.
#ifndef HSDP_DEPLOY_LAUNCH_COORDINATOR_STATUS_H_
#define HSDP_DEPLOY_LAUNCH_COORDINATOR_STATUS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "hsdp/v1/control_service.grpc.pb.h"

namespace hsdp::launch {

// Thread-compatible: the launcher's main loop only.
class StatusClient {
 public:
  StatusClient(const std::string& address, std::string token);

  // One GetStatus call, bounded by a short deadline.
  absl::StatusOr<hsdp::v1::GetStatusResponse> Get();

 private:
  std::unique_ptr<hsdp::v1::ControlService::Stub> stub_;
  const std::string token_;
};

// The file's contents without surrounding whitespace, or "" when it cannot be
// read.
std::string ReadToken(const std::string& path);

// The job's mesh as "RxS".
std::string MeshOf(const hsdp::v1::GetStatusResponse& status);

}  // namespace hsdp::launch

#endif  // HSDP_DEPLOY_LAUNCH_COORDINATOR_STATUS_H_
