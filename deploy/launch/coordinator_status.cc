#include "deploy/launch/coordinator_status.h"

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <fstream>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "coordinator/service/grpc_status.h"

namespace hsdp::launch {
namespace {

// How long one status read may take.
constexpr auto kStatusTimeout = std::chrono::seconds(2);

}  // namespace

StatusClient::StatusClient(const std::string& address, std::string token)
    : stub_(hsdp::v1::ControlService::NewStub(
          grpc::CreateChannel(address, grpc::InsecureChannelCredentials()))),
      token_(std::move(token)) {}

absl::StatusOr<hsdp::v1::GetStatusResponse> StatusClient::Get() {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + kStatusTimeout);
  if (!token_.empty()) {
    context.AddMetadata("authorization", absl::StrCat("Bearer ", token_));
  }
  hsdp::v1::GetStatusResponse response;
  absl::Status status = hsdp::coordinator::FromGrpcStatus(
      stub_->GetStatus(&context, hsdp::v1::GetStatusRequest(), &response));
  if (!status.ok()) return status;
  return response;
}

std::string ReadToken(const std::string& path) {
  std::ifstream in(path);
  std::string token;
  in >> token;
  return token;
}

std::string MeshOf(const hsdp::v1::GetStatusResponse& status) {
  return absl::StrCat(status.replicas(), "x", status.mesh().shard());
}

}  // namespace hsdp::launch
