// hsdpctl's connection to a coordinator's ControlService and the options
// every subcommand shares.
#ifndef HSDP_COORDINATOR_CTL_CONTROL_CLIENT_H_
#define HSDP_COORDINATOR_CTL_CONTROL_CLIENT_H_

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/status_util.h"
#include "coordinator/service/grpc_status.h"
#include "hsdp/v1/control_service.grpc.pb.h"

namespace hsdp::ctl {

using hsdp::v1::ControlService;

inline constexpr char kDefaultCoordinator[] = "localhost:50051";
inline constexpr double kDefaultTimeoutSeconds = 10.0;

// Global options shared by every subcommand.
struct GlobalOptions {
  std::string coordinator = kDefaultCoordinator;
  std::string token_file;
  std::string tls_ca;
  // Mutual TLS: this client's certificate chain and key (PEM files).
  std::string tls_client_cert;
  std::string tls_client_key;
  bool json = false;
  double timeout_seconds = kDefaultTimeoutSeconds;
};

// Talks to one coordinator; every call carries the deadline and, when
// configured, the token. Thread-compatible.
class ControlClient {
 public:
  // Reads the TLS and token files named in `options`: NOT_FOUND naming an
  // unreadable file, INVALID_ARGUMENT for a client certificate without its key
  // (or the reverse) or without --tls-ca.
  static absl::StatusOr<ControlClient> Connect(const GlobalOptions& options);

  // Calls one unary method: `client.Call(&ControlService::Stub::GetStatus,
  // request, &response)`.
  template <typename Method, typename Request, typename Response>
  absl::Status Call(Method method, const Request& request, Response* response) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::milliseconds(
                             static_cast<int64_t>(timeout_seconds_ * 1000)));
    if (!token_.empty())
      context.AddMetadata("authorization", absl::StrCat("Bearer ", token_));
    return hsdp::coordinator::FromGrpcStatus(
        ((*stub_).*method)(&context, request, response));
  }

 private:
  ControlClient(std::unique_ptr<ControlService::Stub> stub, std::string token,
                double timeout)
      : stub_(std::move(stub)),
        token_(std::move(token)),
        timeout_seconds_(timeout) {}

  std::unique_ptr<ControlService::Stub> stub_;
  std::string token_;
  double timeout_seconds_;
};

// The message as JSON (proto field names, enums by name, defaults printed).
std::string ToJson(const google::protobuf::Message& message);

// Calls `method` and prints its response: JSON with --json, else
// `print_human(response)`.
template <typename Request, typename Response, typename PrintHuman>
absl::Status CallAndPrint(ControlClient& client, const GlobalOptions& g,
                          grpc::Status (ControlService::Stub::*method)(
                              grpc::ClientContext*, const Request&, Response*),
                          const Request& request, std::ostream& out,
                          PrintHuman&& print_human) {
  Response response;
  HSDP_RETURN_IF_ERROR(client.Call(method, request, &response));
  if (g.json) {
    out << ToJson(response) << "\n";
  } else {
    print_human(response);
  }
  return absl::OkStatus();
}

}  // namespace hsdp::ctl

#endif  // HSDP_COORDINATOR_CTL_CONTROL_CLIENT_H_
