// The dashboard served by a whole in-process coordinator: its page, its JSON
// API, the policy form's endpoint (the token, and that a change lands exactly
// as ControlService.SetPolicy's), and the URL GetStatus and hsdpctl report.
#include "coordinator/service/dashboard.h"

#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <memory>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "coordinator/ctl/hsdpctl.h"
#include "coordinator/server.h"
#include "coordinator/service/dashboard.pb.h"
#include "coordinator/service/web/web_assets.h"
#include "hsdp/v1/control_service.grpc.pb.h"
#include "hsdp/v1/coordinator_service.grpc.pb.h"
#include "tests/coordinator/http_test_client.h"
#include "tests/coordinator/service_test_util.h"

namespace hsdp::coordinator {
namespace {

using ::hsdp::testing::Connect;
using ::hsdp::testing::Ctx;
using ::hsdp::testing::HttpRequestTo;
using ::hsdp::testing::HttpResult;
using ::hsdp::testing::MakeJoin;
using ::hsdp::v1::ControlService;
using ::hsdp::v1::CoordinatorService;

constexpr char kJob[] = "job-dash";
constexpr char kToken[] = "dash-token";
constexpr int kLayers = 3;
constexpr int kWorld = 2;

class DashboardTest : public ::testing::Test {
 protected:
  void SetUp() override {
    JobConfig job;
    job.job_id = kJob;
    job.world_size = kWorld;
    job.mesh = MeshShape{1, kWorld};
    ServerOptions options;
    options.listen = "127.0.0.1:0";
    options.metrics_listen = "127.0.0.1:0";
    options.control_token = kToken;
    options.sync_state = false;
    auto server = CoordinatorServer::Start(job, options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    port_ = server_->metrics_port();
    ASSERT_GT(port_, 0);
    auto channel = Connect(server_->address());
    worker_ = CoordinatorService::NewStub(channel);
    control_ = ControlService::NewStub(channel);
  }

  void JoinAll() {
    for (int r = 0; r < kWorld; ++r) {
      hsdp::v1::JoinResponse joined;
      ASSERT_TRUE(
          worker_->Join(Ctx().get(), MakeJoin(kJob, kLayers, r), &joined).ok());
    }
  }

  // Seals `step` (as rank 0's fetch does) and returns its schedule.
  hsdp::v1::StepSchedule Seal(int64_t step) {
    hsdp::v1::GetScheduleRequest request;
    request.set_job_id(kJob);
    request.set_step(step);
    hsdp::v1::GetScheduleResponse response;
    grpc::Status s = worker_->GetSchedule(Ctx().get(), request, &response);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return response.schedule();
  }

  void ReportStep(int rank, int64_t step, double loss) {
    hsdp::v1::ReportStepRequest request;
    request.set_job_id(kJob);
    hsdp::v1::StepReport* report = request.mutable_report();
    report->set_rank(rank);
    report->set_step(step);
    report->set_loss(loss);
    report->set_step_seconds(0.1 * (rank + 1));
    report->set_tokens_per_second(1000);
    report->set_peak_memory_bytes(4096);
    for (int u = 0; u <= kLayers; ++u) {
      hsdp::v1::UnitCommTime* t = report->add_unit_comm();
      t->set_unit_index(u);
      t->set_all_gather_seconds(0.001 * (u + 1) * (rank + 1));
      t->set_reduce_scatter_seconds(0.002);
    }
    hsdp::v1::ReportStepResponse ignored;
    ASSERT_TRUE(worker_->ReportStep(Ctx().get(), request, &ignored).ok());
  }

  dashboard::DashboardState State(const std::string& query = "") {
    HttpResult r = HttpRequestTo(port_, "GET", "/api/state" + query);
    EXPECT_EQ(r.status, 200) << r.raw;
    EXPECT_EQ(r.headers["content-type"], "application/json");
    dashboard::DashboardState state;
    auto parsed = google::protobuf::util::JsonStringToMessage(r.body, &state);
    EXPECT_TRUE(parsed.ok()) << parsed << r.body;
    return state;
  }

  HttpResult PostPolicy(const std::string& body,
                        const std::string& authorization) {
    std::map<std::string, std::string> headers = {
        {"Content-Type", "application/json"}};
    if (!authorization.empty()) headers["Authorization"] = authorization;
    return HttpRequestTo(port_, "POST", "/api/policy", headers, body);
  }

  hsdp::v1::GetPolicyResponse GrpcPolicy() {
    hsdp::v1::GetPolicyResponse policy;
    EXPECT_TRUE(control_
                    ->GetPolicy(Ctx(std::chrono::seconds(30), kToken).get(), {},
                                &policy)
                    .ok());
    return policy;
  }

  std::unique_ptr<CoordinatorServer> server_;
  int port_ = 0;
  std::unique_ptr<CoordinatorService::Stub> worker_;
  std::unique_ptr<ControlService::Stub> control_;
};

TEST_F(DashboardTest, ThePageLoadsOnlyItsOwnFiles) {
  HttpResult page = HttpRequestTo(port_, "GET", "/");
  ASSERT_EQ(page.status, 200) << page.raw;
  EXPECT_EQ(page.headers["content-type"], "text/html; charset=utf-8");
  EXPECT_TRUE(absl::StartsWith(page.headers["content-security-policy"],
                               "default-src 'self'"))
      << page.raw;
  // Every src/href of the page is a path on this server, and answers.
  std::regex ref(R"re((?:src|href)="([^"]*)")re");
  int refs = 0;
  for (std::sregex_iterator it(page.body.begin(), page.body.end(), ref), end;
       it != end; ++it, ++refs) {
    const std::string target = (*it)[1];
    ASSERT_TRUE(absl::StartsWith(target, "/")) << target;
    ASSERT_FALSE(absl::StartsWith(target, "//")) << target;
    EXPECT_EQ(HttpRequestTo(port_, "GET", target).status, 200) << target;
  }
  EXPECT_GE(refs, 3);  // the script, the style sheet, /metrics
  // No file fetches from elsewhere: the only absolute URL is SVG's namespace
  // name, which is never fetched.
  std::regex url(R"re(https?://[^'"\s)]*)re");
  for (const WebAsset& asset : WebAssets()) {
    const std::string body(asset.body);
    for (std::sregex_iterator it(body.begin(), body.end(), url), end; it != end;
         ++it) {
      EXPECT_EQ(it->str(), "http://www.w3.org/2000/svg") << asset.path;
    }
  }
}

TEST_F(DashboardTest, StateShowsWorkersStepsUnitsAndPolicy) {
  JoinAll();
  for (int64_t step = 0; step < 3; ++step) {
    Seal(step);
    ReportStep(0, step, 4.0 - step);
    ReportStep(1, step, 6.0 - step);
  }
  dashboard::DashboardState state = State();
  EXPECT_EQ(state.status().job_id(), kJob);
  EXPECT_EQ(state.status().state(), hsdp::v1::JOB_STATE_RUNNING);
  EXPECT_EQ(state.status().dashboard_url(), server_->dashboard_url());
  EXPECT_EQ(server_->dashboard_url(),
            absl::StrCat("http://127.0.0.1:", port_, "/"));
  ASSERT_EQ(state.workers_size(), kWorld);
  EXPECT_EQ(state.workers(1).hostname(), "host-1");
  EXPECT_EQ(state.workers(1).last_report().step(), 2);

  ASSERT_EQ(state.history_size(), 3);
  EXPECT_EQ(state.history(0).step(), 0);
  EXPECT_DOUBLE_EQ(state.history(0).loss(), 5.0);  // mean of 4 and 6
  EXPECT_DOUBLE_EQ(state.history(2).loss(), 3.0);
  EXPECT_DOUBLE_EQ(state.history(2).step_seconds(), 0.2);  // slowest rank
  EXPECT_EQ(state.history(2).ranks(), kWorld);
  EXPECT_GT(state.history_capacity(), 0);

  // The units: "root" then layers; memory from the joins, comm means over
  // both ranks' latest reports.
  ASSERT_EQ(state.units_size(), kLayers + 1);
  EXPECT_EQ(state.units(0).name(), "root");
  EXPECT_EQ(state.units(0).param_bytes(), 4000);
  EXPECT_EQ(state.units(0).shard_bytes(), 2000);
  EXPECT_TRUE(state.units(1).reshard_after_forward());
  EXPECT_EQ(state.units(1).comm_reports(), kWorld);
  EXPECT_DOUBLE_EQ(state.units(1).all_gather_seconds(), (0.002 + 0.004) / 2);
  EXPECT_DOUBLE_EQ(state.units(1).reduce_scatter_seconds(), 0.002);

  EXPECT_EQ(state.policy().policy_version(), 1);
  EXPECT_TRUE(absl::StrContains(state.policy_text(), "reshard_after_forward"))
      << state.policy_text();
  ASSERT_EQ(state.policy_history_size(), 1);
  EXPECT_TRUE(state.token_required());

  // ?since=N: only later steps.
  dashboard::DashboardState later = State("?since=1");
  ASSERT_EQ(later.history_size(), 1);
  EXPECT_EQ(later.history(0).step(), 2);
  HttpResult bad = HttpRequestTo(port_, "GET", "/api/state?since=soon");
  EXPECT_EQ(bad.status, 400) << bad.raw;
  EXPECT_TRUE(absl::StrContains(bad.body, "since")) << bad.body;
}

TEST_F(DashboardTest, APolicyChangeNeedsTheToken) {
  JoinAll();
  Seal(0);
  const std::string before = GrpcPolicy().SerializeAsString();
  const std::string change = R"({"reshard_after_forward": false})";
  for (const std::string& authorization :
       {std::string(), std::string("Bearer wrong-token"), std::string(kToken),
        absl::StrCat("Bearer ", kToken, "x")}) {
    HttpResult r = PostPolicy(change, authorization);
    EXPECT_EQ(r.status, 401) << authorization << ": " << r.raw;
    EXPECT_EQ(r.headers["www-authenticate"], "Bearer");
    EXPECT_TRUE(absl::StrContains(r.body, "\"code\":\"UNAUTHENTICATED\""))
        << r.body;
  }
  EXPECT_EQ(GrpcPolicy().SerializeAsString(), before);
  EXPECT_EQ(State().policy_history_size(), 1);
}

TEST_F(DashboardTest, APolicyChangeLandsAsSetPolicyDoes) {
  JoinAll();
  for (int64_t step = 0; step < 3; ++step) Seal(step);
  HttpResult r = PostPolicy(
      R"({"reshard_after_forward": true, "forward_prefetch_depth": 2,
          "overrides": [{"unit_glob": "layers.*", "reshard_after_forward": false}]})",
      absl::StrCat("Bearer ", kToken));
  ASSERT_EQ(r.status, 200) << r.raw;
  hsdp::v1::SetPolicyResponse applied;
  ASSERT_TRUE(
      google::protobuf::util::JsonStringToMessage(r.body, &applied).ok())
      << r.body;
  EXPECT_EQ(applied.policy_version(), 2);
  EXPECT_EQ(applied.effective_step(), 3);  // the first unsealed step

