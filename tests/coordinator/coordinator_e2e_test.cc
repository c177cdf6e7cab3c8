// The real hsdp-coordinator binary: SIGKILL and restart on the same state
// directory, start-up validation, job files and env fallbacks, and graceful
// SIGTERM.
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <utility>
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

  // Joins with a rank hint (0 for none); `worker_id` set: re-joins as it.
  hsdp::v1::JoinResponse Join(int rank, int64_t worker_id = 0) {
    hsdp::v1::JoinRequest request = MakeJoin(kJob, kLayers, rank);
    request.set_worker_id(worker_id);
    return JoinOrFail(*worker, request);
  }
  // Legacy read by rank (clients without worker ids).
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
  std::string FetchAs(int64_t worker_id, int64_t generation, int64_t step) {
    hsdp::v1::GetScheduleRequest request;
    request.set_job_id(kJob);
    request.set_worker_id(worker_id);
    request.set_generation(generation);
    request.set_step(step);
    hsdp::v1::GetScheduleResponse response;
    grpc::Status s = worker->GetSchedule(Ctx().get(), request, &response);
    EXPECT_TRUE(s.ok()) << "step " << step << ": " << s.error_message();
    return response.schedule().SerializeAsString();
  }
  void Heartbeat(int64_t worker_id, int64_t step = 0, int64_t generation = 0) {
    hsdp::v1::HeartbeatRequest request;
    request.set_job_id(kJob);
    request.set_worker_id(worker_id);
    request.set_generation(generation);
    request.set_step(step);
    hsdp::v1::HeartbeatResponse response;
    EXPECT_TRUE(worker->Heartbeat(Ctx().get(), request, &response).ok());
  }
  grpc::Status Commit(int64_t worker_id, int64_t generation, int64_t step,
                      hsdp::v1::CommitStepResponse* response) {
    hsdp::v1::CommitStepRequest request;
    request.set_job_id(kJob);
    request.set_worker_id(worker_id);
    request.set_generation(generation);
    request.set_step(step);
    return worker->CommitStep(Ctx(std::chrono::seconds(20)).get(), request,
                              response);
  }
  // Until the answer is not ENDED (calling again confirms).
  hsdp::v1::AwaitGenerationResponse Await(int64_t worker_id, int64_t known) {
    hsdp::v1::AwaitGenerationResponse response;
    while (true) {
      hsdp::v1::AwaitGenerationRequest request;
      request.set_job_id(kJob);
      request.set_worker_id(worker_id);
      request.set_generation(known);
      grpc::Status s = worker->AwaitGeneration(
          Ctx(std::chrono::seconds(20)).get(), request, &response);
      EXPECT_TRUE(s.ok()) << s.error_message();
      if (!s.ok() || response.outcome() != hsdp::v1::AWAIT_OUTCOME_ENDED) {
        return response;
      }
    }
  }
  // The members `ids` of `generation` read, train and commit `steps` steps
  // from `first` (each votes on its own thread: the vote waits for the
  // others). Returns whether the generation ends after the last one.
  bool RunSteps(const std::vector<int64_t>& ids, int64_t generation,
                int64_t first, int64_t steps) {
    bool reform = false;
    for (int64_t s = first; s < first + steps; ++s) {
      std::string expected;
      for (int64_t id : ids) {
        const std::string got = FetchAs(id, generation, s);
        if (expected.empty()) expected = got;
        EXPECT_EQ(got, expected) << "step " << s;
      }
      std::vector<std::thread> voters;
      std::vector<hsdp::v1::CommitStepResponse> answers(ids.size());
      for (size_t i = 0; i < ids.size(); ++i) {
        voters.emplace_back([&, i] {
          grpc::Status st = Commit(ids[i], generation, s, &answers[i]);
          EXPECT_TRUE(st.ok()) << st.error_message();
        });
      }
      for (auto& t : voters) t.join();
      reform = answers[0].reform_after();
    }
    return reform;
  }
  hsdp::v1::GetStatusResponse Status() {
    return GetStatusOrFail(*control, kToken, std::chrono::seconds(10));
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
                                 const std::string& heartbeat_timeout,
                                 const std::string& mesh = "1x2") {
  return {"--job-id",
          kJob,
          "--world-size",
          "2",
          "--mesh",
          mesh,
          "--state-dir",
          state_dir,
          "--heartbeat-timeout",
          heartbeat_timeout,
          "--control-token-file",
          token_file};
}

