// The agent's credentials against a real coordinator (in-process, loopback):
// the job token on every call (heartbeats and the rendezvous store included),
// from the options or the environment, and mutual TLS.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/token.h"
#include "coordinator/core/membership.h"
#include "coordinator/server.h"
#include "tests/common/test_certs.h"
#include "worker/agent/agent.h"

namespace hsdp::agent {
namespace {

constexpr char kJob[] = "job-agent-auth";
constexpr char kToken[] = "agent-job-token";

std::string TempPath(const std::string& name) {
  const ::testing::TestInfo* info =
      ::testing::UnitTest::GetInstance()->current_test_info();
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) /
      absl::StrCat("hsdp_agent_auth_", info->name(), "_", ::getpid());
  std::filesystem::create_directories(dir);
  return (dir / name).string();
}

std::unique_ptr<coordinator::CoordinatorServer> StartCoordinator(
    coordinator::ServerOptions options = {}) {
  coordinator::JobConfig job;
  job.job_id = kJob;
  job.world_size = 1;
  job.mesh = MeshShape{1, 1};
  options.listen = "127.0.0.1:0";
  options.sync_state = false;
  options.job_token = kToken;
  auto server = coordinator::CoordinatorServer::Start(job, options);
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? *std::move(server) : nullptr;
}

AgentOptions Options(const std::string& address) {
  AgentOptions o;
  o.coordinator = address;
  o.job_id = kJob;
  o.hostname = "host-0";
  o.model = "gpt-test";
  hsdp::v1::UnitInfo root;
  root.set_name("root");
  root.set_param_count(10);
  root.set_param_bytes(40);
  o.units.push_back(root);
  o.retry_budget = absl::Milliseconds(500);
  o.initial_backoff = absl::Milliseconds(20);
  o.max_backoff = absl::Milliseconds(100);
  return o;
}

// Clears the token variables for the test and restores nothing: tests here
// set what they need.
class AgentAuthTest : public ::testing::Test {
 protected:
  void SetUp() override {
    unsetenv(kJobTokenEnv);
    unsetenv(kJobTokenFileEnv);
  }
  void TearDown() override { SetUp(); }
};

// Every kind of call the worker makes goes through with the token.
void ExerciseEveryCall(Agent& agent) {
  auto joined = agent.Join();
  ASSERT_TRUE(joined.ok()) << joined.status();
  agent.StartHeartbeat();
  ASSERT_TRUE(agent.StoreSet("addr/0", "127.0.0.1:1").ok());
  auto value = agent.StoreGet("addr/0", absl::Seconds(5));
  ASSERT_TRUE(value.ok()) << value.status();
  EXPECT_EQ(*value, "127.0.0.1:1");
  EXPECT_TRUE(agent.StoreWait({"addr/0"}, absl::Seconds(5)).ok());
  auto schedule = agent.GetSchedule(0, 0);
  ASSERT_TRUE(schedule.ok()) << schedule.status();
  hsdp::v1::StepReport report;
  report.set_rank(0);
  report.set_step(0);
  EXPECT_TRUE(agent.ReportStep(report, /*finished=*/false).ok());
  // A few heartbeats: a refused one would flag the membership.
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_TRUE(agent.membership_status().ok()) << agent.membership_status();
}

TEST_F(AgentAuthTest, TokenFromOptionsOpensEveryCall) {
  auto server = StartCoordinator();
  ASSERT_NE(server, nullptr);
  AgentOptions o = Options(server->address());
  o.job_token = kToken;
  Agent agent(o);
  ExerciseEveryCall(agent);
  EXPECT_EQ(server->membership().Workers().size(), 1u);
}

TEST_F(AgentAuthTest, TokenFromTheEnvironment) {
  auto server = StartCoordinator();
  ASSERT_NE(server, nullptr);
  setenv(kJobTokenEnv, kToken, 1);
  Agent agent(Options(server->address()));
  ExerciseEveryCall(agent);
}

TEST_F(AgentAuthTest, TokenFileFromTheEnvironmentWinsOverTheValue) {
  auto server = StartCoordinator();
  ASSERT_NE(server, nullptr);
  const std::string file = TempPath("token");
  std::ofstream(file) << kToken << "\n";
  setenv(kJobTokenFileEnv, file.c_str(), 1);
  setenv(kJobTokenEnv, "not-the-token", 1);
  Agent agent(Options(server->address()));
  ExerciseEveryCall(agent);
}

TEST_F(AgentAuthTest, WrongOrMissingTokenIsUnauthenticatedAtOnce) {
  auto server = StartCoordinator();
  ASSERT_NE(server, nullptr);
  for (const std::string token : {"", "wrong"}) {
    AgentOptions o = Options(server->address());
    o.job_token = token;
    o.retry_budget = absl::Seconds(30);
    Agent agent(o);
    const absl::Time start = absl::Now();
    auto joined = agent.Join();
    EXPECT_EQ(joined.status().code(), absl::StatusCode::kUnauthenticated)
        << joined.status();
    // Not retried as if transient.
    EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  }
  EXPECT_TRUE(server->membership().Workers().empty());
}

TEST_F(AgentAuthTest, UnreadableTokenFileFailsEveryCallNamingIt) {
  setenv(kJobTokenFileEnv, "/nonexistent/hsdp-token", 1);
  Agent agent(Options("127.0.0.1:1"));
  auto joined = agent.Join();
  EXPECT_EQ(joined.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(joined.status().message().find("/nonexistent/hsdp-token"),
            std::string::npos)
      << joined.status();
}

TEST_F(AgentAuthTest, MutualTlsWithCertificateFiles) {
  auto certs = hsdp::testing::MakeTestCerts(TempPath("certs"));
  ASSERT_TRUE(certs.ok()) << certs.status();
  coordinator::ServerOptions options;
  options.tls_cert_pem = certs->server_cert;
  options.tls_key_pem = certs->server_key;
  options.tls_client_ca_pem = certs->ca;
  auto server = StartCoordinator(options);
  ASSERT_NE(server, nullptr);

  // The worker's flags: --tls-ca, --tls-client-cert, --tls-client-key.
  AgentSecurityFiles files;
  files.tls_ca = certs->dir + "/ca.pem";
  files.tls_client_cert = certs->dir + "/client.pem";
  files.tls_client_key = certs->dir + "/client.key";
  const std::string token_file = TempPath("token");
  std::ofstream(token_file) << kToken;
  files.job_token_file = token_file;
  AgentOptions trusted = Options(server->address());
  ASSERT_TRUE(LoadAgentSecurityFiles(files, &trusted).ok());
  EXPECT_EQ(trusted.job_token, kToken);
  {
    Agent agent(trusted);
    ExerciseEveryCall(agent);
  }

  // Without a client certificate, or with one from another CA: no handshake.
  AgentOptions anonymous = Options(server->address());
  anonymous.job_token = kToken;
  anonymous.tls_ca_pem = certs->ca;
  AgentOptions rogue = anonymous;
  rogue.tls_client_cert_pem = certs->rogue_cert;
  rogue.tls_client_key_pem = certs->rogue_key;
  for (const AgentOptions& o : {anonymous, rogue}) {
    Agent agent(o);
    EXPECT_EQ(agent.Join().status().code(), absl::StatusCode::kUnavailable);
  }
}

TEST_F(AgentAuthTest, BadSecuritySettingsAreRefused) {
  AgentSecurityFiles files;
  files.tls_client_cert = "/etc/hostname";
  AgentOptions o = Options("127.0.0.1:1");
  absl::Status s = LoadAgentSecurityFiles(files, &o);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  files.tls_client_key = "/etc/hostname";
  s = LoadAgentSecurityFiles(files, &o);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("--tls-ca"), std::string::npos) << s;
  files = {};
  files.tls_ca = "/nonexistent/ca.pem";
  EXPECT_EQ(LoadAgentSecurityFiles(files, &o).code(),
            absl::StatusCode::kNotFound);
  // An agent built from inconsistent options fails every call with the reason.
  AgentOptions half = Options("127.0.0.1:1");
  half.tls_client_cert_pem = "cert";
  Agent agent(half);
  EXPECT_EQ(agent.Join().status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace hsdp::agent