  hsdp::v1::GetPolicyResponse now = GrpcPolicy();
  EXPECT_EQ(now.policy_version(), 2);
  EXPECT_EQ(now.effective_step(), 3);
  EXPECT_EQ(now.policy().forward_prefetch_depth(), 2);
  ASSERT_EQ(now.policy().overrides_size(), 1);

  // Sealed steps keep their schedule; the next one is planned from v2.
  hsdp::v1::ControlServiceGetScheduleRequest get;
  get.set_step(2);
  hsdp::v1::ControlServiceGetScheduleResponse sealed;
  ASSERT_TRUE(control_
                  ->GetSchedule(Ctx(std::chrono::seconds(30), kToken).get(),
                                get, &sealed)
                  .ok());
  EXPECT_EQ(sealed.schedule().policy_version(), 1);
  EXPECT_TRUE(sealed.schedule().units(1).reshard_after_forward());
  const hsdp::v1::StepSchedule next = Seal(3);
  EXPECT_EQ(next.policy_version(), 2);
  // The root is never resharded after forward (FSDP2's root rule).
  EXPECT_FALSE(next.units(0).reshard_after_forward());
  EXPECT_FALSE(next.units(1).reshard_after_forward());  // layers.0

  // The page's view follows: units from the latest sealed step, a mark at the
  // change.
  dashboard::DashboardState state = State();
  EXPECT_FALSE(state.units(1).reshard_after_forward());
  ASSERT_EQ(state.policy_history_size(), 2);
  EXPECT_EQ(state.policy_history(1).effective_step(), 3);
}

TEST_F(DashboardTest, ABadPolicyIsRefusedByNameAndChangesNothing) {
  JoinAll();
  Seal(0);
  const std::string before = GrpcPolicy().SerializeAsString();
  const std::string auth = absl::StrCat("Bearer ", kToken);
  struct Case {
    std::string body;
    std::string message;
  };
  const std::vector<Case> cases = {
      {R"({"forward_prefetch_depth": -1})",
       "policy.forward_prefetch_depth: -1 is negative"},
      {R"({"forward_prefetch": 2})", "forward_prefetch"},
      {R"({"overrides": [{"unit_glob": "blocks.*",
                          "reshard_after_forward": false}]})",
       "blocks.*"},
      {"{not json", ""},
      {"  \n", "empty request body"},
  };
  for (const Case& c : cases) {
    HttpResult r = PostPolicy(c.body, auth);
    EXPECT_EQ(r.status, 400) << c.body << ": " << r.raw;
    EXPECT_TRUE(absl::StrContains(r.body, "\"code\":\"INVALID_ARGUMENT\""))
        << r.body;
    EXPECT_TRUE(absl::StrContains(r.body, c.message)) << r.body;
  }
  EXPECT_EQ(GrpcPolicy().SerializeAsString(), before);
}

