// Helpers shared by the coordinator service tests: a model's unit list, join
// requests, RPC contexts with deadlines and tokens, and a fixture-friendly
// in-process server.
#ifndef HSDP_TESTS_COORDINATOR_SERVICE_TEST_UTIL_H_
#define HSDP_TESTS_COORDINATOR_SERVICE_TEST_UTIL_H_

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "hsdp/v1/control_service.grpc.pb.h"
#include "hsdp/v1/coordinator_service.grpc.pb.h"

namespace hsdp::testing {

inline constexpr char kModel[] = "gpt-test";

// "root" then "layers.0" .. "layers.{n-1}", as the contract names them.
inline void AddUnits(int layers, hsdp::v1::JoinRequest* request) {
  auto add = [&](const std::string& name, int64_t params) {
    hsdp::v1::UnitInfo* u = request->add_units();
    u->set_name(name);
    u->set_param_count(params);
    u->set_param_bytes(params * 4);
  };
  add("root", 1000);
  for (int i = 0; i < layers; ++i) add(absl::StrCat("layers.", i), 400);
}

inline hsdp::v1::JoinRequest MakeJoin(const std::string& job_id, int layers,
                                      int rank_hint) {
  hsdp::v1::JoinRequest request;
  request.set_job_id(job_id);
  if (rank_hint >= 0) request.set_rank_hint(rank_hint);
  request.set_hostname(absl::StrCat("host-", rank_hint));
  request.set_device("cpu");
  request.set_model(kModel);
  AddUnits(layers, &request);
  return request;
}

// A client context with a deadline and, when `token` is non-empty, the control
// token.
inline std::unique_ptr<grpc::ClientContext> Ctx(
    std::chrono::milliseconds timeout = std::chrono::seconds(30),
    const std::string& token = "") {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(std::chrono::system_clock::now() + timeout);
  if (!token.empty()) context->AddMetadata("authorization", "Bearer " + token);
  return context;
}

inline std::shared_ptr<grpc::Channel> Connect(const std::string& address) {
  return grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
}

// Join; a failed call fails the test and returns an empty response.
inline hsdp::v1::JoinResponse JoinOrFail(
    hsdp::v1::CoordinatorService::Stub& worker,
    const hsdp::v1::JoinRequest& request) {
  hsdp::v1::JoinResponse response;
  grpc::Status s = worker.Join(Ctx().get(), request, &response);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return response;
}

// GetStatus with the control token `token` (empty: none); a failed call fails
// the test and returns an empty response.
inline hsdp::v1::GetStatusResponse GetStatusOrFail(
    hsdp::v1::ControlService::Stub& control, const std::string& token,
    std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  hsdp::v1::GetStatusResponse response;
  grpc::Status s = control.GetStatus(Ctx(timeout, token).get(), {}, &response);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return response;
}

}  // namespace hsdp::testing

#endif  // HSDP_TESTS_COORDINATOR_SERVICE_TEST_UTIL_H_
