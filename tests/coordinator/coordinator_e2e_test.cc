// The real hsdp-coordinator binary: SIGKILL and restart on the same state
// directory, start-up validation, job files and env fallbacks, and graceful
// SIGTERM.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "hsdp/v1/control_service.grpc.pb.h"
#include "hsdp/v1/coordinator_service.grpc.pb.h"
#include "tests/coordinator/service_test_util.h"
#include "tests/coordinator/subprocess.h"

namespace hsdp::testing {
namespace {

using ::hsdp::v1::ControlService;
using ::hsdp::v1::CoordinatorService;

constexpr char kJob[] = "job-e2e";
constexpr char kToken[] = "e2e-token";
constexpr int kLayers = 4;

// Worker and operator clients of one coordinator process.
struct Clients {
  explicit Clients(const std::string& address)
      : channel(Connect(address)),
        worker(CoordinatorService::NewStub(channel)),
        control(ControlService::NewStub(channel)) {}

  hsdp::v1::JoinResponse Join(int rank) {
    hsdp::v1::JoinResponse response;
    grpc::Status s =
        worker->Join(Ctx().get(), MakeJoin(kJob, kLayers, rank), &response);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return response;
  }
  std::string Fetch(int rank, int64_t step) {
    hsdp::v1::GetScheduleRequest request;
    request.set_job_id(kJob);
    request.set_rank(rank);
    request.set_step(step);
    hsdp::v1::GetScheduleResponse response;
    grpc::Status s = worker->GetSchedule(Ctx().get(), request, &response);
    EXPECT_TRUE(s.ok()) << "step " << step << ": " << s.error_message();
    return response.schedule().SerializeAsString();
  }
  void Report(int rank, int64_t step) {
    hsdp::v1::ReportStepRequest request;
    request.set_job_id(kJob);
    request.mutable_report()->set_rank(rank);
    request.mutable_report()->set_step(step);
    hsdp::v1::ReportStepResponse response;
    EXPECT_TRUE(worker->ReportStep(Ctx().get(), request, &response).ok());
  }
  void Heartbeat(int rank, int64_t step = 0) {
    hsdp::v1::HeartbeatRequest request;
    request.set_job_id(kJob);
    request.set_rank(rank);
    request.set_step(step);
    hsdp::v1::HeartbeatResponse response;
    EXPECT_TRUE(worker->Heartbeat(Ctx().get(), request, &response).ok());
  }
  // Both ranks run `steps` more steps starting at `first`.
  void RunSteps(int64_t first, int64_t steps) {
    for (int64_t s = first; s < first + steps; ++s) {
      EXPECT_EQ(Fetch(0, s), Fetch(1, s));
      Report(0, s);
      Report(1, s);
    }
  }
  hsdp::v1::GetStatusResponse Status() {
    hsdp::v1::GetStatusResponse response;
    grpc::Status s = control->GetStatus(
        Ctx(std::chrono::seconds(10), kToken).get(), {}, &response);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return response;
  }
  hsdp::v1::GetPolicyResponse Policy() {
    hsdp::v1::GetPolicyResponse response;
    EXPECT_TRUE(control
                    ->GetPolicy(Ctx(std::chrono::seconds(10), kToken).get(), {},
                                &response)
                    .ok());
    return response;
  }
  hsdp::v1::SetPolicyResponse SetPolicy(const hsdp::v1::Policy& policy) {
    hsdp::v1::SetPolicyRequest request;
    *request.mutable_policy() = policy;
    hsdp::v1::SetPolicyResponse response;
    grpc::Status s = control->SetPolicy(
        Ctx(std::chrono::seconds(10), kToken).get(), request, &response);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return response;
  }
  std::string Sealed(int64_t step) {
    hsdp::v1::ControlServiceGetScheduleRequest request;
    request.set_step(step);
    hsdp::v1::ControlServiceGetScheduleResponse response;
    grpc::Status s = control->GetSchedule(
        Ctx(std::chrono::seconds(10), kToken).get(), request, &response);
    EXPECT_TRUE(s.ok()) << "step " << step << ": " << s.error_message();
    return response.schedule().SerializeAsString();
  }

  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<CoordinatorService::Stub> worker;
  std::unique_ptr<ControlService::Stub> control;
};

std::vector<std::string> JobArgs(const std::string& state_dir,
                                 const std::string& token_file,
                                 const std::string& heartbeat_timeout) {
  return {"--job-id",
          kJob,
          "--world-size",
          "2",
          "--mesh",
          "1x2",
          "--state-dir",
          state_dir,
          "--heartbeat-timeout",
          heartbeat_timeout,
          "--control-token-file",
          token_file};
}

TEST(CoordinatorE2eTest, KilledAndRestartedServesTheSameSealedSteps) {
  TempDir dir;
  const std::string token_file = dir.Write("token", std::string(kToken) + "\n");
  const std::string state = dir.path() + "/state";
  std::map<int64_t, std::string> sealed_before;
  hsdp::v1::GetStatusResponse status_before;
  hsdp::v1::GetPolicyResponse policy_before;
  {
    // A short heartbeat timeout so a silent rank is lost and the generation
    // moves off 0.
    CoordinatorProcess coordinator(HSDP_COORDINATOR_BIN,
                                   JobArgs(state, token_file, "1"));
    ASSERT_FALSE(coordinator.address().empty()) << coordinator.process().err();
    Clients c(coordinator.address());
    c.Join(0);
    c.Join(1);
    // Rank 0 beats 10x per timeout; rank 1 stays silent until it is lost.
    const auto give_up =
        std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (c.Status().generation() == 0 &&
           std::chrono::steady_clock::now() < give_up) {
      c.Heartbeat(0);
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    ASSERT_EQ(c.Status().generation(), 1);
    ASSERT_EQ(c.Join(1).generation(),
              1);  // takes its slot back, same generation
    c.RunSteps(0, 6);
    hsdp::v1::Policy p2;
    p2.set_forward_prefetch_depth(2);
    p2.set_reshard_after_forward(false);
    const hsdp::v1::SetPolicyResponse v2 = c.SetPolicy(p2);
    EXPECT_EQ(v2.policy_version(), 2);
    c.RunSteps(6, 6);
    // v3 is announced for a step that is not sealed yet when the coordinator
    // dies.
    hsdp::v1::Policy p3;
    p3.set_microbatches(3);
    hsdp::v1::UnitOverride* o = p3.add_overrides();
    o->set_unit_glob("layers.?");
    o->set_reshard_after_backward(false);
    const hsdp::v1::SetPolicyResponse v3 = c.SetPolicy(p3);
    EXPECT_EQ(v3.policy_version(), 3);
    status_before = c.Status();
    policy_before = c.Policy();
    EXPECT_EQ(policy_before.effective_step(), status_before.sealed_step() + 1);
    for (int64_t s = 0; s <= status_before.sealed_step(); ++s)
      sealed_before[s] = c.Sealed(s);
    coordinator.process().Signal(SIGKILL);
    EXPECT_EQ(coordinator.process().Wait().exit_code, -1);
  }
  ASSERT_GE(sealed_before.size(), 12u);

  // Same state directory; a long heartbeat timeout so the restored members stay
  // alive.
  CoordinatorProcess coordinator(HSDP_COORDINATOR_BIN,
                                 JobArgs(state, token_file, "30"));
  ASSERT_FALSE(coordinator.address().empty()) << coordinator.process().err();
  Clients c(coordinator.address());
  const hsdp::v1::GetStatusResponse status = c.Status();
  EXPECT_EQ(status.generation(), status_before.generation());
  EXPECT_EQ(status.sealed_step(), status_before.sealed_step());
  EXPECT_EQ(status.policy_version(), 3);
  EXPECT_EQ(status.model(), kModel);
  const hsdp::v1::GetPolicyResponse policy = c.Policy();
  EXPECT_EQ(policy.SerializeAsString(), policy_before.SerializeAsString());
  for (const auto& [step, bytes] : sealed_before) {
    EXPECT_EQ(c.Sealed(step), bytes)
        << "sealed step " << step << " changed across the restart";
  }
  // Workers re-join on their ranks without a generation bump and read the same
  // bytes.
  EXPECT_EQ(c.Join(0).generation(), status_before.generation());
  EXPECT_EQ(c.Join(1).generation(), status_before.generation());
  const int64_t last = status_before.sealed_step();
  EXPECT_EQ(c.Fetch(0, last), sealed_before[last]);
  // Completed steps are not persisted: the workers' heartbeats ("on step
  // last + 1", as the agent sends them) reopen the read-ahead window.
  c.Heartbeat(0, last + 1);
  c.Heartbeat(1, last + 1);
  // The next step is the first of policy v3, exactly as announced before the
  // crash.
  hsdp::v1::StepSchedule next;
  ASSERT_TRUE(next.ParseFromString(c.Fetch(1, last + 1)));
  EXPECT_EQ(next.policy_version(), 3);
  EXPECT_EQ(next.microbatches_size(), 3);
  EXPECT_EQ(next.generation(), status_before.generation());
}

TEST(CoordinatorE2eTest, MeshNotDividingTheWorldExitsWithTheReason) {
  RunResult r = RunCommand({HSDP_COORDINATOR_BIN, "--job-id", "j",
                            "--world-size", "4", "--mesh", "3x2", "--listen",
                            "127.0.0.1:0", "--metrics-listen", ""});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_EQ(r.err,
            "hsdp-coordinator: mesh 3x2 has 6 ranks but the world size is 4\n");
  EXPECT_EQ(r.out, "");
}

TEST(CoordinatorE2eTest, PortInUseFailsAtStartup) {
  CoordinatorProcess first(HSDP_COORDINATOR_BIN,
                           {"--job-id", "one", "--world-size", "1"});
  ASSERT_FALSE(first.address().empty()) << first.process().err();
  RunResult r =
      RunCommand({HSDP_COORDINATOR_BIN, "--job-id", "two", "--world-size", "1",
                  "--listen", first.address(), "--metrics-listen", ""});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("cannot listen on " + first.address()),
            std::string::npos)
      << r.err;
}

TEST(CoordinatorE2eTest, BadFlagsAndBadPolicyFilesFailAtStartup) {
  TempDir dir;
  RunResult r = RunCommand({HSDP_COORDINATOR_BIN, "--no-such-flag"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("--no-such-flag"), std::string::npos) << r.err;
  const std::string bad =
      dir.Write("bad.json", R"({"forwardPrefetchDepth": 2, "bogus": 1})");
  r = RunCommand({HSDP_COORDINATOR_BIN, "--job-id", "j", "--world-size", "2",
                  "--policy-file", bad, "--listen", "127.0.0.1:0",
                  "--metrics-listen", ""});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("bogus"), std::string::npos) << r.err;
  // --validate-policy: 0 and the effective values for a good file, 1 and the
  // reason otherwise.
  const std::string good =
      dir.Write("good.txt", "forward_prefetch_depth: 3\nmicrobatches: 2\n");
  r = RunCommand({HSDP_COORDINATOR_BIN, "--validate-policy", good});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("forward_prefetch_depth:  3"), std::string::npos)
      << r.out;
  const std::string negative =
      dir.Write("neg.txt", "backward_prefetch_depth: -1\n");
  r = RunCommand({HSDP_COORDINATOR_BIN, "--validate-policy", negative});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("policy.backward_prefetch_depth: -1 is negative"),
            std::string::npos)
      << r.err;
}