TEST_F(DashboardTest, GetStatusAndHsdpctlShowTheUrl) {
  hsdp::v1::GetStatusResponse status;
  ASSERT_TRUE(
      control_
          ->GetStatus(Ctx(std::chrono::seconds(30), kToken).get(), {}, &status)
          .ok());
  EXPECT_EQ(status.dashboard_url(), server_->dashboard_url());

  const std::string token_file = ::testing::TempDir() + "/dashboard_test_token";
  {
    std::ofstream out(token_file);
    out << kToken << "\n";
  }
  std::vector<std::string> args = {"hsdpctl",          "--coordinator",
                                   server_->address(), "--token-file",
                                   token_file,         "status"};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  std::ostringstream out, err;
  ASSERT_EQ(hsdp::ctl::RunHsdpctl(static_cast<int>(argv.size()), argv.data(),
                                  out, err),
            0)
      << err.str();
  EXPECT_TRUE(absl::StrContains(
      out.str(), absl::StrCat("dashboard        ", server_->dashboard_url())))
      << out.str();
}

// A one-rank coordinator with these serving options (loopback gRPC).
std::unique_ptr<CoordinatorServer> StartOneRank(ServerOptions options) {
  JobConfig job;
  job.job_id = kJob;
  job.world_size = 1;
  job.mesh = MeshShape{1, 1};
  options.listen = "127.0.0.1:0";
  options.sync_state = false;
  auto server = CoordinatorServer::Start(job, options);
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? *std::move(server) : nullptr;
}