// A 2x1 job loses a worker, shrinks, grows back with a replacement (healed),
// changes its policy, and the coordinator is SIGKILLed: the restarted one
// serves the same generation, committed step and sealed bytes, takes the
// workers back by id, answers a retried vote as before and goes on.
TEST(CoordinatorE2eTest, KilledAndRestartedServesTheSameSealedSteps) {
  TempDir dir;
  const std::string token_file = dir.Write("token", std::string(kToken) + "\n");
  const std::string state = dir.path() + "/state";
  std::map<int64_t, std::string> sealed_before;
  hsdp::v1::GetStatusResponse status_before;
  hsdp::v1::GetPolicyResponse policy_before;
  std::vector<int64_t> members;
  int64_t generation = 0;
  {
    // A short heartbeat timeout so a silent worker is lost quickly.
    CoordinatorProcess coordinator(HSDP_COORDINATOR_BIN,
                                   JobArgs(state, token_file, "1", "2x1"));
    ASSERT_FALSE(coordinator.address().empty()) << coordinator.process().err();
    Clients c(coordinator.address());
    const int64_t w0 = c.Join(0).worker_id();
    const int64_t w1 = c.Join(1).worker_id();
    EXPECT_FALSE(c.RunSteps({w0, w1}, 0, 0, 3));
    // Worker 1 goes silent; worker 0 beats 10x per timeout and waits for its
    // next generation.
    std::atomic<bool> stop{false};
    std::thread beats([&] {
      while (!stop.load()) {
        c.Heartbeat(w0);
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    });
    hsdp::v1::AwaitGenerationResponse next = c.Await(w0, 0);
    ASSERT_EQ(next.outcome(), hsdp::v1::AWAIT_OUTCOME_FORMED);
    EXPECT_EQ(next.generation().generation(), 1);
    EXPECT_EQ(next.generation().start_step(), 3);
    EXPECT_FALSE(c.RunSteps({w0}, 1, 3, 2));
    // A replacement joins; the job grows back at the next step boundary.
    const hsdp::v1::JoinResponse replacement = c.Join(0);
    EXPECT_EQ(replacement.worker_state(), hsdp::v1::WORKER_STATE_JOINING);
    const int64_t w2 = replacement.worker_id();
    EXPECT_EQ(c.Await(w2, -1).outcome(), hsdp::v1::AWAIT_OUTCOME_STANDBY);
    EXPECT_TRUE(c.RunSteps({w0}, 1, 5, 1));
    std::thread joiner([&] {
      const hsdp::v1::AwaitGenerationResponse j = c.Await(w2, 1);
      EXPECT_EQ(j.outcome(), hsdp::v1::AWAIT_OUTCOME_FORMED);
      EXPECT_EQ(j.generation().roles(1), hsdp::v1::GENERATION_ROLE_HEAL_TARGET);
    });
    next = c.Await(w0, 1);
    joiner.join();
    stop = true;
    beats.join();
    ASSERT_EQ(next.outcome(), hsdp::v1::AWAIT_OUTCOME_FORMED);
    generation = next.generation().generation();
    EXPECT_EQ(generation, 2);
    members = {next.generation().worker_ids().begin(),
               next.generation().worker_ids().end()};
    EXPECT_EQ(members, (std::vector<int64_t>{w0, w2}));
    EXPECT_EQ(next.generation().roles(0),
              hsdp::v1::GENERATION_ROLE_HEAL_SOURCE);
    c.RunSteps(members, generation, 6, 3);
    hsdp::v1::Policy p2;
    p2.set_forward_prefetch_depth(2);
    p2.set_reshard_after_forward(false);
    const hsdp::v1::SetPolicyResponse v2 = c.SetPolicy(p2);
    EXPECT_EQ(v2.policy_version(), 2);
    c.RunSteps(members, generation, 9, 3);
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
    EXPECT_EQ(status_before.last_committed_step(), 11);
    EXPECT_EQ(status_before.failures(), 1);
    EXPECT_EQ(policy_before.effective_step(), status_before.sealed_step() + 1);
    for (int64_t s = 0; s <= status_before.sealed_step(); ++s)
      sealed_before[s] = c.Sealed(s);
    coordinator.process().Signal(SIGKILL);
    EXPECT_EQ(coordinator.process().Wait().exit_code, -1);
  }
  ASSERT_GE(sealed_before.size(), 12u);

  // Same state directory; a long heartbeat timeout so the restored members
  // stay alive.
  CoordinatorProcess coordinator(HSDP_COORDINATOR_BIN,
                                 JobArgs(state, token_file, "30", "2x1"));
  ASSERT_FALSE(coordinator.address().empty()) << coordinator.process().err();
  Clients c(coordinator.address());
  const hsdp::v1::GetStatusResponse status = c.Status();
  EXPECT_EQ(status.generation(), status_before.generation());
  EXPECT_EQ(status.sealed_step(), status_before.sealed_step());
  EXPECT_EQ(status.last_committed_step(), 11);
  EXPECT_EQ(status.failures(), 1);
  EXPECT_EQ(status.policy_version(), 3);
  EXPECT_EQ(status.model(), kModel);
  const hsdp::v1::GetPolicyResponse policy = c.Policy();
  EXPECT_EQ(policy.SerializeAsString(), policy_before.SerializeAsString());
  for (const auto& [step, bytes] : sealed_before) {
    EXPECT_EQ(c.Sealed(step), bytes)
        << "sealed step " << step << " changed across the restart";
  }
  // Workers re-join with their ids, on their ranks, without a new generation,
  // and read the same bytes.
  const hsdp::v1::JoinResponse back0 = c.Join(0, members[0]);
  EXPECT_EQ(back0.generation(), generation);
  EXPECT_EQ(back0.rank(), 0);
  EXPECT_EQ(c.Join(0, members[1]).rank(), 1);
  const int64_t last = status_before.sealed_step();
  EXPECT_EQ(c.FetchAs(members[0], generation, last), sealed_before[last]);
  // A vote retried across the restart gets the decision made before it.
  hsdp::v1::CommitStepResponse retried;
  ASSERT_TRUE(c.Commit(members[1], generation, 11, &retried).ok());
  EXPECT_FALSE(retried.reform_after());
  // Completed steps are not persisted: the workers' heartbeats ("on step
  // last + 1", as the agent sends them) reopen the read-ahead window.
  c.Heartbeat(members[0], last + 1, generation);
  c.Heartbeat(members[1], last + 1, generation);
  // The next step is the first of policy v3, exactly as announced before the
  // crash.
  hsdp::v1::StepSchedule next;
  ASSERT_TRUE(
      next.ParseFromString(c.FetchAs(members[1], generation, last + 1)));
  EXPECT_EQ(next.policy_version(), 3);
  EXPECT_EQ(next.microbatches_size(), 3);
  EXPECT_EQ(next.generation(), generation);
}

// A state directory with one sealed step file deleted (any but the newest):
// the coordinator exits non-zero at start-up with one line naming the step
// and the file, and serves nothing.
TEST(CoordinatorE2eTest, AMissingSealedStepFileStopsTheStartNamingIt) {
  namespace fs = std::filesystem;
  TempDir dir;
  const std::string token_file = dir.Write("token", std::string(kToken) + "\n");
  const std::string state = dir.path() + "/state";
  {
    CoordinatorProcess coordinator(HSDP_COORDINATOR_BIN,
                                   JobArgs(state, token_file, "30"));
    ASSERT_FALSE(coordinator.address().empty()) << coordinator.process().err();
    Clients c(coordinator.address());
    const int64_t w0 = c.Join(0).worker_id();
    const int64_t w1 = c.Join(1).worker_id();
    c.RunSteps({w0, w1}, 0, 0, 5);
    coordinator.process().Signal(SIGKILL);
    coordinator.process().Wait();
  }
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(state + "/steps")) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  ASSERT_GE(names.size(), 5u);
  // Every file but the newest (whose absence a crash before its write would
  // explain).
  for (size_t i = 0; i + 1 < names.size(); ++i) {
    const std::string copy = dir.path() + "/copy-" + std::to_string(i);
    fs::copy(state, copy, fs::copy_options::recursive);
    const std::string file = copy + "/steps/" + names[i];
    ASSERT_TRUE(fs::remove(file));
    CoordinatorProcess coordinator(HSDP_COORDINATOR_BIN,
                                   JobArgs(copy, token_file, "30"));
    EXPECT_TRUE(coordinator.address().empty()) << "served step file " << i;
    const RunResult r = coordinator.process().Wait();
    EXPECT_NE(r.exit_code, 0);
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_NE(r.err.find("sealed step " + std::to_string(i) + " is missing"),
              std::string::npos)
        << r.err;
    EXPECT_NE(r.err.find(file), std::string::npos) << r.err;
  }
}

