// The worker API's defences, over real gRPC on loopback: the job token on every
// CoordinatorService method, mutual TLS, the rendezvous store's limits, and
// regressions of defects found by using the coordinator (draining state after
// a restart, the state directory lock, empty store keys).
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/core/kv_store.h"
#include "coordinator/core/membership.h"
#include "coordinator/server.h"
#include "google/protobuf/descriptor.h"
#include "hsdp/v1/control_service.grpc.pb.h"
#include "hsdp/v1/coordinator_service.grpc.pb.h"
#include "tests/common/test_certs.h"
#include "tests/coordinator/service_test_util.h"

namespace hsdp::coordinator {
namespace {

using ::hsdp::testing::Connect;
using ::hsdp::testing::Ctx;
using ::hsdp::testing::MakeJoin;
using ::hsdp::v1::ControlService;
using ::hsdp::v1::CoordinatorService;
using std::chrono::milliseconds;
using std::chrono::seconds;

constexpr char kJob[] = "job-hard";
constexpr char kJobToken[] = "job-token-0123456789";
constexpr char kControlToken[] = "control-token-abcdef";
constexpr int kLayers = 4;

std::string FreshDir(const std::string& name) {
  const ::testing::TestInfo* info =
      ::testing::UnitTest::GetInstance()->current_test_info();
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) /
      absl::StrCat("hsdp_hard_", info->name(), "_", name, "_", ::getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

JobConfig Job(int world, const std::string& state_dir = "") {
  JobConfig job;
  job.job_id = kJob;
  job.world_size = world;
  job.mesh = MeshShape{1, world};
  job.state_dir = state_dir;
  job.heartbeat_timeout = absl::Seconds(30);
  return job;
}

ServerOptions Options() {
  ServerOptions options;
  options.listen = "127.0.0.1:0";
  options.sync_state = false;
  options.control_token = kControlToken;
  options.job_token = kJobToken;
  return options;
}

// Calls `method` of CoordinatorService with a serialized `request` through a
// generic stub, so a test can reach every method the descriptor lists.
grpc::Status CallGeneric(grpc::Channel* channel, const std::string& method,
                         const std::string& request, const std::string& token) {
  grpc::Slice slice(request);
  grpc::ByteBuffer request_buffer(&slice, 1), response_buffer;
  grpc::GenericStub stub(channel->shared_from_this());
  std::unique_ptr<grpc::ClientContext> context = Ctx(seconds(10), token);
  absl::Mutex mu;
  bool finished = false;
  grpc::Status status;
  stub.UnaryCall(context.get(), method, grpc::StubOptions(), &request_buffer,
                 &response_buffer, [&](grpc::Status s) {
                   absl::MutexLock lock(&mu);
                   status = s;
                   finished = true;
                 });
  absl::MutexLock lock(&mu);
  mu.Await(absl::Condition(&finished));
  return status;
}

class HardeningTest : public ::testing::Test {
 protected:
  void Start(int world, ServerOptions options = Options(),
             const std::string& state_dir = "") {
    auto server = CoordinatorServer::Start(Job(world, state_dir), options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    channel_ = Connect(server_->address());
    worker_ = CoordinatorService::NewStub(channel_);
    control_ = ControlService::NewStub(channel_);
  }

  std::unique_ptr<grpc::ClientContext> WorkerCtx(
      const std::string& token = kJobToken) {
    return Ctx(seconds(30), token);
  }

  // What an operator can observe (heartbeat ages aside) plus the sealed step:
  // equal before and after a refused call proves it changed nothing.
  std::string Snapshot() {
    hsdp::v1::GetStatusResponse status;
    EXPECT_TRUE(
        control_->GetStatus(Ctx(seconds(30), kControlToken).get(), {}, &status)
            .ok());
    hsdp::v1::ListWorkersResponse workers;
    EXPECT_TRUE(
        control_
            ->ListWorkers(Ctx(seconds(30), kControlToken).get(), {}, &workers)
            .ok());
    for (auto& w : *workers.mutable_workers()) w.clear_heartbeat_age_ms();
    std::string steps;
    for (const WorkerSnapshot& w : server_->membership().Workers()) {
      absl::StrAppend(&steps, w.rank, ":", w.step, ";");
    }
    return absl::StrCat(status.SerializeAsString(), "|",
                        workers.SerializeAsString(), "|", steps, "|",
                        server_->schedule_log().sealed_step());
  }

  grpc::Status StoreGet(const std::string& key, int timeout_ms,
                        std::string* value = nullptr) {
    hsdp::v1::StoreGetRequest request;
    request.set_job_id(kJob);
    request.set_generation(0);
    request.set_key(key);
    request.set_timeout_ms(timeout_ms);
    hsdp::v1::StoreGetResponse response;
    grpc::Status s = worker_->StoreGet(WorkerCtx().get(), request, &response);
    if (value != nullptr) *value = response.value();
    return s;
  }

  std::unique_ptr<CoordinatorServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<CoordinatorService::Stub> worker_;
  std::unique_ptr<ControlService::Stub> control_;
};

// --- The job token.

// Walks the service descriptor, so an RPC added later is covered without a new
// test: a handler that skips the token check fails here.
TEST_F(HardeningTest, EveryWorkerMethodRefusesCallsWithoutTheJobToken) {
  Start(2);
  const google::protobuf::ServiceDescriptor* service =
      google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(
          CoordinatorService::service_full_name());
  ASSERT_NE(service, nullptr);
  ASSERT_GE(service->method_count(), 7);
  const std::string before = Snapshot();
  for (int i = 0; i < service->method_count(); ++i) {
    const google::protobuf::MethodDescriptor* method = service->method(i);
    SCOPED_TRACE(method->full_name());
    const std::string path =
        absl::StrCat("/", service->full_name(), "/", method->name());
    // A request that would otherwise reach the handler's own checks.
    hsdp::v1::JoinRequest join = MakeJoin(kJob, kLayers, 0);
    const std::string request =
        method->name() == "Join" ? join.SerializeAsString() : "";

    grpc::Status none = CallGeneric(channel_.get(), path, request, "");
    EXPECT_EQ(none.error_code(), grpc::StatusCode::UNAUTHENTICATED)
        << none.error_message();
    EXPECT_NE(none.error_message().find("missing"), std::string::npos)
        << none.error_message();
    grpc::Status wrong =
        CallGeneric(channel_.get(), path, request, "job-token-0123456788");
    EXPECT_EQ(wrong.error_code(), grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_NE(wrong.error_message().find("invalid job token"),
              std::string::npos)
        << wrong.error_message();
    // The operator's token is not a worker's.
    grpc::Status control =
        CallGeneric(channel_.get(), path, request, kControlToken);
    EXPECT_EQ(control.error_code(), grpc::StatusCode::UNAUTHENTICATED);
    // The right token gets past authentication (the empty requests then fail
    // the handler's own checks, which is not UNAUTHENTICATED).
    if (method->name() != "Join") {
      grpc::Status right = CallGeneric(channel_.get(), path, "", kJobToken);
      EXPECT_NE(right.error_code(), grpc::StatusCode::UNAUTHENTICATED)
          << right.error_message();
    }
  }
  EXPECT_EQ(Snapshot(), before);
  EXPECT_TRUE(server_->membership().Workers().empty());
}

TEST_F(HardeningTest, RefusedWorkerCallsChangeNothing) {
  Start(2);
  hsdp::v1::JoinResponse joined;
  ASSERT_TRUE(
      worker_->Join(WorkerCtx().get(), MakeJoin(kJob, kLayers, 0), &joined)
          .ok());
  const std::string before = Snapshot();

  for (const std::string token : {"", "wrong", kControlToken}) {
    SCOPED_TRACE(absl::StrCat("token '", token, "'"));
    hsdp::v1::JoinResponse join_response;
    EXPECT_EQ(worker_
                  ->Join(WorkerCtx(token).get(), MakeJoin(kJob, kLayers, 1),
                         &join_response)
                  .error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
    hsdp::v1::HeartbeatRequest beat;
    beat.set_job_id(kJob);
    beat.set_rank(0);
    beat.set_step(7);
    hsdp::v1::HeartbeatResponse beat_response;
    EXPECT_EQ(worker_->Heartbeat(WorkerCtx(token).get(), beat, &beat_response)
                  .error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
    hsdp::v1::GetScheduleRequest fetch;
    fetch.set_job_id(kJob);
    fetch.set_rank(0);
    fetch.set_step(0);
    hsdp::v1::GetScheduleResponse schedule;
    EXPECT_EQ(worker_->GetSchedule(WorkerCtx(token).get(), fetch, &schedule)
                  .error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
    hsdp::v1::ReportStepRequest report;
    report.set_job_id(kJob);
    report.mutable_report()->set_rank(0);
    report.mutable_report()->set_step(0);
    report.mutable_report()->set_loss(1.5);
    report.set_finished(true);
    hsdp::v1::ReportStepResponse report_response;
    EXPECT_EQ(
        worker_->ReportStep(WorkerCtx(token).get(), report, &report_response)
            .error_code(),
        grpc::StatusCode::UNAUTHENTICATED);
    hsdp::v1::StoreSetRequest set;
    set.set_job_id(kJob);
    set.set_generation(0);
    set.set_key("intruder");
    set.set_value("x");
    hsdp::v1::StoreSetResponse set_response;
    EXPECT_EQ(worker_->StoreSet(WorkerCtx(token).get(), set, &set_response)
                  .error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  EXPECT_EQ(Snapshot(), before);
  EXPECT_EQ(server_->schedule_log().sealed_step(), -1);
  EXPECT_EQ(StoreGet("intruder", 0).error_code(),
            grpc::StatusCode::DEADLINE_EXCEEDED);
}

TEST_F(HardeningTest, NoJobTokenConfiguredLeavesTheWorkerApiOpen) {
  ServerOptions options = Options();
  options.job_token.clear();
  Start(1, options);
  hsdp::v1::JoinResponse joined;
  EXPECT_TRUE(
      worker_->Join(Ctx().get(), MakeJoin(kJob, kLayers, 0), &joined).ok());
}

// --- The store's limits through the service.

TEST_F(HardeningTest, OversizedStoreValueIsRefusedAndStoresNothing) {
  Start(1);
  hsdp::v1::JoinResponse joined;
  ASSERT_TRUE(
      worker_->Join(WorkerCtx().get(), MakeJoin(kJob, kLayers, 0), &joined)
          .ok());
  hsdp::v1::StoreSetRequest set;
  set.set_job_id(kJob);
  set.set_generation(joined.generation());
  set.set_key("big");
  set.set_value(std::string(kMaxKvValueBytes + 1, 'v'));
  hsdp::v1::StoreSetResponse response;
  grpc::Status s = worker_->StoreSet(WorkerCtx().get(), set, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find(absl::StrCat("limit is ", kMaxKvValueBytes,
                                                " bytes per value")),
            std::string::npos)
      << s.error_message();
  EXPECT_EQ(StoreGet("big", 0).error_code(),
            grpc::StatusCode::DEADLINE_EXCEEDED);
  // Past gRPC's own message limit the transport refuses it.
  set.set_value(std::string(3 * kMaxKvValueBytes, 'v'));
  EXPECT_EQ(worker_->StoreSet(WorkerCtx().get(), set, &response).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(StoreGet("big", 0).error_code(),
            grpc::StatusCode::DEADLINE_EXCEEDED);
}

// Regression: StoreSet refused an empty key with INVALID_ARGUMENT, but StoreGet
// of an empty key waited out its whole timeout.
TEST_F(HardeningTest, StoreGetAndWaitOfAnEmptyKeyAreInvalidAtOnce) {
  Start(1);
  hsdp::v1::JoinResponse joined;
  ASSERT_TRUE(
      worker_->Join(WorkerCtx().get(), MakeJoin(kJob, kLayers, 0), &joined)
          .ok());
  const auto start = std::chrono::steady_clock::now();
  grpc::Status get = StoreGet("", 20'000);
  EXPECT_EQ(get.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(get.error_message().find("empty"), std::string::npos);
  hsdp::v1::StoreWaitRequest wait;
  wait.set_job_id(kJob);
  wait.set_generation(0);
  wait.add_keys("a");
  wait.add_keys("");
  wait.set_timeout_ms(20'000);
  hsdp::v1::StoreWaitResponse wait_response;
  EXPECT_EQ(
      worker_->StoreWait(WorkerCtx().get(), wait, &wait_response).error_code(),
      grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_LT(std::chrono::steady_clock::now() - start, seconds(5));
}

// --- State across restarts.

// Regression: after a restart a draining job reported RUNNING in GetStatus and
// in heartbeat replies although its drain step survived.
TEST_F(HardeningTest, DrainingSurvivesARestart) {
  const std::string dir = FreshDir("state");
  Start(1, Options(), dir);
  hsdp::v1::JoinResponse joined;
  ASSERT_TRUE(
      worker_->Join(WorkerCtx().get(), MakeJoin(kJob, kLayers, 0), &joined)
          .ok());
  hsdp::v1::DrainResponse drained;
  ASSERT_TRUE(
      control_->Drain(Ctx(seconds(30), kControlToken).get(), {}, &drained)
          .ok());
  server_.reset();

  Start(1, Options(), dir);
  hsdp::v1::GetStatusResponse status;
  ASSERT_TRUE(
      control_->GetStatus(Ctx(seconds(30), kControlToken).get(), {}, &status)
          .ok());
  EXPECT_EQ(status.state(), hsdp::v1::JOB_STATE_DRAINING);
  EXPECT_EQ(status.drain_step(), drained.last_step());
  hsdp::v1::HeartbeatRequest beat;
  beat.set_job_id(kJob);
  beat.set_rank(0);
  hsdp::v1::HeartbeatResponse reply;
  ASSERT_TRUE(worker_->Heartbeat(WorkerCtx().get(), beat, &reply).ok());
  EXPECT_EQ(reply.job_state(), hsdp::v1::JOB_STATE_DRAINING);
}

// Regression: nothing locked --state-dir, so a second coordinator started on a
// directory in use.
TEST_F(HardeningTest, SecondCoordinatorOnAStateDirectoryInUseIsRefused) {
  const std::string dir = FreshDir("state");
  Start(1, Options(), dir);
  auto second = CoordinatorServer::Start(Job(1, dir), Options());
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(second.status().message().find("in use by another coordinator"),
            std::string::npos)
      << second.status();
  // The first one still serves.
  hsdp::v1::JoinResponse joined;
  EXPECT_TRUE(
      worker_->Join(WorkerCtx().get(), MakeJoin(kJob, kLayers, 0), &joined)
          .ok());
  server_.reset();
  EXPECT_TRUE(CoordinatorServer::Start(Job(1, dir), Options()).ok());
}

// --- Mutual TLS.

class MutualTlsTest : public HardeningTest {
 protected:
  void SetUp() override {
    auto certs = hsdp::testing::MakeTestCerts(FreshDir("certs"));
    ASSERT_TRUE(certs.ok()) << certs.status();
    certs_ = *std::move(certs);
    ServerOptions options = Options();
    options.tls_cert_pem = certs_.server_cert;
    options.tls_key_pem = certs_.server_key;
    options.tls_client_ca_pem = certs_.ca;
    auto server = CoordinatorServer::Start(Job(1), options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }

  grpc::Status JoinWith(const std::string& cert, const std::string& key) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = certs_.ca;
    ssl.pem_cert_chain = cert;
    ssl.pem_private_key = key;
    auto channel =
        grpc::CreateChannel(server_->address(), grpc::SslCredentials(ssl));
    hsdp::v1::JoinResponse joined;
    return CoordinatorService::NewStub(channel)->Join(
        Ctx(seconds(10), kJobToken).get(), MakeJoin(kJob, kLayers, 0), &joined);
  }

  hsdp::testing::TestCerts certs_;
};

TEST_F(MutualTlsTest, OnlyClientsWithACertificateFromTheCaGetIn) {
  grpc::Status none = JoinWith("", "");
  EXPECT_EQ(none.error_code(), grpc::StatusCode::UNAVAILABLE)
      << none.error_message();
  grpc::Status rogue = JoinWith(certs_.rogue_cert, certs_.rogue_key);
  EXPECT_EQ(rogue.error_code(), grpc::StatusCode::UNAVAILABLE)
      << rogue.error_message();
  auto plaintext = CoordinatorService::NewStub(Connect(server_->address()));
  hsdp::v1::JoinResponse joined;
  EXPECT_FALSE(plaintext
                   ->Join(Ctx(seconds(10), kJobToken).get(),
                          MakeJoin(kJob, kLayers, 0), &joined)
                   .ok());
  EXPECT_TRUE(server_->membership().Workers().empty());

  grpc::Status trusted = JoinWith(certs_.client_cert, certs_.client_key);
  EXPECT_TRUE(trusted.ok()) << trusted.error_message();
  EXPECT_EQ(server_->membership().Workers().size(), 1u);
}

TEST(ServerTlsOptionsTest, ClientCaWithoutServerCertificateIsInvalid) {
  ServerOptions options = Options();
  options.tls_client_ca_pem = "-----BEGIN CERTIFICATE-----";
  auto server = CoordinatorServer::Start(Job(1), options);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(server.status().message().find("client CA"), std::string::npos);
}

}  // namespace
}  // namespace hsdp::coordinator