TEST_F(DashboardTest, TheTimelineServesTheNewestTracedStepsAsHsdpctlWould) {
  JoinAll();
  HttpResult none = HttpRequestTo(port_, "GET", "/api/trace");
  EXPECT_EQ(none.status, 404) << none.raw;
  EXPECT_NE(none.body.find("hsdpctl trace"), std::string::npos) << none.body;

  hsdp::v1::StartTraceRequest start;
  start.set_first_step(0);
  start.set_last_step(1);
  hsdp::v1::StartTraceResponse started;
  ASSERT_TRUE(control_
                  ->StartTrace(Ctx(std::chrono::seconds(30), kToken).get(),
                               start, &started)
                  .ok());
  for (int64_t step = 0; step <= 1; ++step) {
    ASSERT_TRUE(Seal(step).trace());
    for (int r = 0; r < kWorld; ++r) {
      hsdp::v1::ReportStepRequest request;
      request.set_job_id(kJob);
      hsdp::v1::StepReport* report = request.mutable_report();
      report->set_rank(r);
      report->set_step(step);
      hsdp::v1::TraceSpan* span = report->add_trace();
      span->set_name("forward");
      span->set_unit("layers.0");
      span->set_track(hsdp::v1::TRACE_TRACK_COMPUTE);
      span->set_begin_unix_nanos(1'000'000'000 + step * 1'000'000);
      span->set_end_unix_nanos(1'000'500'000 + step * 1'000'000);
      hsdp::v1::ReportStepResponse ignored;
      ASSERT_TRUE(worker_->ReportStep(Ctx().get(), request, &ignored).ok());
    }
  }

  HttpResult newest = HttpRequestTo(port_, "GET", "/api/trace");
  ASSERT_EQ(newest.status, 200) << newest.raw;
  EXPECT_EQ(newest.headers["content-type"], "application/json");
  // The same document GetTrace (hsdpctl trace) returns for those steps.
  hsdp::v1::GetTraceRequest request;
  request.set_first_step(0);
  request.set_last_step(1);
  hsdp::v1::GetTraceResponse grpc_trace;
  ASSERT_TRUE(control_
                  ->GetTrace(Ctx(std::chrono::seconds(30), kToken).get(),
                             request, &grpc_trace)
                  .ok());
  EXPECT_TRUE(grpc_trace.complete());
  EXPECT_EQ(newest.body, grpc_trace.chrome_trace_json());

  HttpResult one = HttpRequestTo(port_, "GET", "/api/trace?first=1&last=1");
  ASSERT_EQ(one.status, 200) << one.raw;
  EXPECT_NE(one.body.find("\"first_step\":1,\"last_step\":1"),
            std::string::npos)
      << one.body;

  HttpResult bad = HttpRequestTo(port_, "GET", "/api/trace?first=x&last=1");
  EXPECT_EQ(bad.status, 400) << bad.raw;
  EXPECT_NE(bad.body.find("first, last"), std::string::npos) << bad.body;
  HttpResult too_long =
      HttpRequestTo(port_, "GET", "/api/trace?first=0&last=1000");
  EXPECT_EQ(too_long.status, 400) << too_long.raw;
}

TEST(DashboardOffTest, NoMetricsAddressServesNoDashboard) {
  std::unique_ptr<CoordinatorServer> server = StartOneRank({});
  ASSERT_NE(server, nullptr);
  EXPECT_EQ(server->metrics_port(), 0);
  EXPECT_EQ(server->dashboard_url(), "");
}

TEST(DashboardOffTest, AnOverrideUrlIsReportedAsGiven) {
  ServerOptions options;
  options.metrics_listen = "127.0.0.1:0";
  options.dashboard_url = "https://hsdp.example/jobs/dash/";
  std::unique_ptr<CoordinatorServer> server = StartOneRank(options);
  ASSERT_NE(server, nullptr);
  EXPECT_EQ(server->dashboard_url(), "https://hsdp.example/jobs/dash/");
}

}  // namespace
}  // namespace hsdp::coordinator