TEST(CoordinatorE2eTest, JobFileAndEnvironmentConfigureTheJob) {
  TempDir dir;
  const std::string job_file = dir.Write(
      "job.toml", "job-id = \"from-file\"\nmesh = \"2x2\"\nread-ahead = 2\n");
  const std::string port_file = dir.path() + "/port";
  // World size from the environment, the rest from the file.
  CoordinatorProcess coordinator(
      HSDP_COORDINATOR_BIN, {"--job-file", job_file, "--port-file", port_file},
      {"HSDP_WORLD_SIZE=4"});
  ASSERT_FALSE(coordinator.address().empty()) << coordinator.process().err();
  std::ifstream port_in(port_file);
  std::string port;
  port_in >> port;
  EXPECT_EQ(coordinator.address(), "127.0.0.1:" + port);
  auto control = ControlService::NewStub(Connect(coordinator.address()));
  hsdp::v1::GetStatusResponse status;
  ASSERT_TRUE(control->GetStatus(Ctx().get(), {}, &status).ok());
  EXPECT_EQ(status.job_id(), "from-file");
  EXPECT_EQ(status.world_size(), 4);
  EXPECT_EQ(status.mesh().replicate(), 2);
  EXPECT_EQ(status.mesh().shard(), 2);
}

TEST(CoordinatorE2eTest, SigtermReleasesLongPollsAndExitsCleanly) {
  CoordinatorProcess coordinator(
      HSDP_COORDINATOR_BIN,
      {"--job-id", kJob, "--world-size", "1", "--read-ahead", "1"});
  ASSERT_FALSE(coordinator.address().empty()) << coordinator.process().err();
  Clients c(coordinator.address());
  c.Join(0);
  grpc::Status polled;
  std::thread poll([&] {
    hsdp::v1::GetScheduleRequest request;
    request.set_job_id(kJob);
    request.set_step(
        3);  // beyond the window (read-ahead 1, nothing reported): waits
    hsdp::v1::GetScheduleResponse response;
    polled = c.worker->GetSchedule(Ctx(std::chrono::seconds(30)).get(), request,
                                   &response);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const auto start = std::chrono::steady_clock::now();
  coordinator.process().Signal(SIGTERM);
  const RunResult r = coordinator.process().Wait();
  poll.join();
  // Well under the 10 s default shutdown deadline: nothing was left in flight.
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(3));
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("SIGTERM: shutting down"), std::string::npos) << r.err;
  EXPECT_EQ(polled.error_code(), grpc::StatusCode::UNAVAILABLE)
      << polled.error_message();
}

}  // namespace
}  // namespace hsdp::testing