// The operator's repair: a hole above the last committed step is cut off with
// --truncate-sealed-after (the files after it moved aside, those steps sealed
// again); one below it is refused.
TEST(CoordinatorE2eTest, TruncateSealedAfterRepairsAHoleAboveTheCommit) {
  namespace fs = std::filesystem;
  TempDir dir;
  const std::string token_file = dir.Write("token", std::string(kToken) + "\n");
  const std::string state = dir.path() + "/state";
  int64_t w0 = 0;
  {
    CoordinatorProcess coordinator(HSDP_COORDINATOR_BIN,
                                   JobArgs(state, token_file, "30"));
    ASSERT_FALSE(coordinator.address().empty()) << coordinator.process().err();
    Clients c(coordinator.address());
    w0 = c.Join(0).worker_id();
    const int64_t w1 = c.Join(1).worker_id();
    c.RunSteps({w0, w1}, 0, 0, 3);  // steps 0..2 commit
    c.FetchAs(w0, 0, 5);            // 3..5 sealed, not committed
    coordinator.process().Signal(SIGKILL);
    coordinator.process().Wait();
  }
  const std::string hole = state + "/steps/000000000004.binpb";
  ASSERT_TRUE(fs::remove(hole));
  auto args = [&](const std::string& truncate) {
    std::vector<std::string> a = JobArgs(state, token_file, "30");
    if (!truncate.empty()) {
      a.push_back("--truncate-sealed-after");
      a.push_back(truncate);
    }
    return a;
  };
  {
    CoordinatorProcess refused(HSDP_COORDINATOR_BIN, args(""));
    EXPECT_TRUE(refused.address().empty());
    const RunResult r = refused.process().Wait();
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.err.find("sealed step 4 is missing: " + hole),
              std::string::npos)
        << r.err;
  }
  {
    // Below the committed step 2: refused, nothing moved.
    CoordinatorProcess refused(HSDP_COORDINATOR_BIN, args("1"));
    EXPECT_TRUE(refused.address().empty());
    const RunResult r = refused.process().Wait();
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.err.find("step 2 committed"), std::string::npos) << r.err;
    EXPECT_TRUE(fs::exists(state + "/steps/000000000003.binpb"));
  }
  CoordinatorProcess repaired(HSDP_COORDINATOR_BIN, args("3"));
  ASSERT_FALSE(repaired.address().empty()) << repaired.process().err();
  Clients c(repaired.address());
  EXPECT_EQ(c.Status().sealed_step(), 3);
  EXPECT_FALSE(fs::exists(state + "/steps/000000000005.binpb"));
  bool moved_aside = false;
  for (const auto& entry : fs::directory_iterator(state)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("truncated-", 0) == 0) {
      moved_aside |= fs::exists(entry.path() / "steps" / "000000000005.binpb");
    }
  }
  EXPECT_TRUE(moved_aside);
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

TEST(CoordinatorE2eTest, MeshAutoTakesTheShardDegreeFromRanksPerHost) {
  RunResult r =
      RunCommand({HSDP_COORDINATOR_BIN, "--job-id", "j", "--world-size", "8",
                  "--mesh", "auto", "--ranks-per-host", "4", "--check-config"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("mesh:              2x4\n"), std::string::npos) << r.out;
  // Agreeing with an explicit mesh is fine.
  r = RunCommand({HSDP_COORDINATOR_BIN, "--job-id", "j", "--world-size", "8",
                  "--mesh", "2x4", "--ranks-per-host", "4", "--check-config"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
}

TEST(CoordinatorE2eTest, MeshAutoRefusesWithTheFlagToFix) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--mesh", "auto"},
       "hsdp-coordinator: --mesh auto needs --ranks-per-host (the ranks on "
       "each host)\n"},
      {{"--mesh", "auto", "--ranks-per-host", "3"},
       "hsdp-coordinator: --ranks-per-host 3 does not divide --world-size 8 "
       "(--mesh auto)\n"},
      {{"--mesh", "auto", "--ranks-per-host", "-2"},
       "hsdp-coordinator: --ranks-per-host must be >= 1\n"},
      {{"--mesh", "4x2", "--ranks-per-host", "4"},
       "hsdp-coordinator: --ranks-per-host 4 disagrees with --mesh 4x2 (shard "
       "degree 2); use --mesh auto\n"},
  };
  for (const auto& [flags, err] : cases) {
    std::vector<std::string> argv = {
        HSDP_COORDINATOR_BIN, "--job-id", "j",
        "--world-size",       "8",        "--check-config"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    RunResult r = RunCommand(argv);
    EXPECT_EQ(r.exit_code, 2) << flags.back();
    EXPECT_EQ(r.err, err);
    EXPECT_EQ(r.out, "");
  }
}

// The links the memory-budget planner weighs its choice by: shown by
// --check-config; a malformed or non-positive figure is refused naming the
// flag and the expected form.
TEST(CoordinatorE2eTest, LinkFlagsAreShownAndChecked) {
  RunResult r = RunCommand({HSDP_COORDINATOR_BIN, "--job-id", "j",
                            "--world-size", "8", "--inter-host-link", "1,50",
                            "--intra-host-link", "200", "--check-config"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("intra-host link:   200 Gbit/s, 0 us\n"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("inter-host link:   1 Gbit/s, 50 us\n"),
            std::string::npos)
      << r.out;
  r = RunCommand({HSDP_COORDINATOR_BIN, "--job-id", "j", "--world-size", "8",
                  "--check-config"});
  EXPECT_NE(r.out.find("inter-host link:   (not declared)\n"),
            std::string::npos)
      << r.out;
  for (const std::string bad : {"0", "1,-5", "fast", "1,2,3", "-1"}) {
    r = RunCommand({HSDP_COORDINATOR_BIN, "--job-id", "j", "--world-size", "8",
                    "--inter-host-link", bad, "--check-config"});
    EXPECT_EQ(r.exit_code, 2) << bad;
    EXPECT_EQ(r.err, "hsdp-coordinator: --inter-host-link '" + bad +
                         "': expected GBIT_PER_S[,LATENCY_US] with a "
                         "bandwidth > 0 and a latency >= 0, e.g. 1,50\n");
  }
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
