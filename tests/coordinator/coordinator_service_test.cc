// CoordinatorService and ControlService over real gRPC on loopback (ephemeral
// ports), with the whole server assembled in-process by CoordinatorServer.
#include <arpa/inet.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/policy.h"
#include "common/units.h"
#include "coordinator/core/kv_store.h"
#include "coordinator/core/membership.h"
#include "coordinator/core/metrics.h"
#include "coordinator/planner.h"
#include "coordinator/server.h"
#include "coordinator/service/grpc_status.h"
#include "hsdp/v1/control_service.grpc.pb.h"
#include "hsdp/v1/coordinator_service.grpc.pb.h"
#include "tests/coordinator/http_test_client.h"
#include "tests/coordinator/service_test_util.h"

namespace hsdp::coordinator {
namespace {

using ::hsdp::testing::Connect;
using ::hsdp::testing::Ctx;
using ::hsdp::testing::GetStatusOrFail;
using ::hsdp::testing::HttpGet;
using ::hsdp::testing::JoinOrFail;
using ::hsdp::testing::MakeJoin;
using ::hsdp::v1::ControlService;
using ::hsdp::v1::CoordinatorService;
using std::chrono::milliseconds;

constexpr char kJob[] = "job-svc";
constexpr char kToken[] = "s3cret-token";
constexpr int kLayers = 6;

class ServiceTest : public ::testing::Test {
 protected:
  void StartServer(int world, MeshShape mesh, ServerOptions options = {},
                   absl::Duration heartbeat_timeout = absl::Seconds(30),
                   absl::Duration reform_window = absl::Seconds(5)) {
    JobConfig job;
    job.job_id = kJob;
    job.world_size = world;
    job.mesh = mesh;
    job.heartbeat_timeout = heartbeat_timeout;
    job.reform_window = reform_window;
    options.listen = "127.0.0.1:0";
    options.sync_state = false;
    if (options.control_token.empty()) options.control_token = kToken;
    auto server = CoordinatorServer::Start(job, options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    channel_ = Connect(server_->address());
    worker_ = CoordinatorService::NewStub(channel_);
    control_ = ControlService::NewStub(channel_);
  }

  // Joins rank `rank` (as a hint) with the standard model; returns the
  // response.
  hsdp::v1::JoinResponse JoinRank(int rank) {
    hsdp::v1::JoinResponse response;
    grpc::Status s =
        worker_->Join(Ctx().get(), MakeJoin(kJob, kLayers, rank), &response);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return response;
  }

  // Joins from `host`, with rank hint `hint` (-1: none).
  hsdp::v1::JoinResponse JoinFrom(int hint, const std::string& host) {
    hsdp::v1::JoinRequest request = MakeJoin(kJob, kLayers, hint);
    request.set_hostname(host);
    return JoinOrFail(*worker_, request);
  }

  // What a worker's agent does once its generation ended: AwaitGeneration
  // again (confirming) until the answer is not ENDED.
  void AwaitPastTheEnd(const hsdp::v1::JoinResponse& joined,
                       hsdp::v1::AwaitGenerationResponse* next) {
    for (;;) {
      hsdp::v1::AwaitGenerationRequest request;
      request.set_job_id(kJob);
      request.set_worker_id(joined.worker_id());
      request.set_generation(joined.generation());
      grpc::Status s = worker_->AwaitGeneration(
          Ctx(std::chrono::seconds(20)).get(), request, next);
      ASSERT_TRUE(s.ok()) << s.error_message();
      if (next->outcome() != hsdp::v1::AWAIT_OUTCOME_ENDED) return;
    }
  }

  grpc::Status Report(int rank, int64_t step, bool finished = false) {
    hsdp::v1::ReportStepRequest request;
    request.set_job_id(kJob);
    request.mutable_report()->set_rank(rank);
    request.mutable_report()->set_step(step);
    request.mutable_report()->set_loss(2.5 - 0.01 * static_cast<double>(step));
    request.mutable_report()->set_step_seconds(0.125);
    request.mutable_report()->set_peak_memory_bytes(1 << 20);
    request.set_finished(finished);
    hsdp::v1::ReportStepResponse response;
    return worker_->ReportStep(Ctx().get(), request, &response);
  }

  grpc::Status Fetch(int rank, int64_t step,
                     hsdp::v1::GetScheduleResponse* response,
                     milliseconds timeout = std::chrono::seconds(30)) {
    hsdp::v1::GetScheduleRequest request;
    request.set_job_id(kJob);
    request.set_rank(rank);
    request.set_step(step);
    return worker_->GetSchedule(Ctx(timeout).get(), request, response);
  }

  grpc::Status SetPolicy(const hsdp::v1::Policy& policy,
                         hsdp::v1::SetPolicyResponse* response,
                         const std::string& token = kToken) {
    hsdp::v1::SetPolicyRequest request;
    *request.mutable_policy() = policy;
    return control_->SetPolicy(Ctx(std::chrono::seconds(30), token).get(),
                               request, response);
  }

  // Everything an operator can observe (status, policy, workers minus heartbeat
  // ages): equal snapshots before and after a refused call prove it changed
  // nothing.
  std::string Snapshot() {
    hsdp::v1::GetStatusResponse status;
    EXPECT_TRUE(control_
                    ->GetStatus(Ctx(std::chrono::seconds(30), kToken).get(), {},
                                &status)
                    .ok());
    hsdp::v1::GetPolicyResponse policy;
    EXPECT_TRUE(control_
                    ->GetPolicy(Ctx(std::chrono::seconds(30), kToken).get(), {},
                                &policy)
                    .ok());
    hsdp::v1::ListWorkersResponse workers;
    EXPECT_TRUE(control_
                    ->ListWorkers(Ctx(std::chrono::seconds(30), kToken).get(),
                                  {}, &workers)
                    .ok());
    for (auto& w : *workers.mutable_workers()) w.clear_heartbeat_age_ms();
    return status.SerializeAsString() + "|" + policy.SerializeAsString() + "|" +
           workers.SerializeAsString();
  }

  std::unique_ptr<CoordinatorServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<CoordinatorService::Stub> worker_;
  std::unique_ptr<ControlService::Stub> control_;
};

UnitList ModelUnits() {
  hsdp::v1::JoinRequest join = MakeJoin(kJob, kLayers, 0);
  return UnitListFromProto(join.units());
}

// The policies the 64-worker test cycles through: each differs in prefetch,
// reshard defaults, overrides and microbatches, so a schedule planned from one
// cannot pass for another.
hsdp::v1::Policy PolicyVariant(int i) {
  hsdp::v1::Policy p;
  p.set_forward_prefetch_depth(i % 4);
  p.set_backward_prefetch_depth((i + 1) % 3);
  p.set_reshard_after_forward(i % 2 == 0);
  p.set_microbatches(1 + i % 3);
  if (i % 3 == 1) {
    hsdp::v1::UnitOverride* o = p.add_overrides();
    o->set_unit_glob(absl::StrCat("layers.", i % kLayers));
    o->set_reshard_after_forward(i % 2 != 0);
  }
  if (i % 5 == 2) p.set_grad_sync(hsdp::v1::GRAD_SYNC_MODE_EVERY_MICROBATCH);
  return p;
}

// 64 simulated workers join, fetch and report 200 steps while the operator
// changes the policy every few steps. Every step must be byte-identical across
// workers, every change must land on the step SetPolicy announced, and every
// step must be exactly what the planner makes of the one policy in force for it
// (so no step mixes policies).
TEST_F(ServiceTest, SixtyFourWorkersAgreeOnEveryStepWhilePolicyChanges) {
  constexpr int kWorkers = 64;
  constexpr int kSteps = 200;
  constexpr int kStepsBetweenChanges = 4;
  StartServer(kWorkers, MeshShape{4, 16});

  std::vector<std::vector<std::string>> got(kWorkers,
                                            std::vector<std::string>(kSteps));
  std::vector<int64_t> generations(kWorkers, -1);
  std::atomic<int> failures{0};
  std::atomic<int> done{0};
  // A few channels shared by the workers, as a few processes' worth of
  // connections.
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (int c = 0; c < 8; ++c) {
    grpc::ChannelArguments args;
    args.SetInt("channel_idx", c);  // distinct args: distinct connections
    channels.push_back(grpc::CreateCustomChannel(
        server_->address(), grpc::InsecureChannelCredentials(), args));
  }
  std::vector<std::thread> workers;
  for (int r = 0; r < kWorkers; ++r) {
    workers.emplace_back([&, r] {
      auto stub = CoordinatorService::NewStub(channels[r % channels.size()]);
      hsdp::v1::JoinResponse joined;
      grpc::Status s =
          stub->Join(Ctx().get(), MakeJoin(kJob, kLayers, r), &joined);
      if (!s.ok() || joined.rank() != r) {
        ++failures;
        ++done;
        return;
      }
      generations[r] = joined.generation();
      for (int step = 0; step < kSteps; ++step) {
        hsdp::v1::GetScheduleRequest request;
        request.set_job_id(kJob);
        request.set_rank(r);
        request.set_step(step);
        hsdp::v1::GetScheduleResponse response;
        s = stub->GetSchedule(Ctx().get(), request, &response);
        if (!s.ok() || !response.has_schedule()) {
          ADD_FAILURE() << "rank " << r << " step " << step << ": "
                        << s.error_message();
          ++failures;
          break;
        }
        got[r][step] = response.schedule().SerializeAsString();
        hsdp::v1::ReportStepRequest report;
        report.set_job_id(kJob);
        report.mutable_report()->set_rank(r);
        report.mutable_report()->set_step(step);
        report.mutable_report()->set_loss(1.0);
        report.set_finished(step == kSteps - 1);
        hsdp::v1::ReportStepResponse ignored;
        if (!stub->ReportStep(Ctx().get(), report, &ignored).ok()) {
          ++failures;
          break;
        }
      }
      ++done;
    });
  }

  // The operator: a new policy whenever the job has sealed a few steps past the
  // last change.
  struct Change {
    hsdp::v1::Policy policy;
    int64_t version;
    int64_t effective_step;
  };
  std::vector<Change> changes;
  changes.push_back({hsdp::v1::Policy(), 1, 0});
  int variant = 0;
  while (done.load() < kWorkers) {
    hsdp::v1::GetStatusResponse status;
    ASSERT_TRUE(control_
                    ->GetStatus(Ctx(std::chrono::seconds(30), kToken).get(), {},
                                &status)
                    .ok());
    if (status.sealed_step() >=
            changes.back().effective_step + kStepsBetweenChanges &&
        status.sealed_step() < kSteps - 2) {
      hsdp::v1::Policy policy = PolicyVariant(++variant);
      hsdp::v1::SetPolicyResponse applied;
      grpc::Status s = SetPolicy(policy, &applied);
      ASSERT_TRUE(s.ok()) << s.error_message();
      // The change applies from the first unsealed step, never to a step
      // already sealed.
      EXPECT_GT(applied.effective_step(), status.sealed_step());
      EXPECT_EQ(applied.policy_version(), changes.back().version + 1);
      changes.push_back(
          {policy, applied.policy_version(), applied.effective_step()});
    }
    std::this_thread::sleep_for(milliseconds(2));
  }
  for (auto& t : workers) t.join();
  ASSERT_EQ(failures.load(), 0);
  ASSERT_GE(changes.size(), 10u) << "the policy should have changed many times";

  const UnitList units = ModelUnits();
  Planner planner(units, /*shard_size=*/16);
  size_t change = 0;
  int64_t first_microbatch = 0;
  for (int step = 0; step < kSteps; ++step) {
    // Byte-identical across workers.
    for (int r = 1; r < kWorkers; ++r) {
      ASSERT_EQ(got[r][step], got[0][step])
          << "rank " << r << " differs at step " << step;
    }
    while (change + 1 < changes.size() &&
           changes[change + 1].effective_step <= step)
      ++change;
    hsdp::v1::StepSchedule schedule;
    ASSERT_TRUE(schedule.ParseFromString(got[0][step]));
    // The step uses the policy announced for it: the change lands exactly on
    // effective_step.
    ASSERT_EQ(schedule.policy_version(), changes[change].version)
        << "step " << step;
    // ...and is exactly that one policy's plan (all units, all microbatches).
    PlanInput input;
    input.step = step;
    input.policy_version = changes[change].version;
    input.generation = generations[0];
    // The schedule log adds the generation's sample split: the full world
    // (64 ranks) in the fixed batch mode, the policy's microbatches each.
    hsdp::v1::StepSchedule expected =
        planner.Plan(changes[change].policy, input);
    const int64_t per_rank =
        ResolvePolicyDefaults(changes[change].policy).microbatches();
    expected.set_world_size(kWorkers);
    expected.set_global_microbatches(per_rank * kWorkers);
    expected.set_first_microbatch(first_microbatch);
    expected.set_batch_mode(hsdp::v1::BATCH_MODE_FIXED);
    first_microbatch += per_rank * kWorkers;
    EXPECT_EQ(expected.SerializeAsString(), got[0][step])
        << "step " << step << " is not the plan of policy version "
        << changes[change].version;
  }
  // Every announced step was reached and carried its own version first.
  for (size_t i = 1; i < changes.size(); ++i) {
    // A change announced after the last step was sealed never lands; nothing to
    // check.
    if (changes[i].effective_step >= kSteps) continue;
    hsdp::v1::StepSchedule first, before;
    ASSERT_TRUE(first.ParseFromString(got[0][changes[i].effective_step]));
    ASSERT_TRUE(before.ParseFromString(got[0][changes[i].effective_step - 1]));
    EXPECT_EQ(first.policy_version(), changes[i].version);
    EXPECT_LT(before.policy_version(), changes[i].version);
  }
  hsdp::v1::GetStatusResponse status;
  ASSERT_TRUE(
      control_
          ->GetStatus(Ctx(std::chrono::seconds(30), kToken).get(), {}, &status)
          .ok());
  EXPECT_EQ(status.state(), hsdp::v1::JOB_STATE_FINISHED);
}

// Hint-less joiners from two hosts make one-host shard groups: GetStatus has
// nothing to say about the topology.
TEST_F(ServiceTest, HintlessJoinersFromTwoHostsGetOneHostShardGroups) {
  StartServer(4, MeshShape{2, 2});
  std::vector<int> ranks;
  for (const char* host : {"a", "b", "a", "b"}) {
    ranks.push_back(JoinFrom(-1, host).rank());
  }
  EXPECT_EQ(ranks, (std::vector<int>{0, 2, 1, 3}));
  const hsdp::v1::GetStatusResponse status = GetStatusOrFail(*control_, kToken);
  EXPECT_EQ(status.state(), hsdp::v1::JOB_STATE_RUNNING);
  EXPECT_TRUE(status.topology_warnings().empty());
}

// Hints that put a shard group across hosts are obeyed, and GetStatus names
// the group and its hosts.
TEST_F(ServiceTest, StatusNamesAShardGroupThatSpansHosts) {
  StartServer(4, MeshShape{2, 2});
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(JoinFrom(r, r == 1 ? "b" : "a").rank(), r);
  }
  const hsdp::v1::GetStatusResponse status = GetStatusOrFail(*control_, kToken);
  EXPECT_EQ(status.state(), hsdp::v1::JOB_STATE_RUNNING);
  EXPECT_EQ(std::vector<std::string>(status.topology_warnings().begin(),
                                     status.topology_warnings().end()),
            (std::vector<std::string>{"shard group 0 spans hosts a, b (its "
                                      "all-gathers cross the host link)"}));
}

// --- Bad input: exact status code, and a snapshot of everything observable is
// unchanged.

TEST_F(ServiceTest, PolicyWithUnknownFieldIsInvalidAndChangesNothing) {
  StartServer(2, MeshShape{1, 2});
  JoinRank(0);
  const std::string before = Snapshot();
  hsdp::v1::Policy policy;
  policy.set_forward_prefetch_depth(2);
  // A field number this coordinator's Policy does not have (a newer client's
  // field).
  policy.GetReflection()->MutableUnknownFields(&policy)->AddVarint(99, 1);
  hsdp::v1::SetPolicyResponse response;
  grpc::Status s = SetPolicy(policy, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("unknown field number 99"),
            std::string::npos)
      << s.error_message();
  EXPECT_EQ(Snapshot(), before);
}

TEST_F(ServiceTest, SetPolicyWithoutPolicyIsInvalid) {
  StartServer(2, MeshShape{1, 2});
  const std::string before = Snapshot();
  hsdp::v1::SetPolicyResponse response;
  grpc::Status s =
      control_->SetPolicy(Ctx(std::chrono::seconds(30), kToken).get(),
                          hsdp::v1::SetPolicyRequest(), &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Snapshot(), before);
}

TEST_F(ServiceTest, NegativePrefetchIsInvalidAndChangesNothing) {
  StartServer(2, MeshShape{1, 2});
  JoinRank(0);
  const std::string before = Snapshot();
  hsdp::v1::Policy policy;
  policy.set_forward_prefetch_depth(-1);
  hsdp::v1::SetPolicyResponse response;
  grpc::Status s = SetPolicy(policy, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(), "policy.forward_prefetch_depth: -1 is negative");
  EXPECT_EQ(Snapshot(), before);
}

TEST_F(ServiceTest, OverrideGlobMatchingNoUnitIsInvalidAndChangesNothing) {
  StartServer(2, MeshShape{1, 2});
  JoinRank(0);  // the model (root, layers.0..5) is now known
  const std::string before = Snapshot();
  hsdp::v1::Policy policy;
  hsdp::v1::UnitOverride* o = policy.add_overrides();
  o->set_unit_glob("blocks.*");
  o->set_reshard_after_forward(false);
  hsdp::v1::SetPolicyResponse response;
  grpc::Status s = SetPolicy(policy, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("blocks.*"), std::string::npos)
      << s.error_message();
  EXPECT_EQ(Snapshot(), before);
}

TEST_F(ServiceTest, MismatchedUnitListIsRefusedAndChangesNothing) {
  StartServer(2, MeshShape{1, 2});
  JoinRank(0);
  const std::string before = Snapshot();
  hsdp::v1::JoinRequest other =
      MakeJoin(kJob, kLayers + 1, 1);  // one layer more
  hsdp::v1::JoinResponse response;
  grpc::Status s = worker_->Join(Ctx().get(), other, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(Snapshot(), before);
  // Same count, one unit's size differs.
  other = MakeJoin(kJob, kLayers, 1);
  other.mutable_units(2)->set_param_bytes(12345);
  s = worker_->Join(Ctx().get(), other, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(s.error_message().find("layers.1"), std::string::npos)
      << s.error_message();
  EXPECT_EQ(Snapshot(), before);
}

TEST_F(ServiceTest, DuplicateRankIsAlreadyExistsAndChangesNothing) {
  StartServer(2, MeshShape{1, 2});
  JoinRank(0);
  const std::string before = Snapshot();
  hsdp::v1::JoinResponse response;
  grpc::Status s =
      worker_->Join(Ctx().get(), MakeJoin(kJob, kLayers, 0), &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_EQ(Snapshot(), before);
}

// A full job keeps up to world-size workers waiting to join (spares); one
// more is refused.
TEST_F(ServiceTest, JoinToFullJobIsResourceExhaustedAndChangesNothing) {
  StartServer(2, MeshShape{1, 2});
  JoinRank(0);
  JoinRank(1);
  for (int spare = 0; spare < 2; ++spare) {
    const hsdp::v1::JoinResponse waiting = JoinRank(-1);
    EXPECT_EQ(waiting.worker_state(), hsdp::v1::WORKER_STATE_JOINING);
    EXPECT_EQ(waiting.rank(), -1);
    EXPECT_FALSE(waiting.has_generation_info());
  }
  const std::string before = Snapshot();
  hsdp::v1::JoinResponse response;
  grpc::Status s =
      worker_->Join(Ctx().get(), MakeJoin(kJob, kLayers, -1), &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(Snapshot(), before);
}

TEST_F(ServiceTest, JoinAnswersMeshCoordinatesAndRendezvousPrefix) {
  StartServer(4, MeshShape{2, 2});
  const hsdp::v1::JoinResponse r3 = JoinRank(3);
  EXPECT_EQ(r3.rank(), 3);
  EXPECT_EQ(r3.world_size(), 4);
  EXPECT_EQ(r3.mesh().replicate(), 2);
  EXPECT_EQ(r3.mesh().shard(), 2);
  EXPECT_EQ(r3.replicate_index(), 1);
  EXPECT_EQ(r3.shard_index(), 1);
  EXPECT_EQ(r3.rendezvous_prefix(), RendezvousPrefix(kJob, r3.generation()));
  EXPECT_GT(r3.heartbeat_interval_ms(), 0);
  EXPECT_EQ(r3.last_checkpoint_step(), -1);
  // No hint: first free rank.
  const hsdp::v1::JoinResponse r0 = JoinRank(-1);
  EXPECT_EQ(r0.rank(), 0);
}

TEST_F(ServiceTest, WrongJobIdIsNotFound) {
  StartServer(2, MeshShape{1, 2});
  hsdp::v1::JoinResponse response;
  grpc::Status s =
      worker_->Join(Ctx().get(), MakeJoin("other-job", kLayers, 0), &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(ServiceTest, StepFarAheadIsOutOfRangeAndSealsNothing) {
  StartServer(1, MeshShape{1, 1});
  JoinRank(0);
  const std::string before = Snapshot();
  hsdp::v1::GetScheduleResponse response;
  grpc::Status s = Fetch(0, 1000, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::OUT_OF_RANGE);
  EXPECT_EQ(Snapshot(), before);
  s = Fetch(0, -1, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // A rank that never joined.
  s = Fetch(5, 0, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(Snapshot(), before);
}

TEST_F(ServiceTest,
       ControlCallsWithoutTheTokenAreUnauthenticatedAndChangeNothing) {
  StartServer(1, MeshShape{1, 1});
  JoinRank(0);
  hsdp::v1::GetScheduleResponse fetched;
  ASSERT_TRUE(Fetch(0, 0, &fetched).ok());
  const std::string before = Snapshot();
  hsdp::v1::Policy policy;
  policy.set_forward_prefetch_depth(3);
  for (const std::string token : {"", "wrong-token"}) {
    hsdp::v1::SetPolicyResponse set;
    EXPECT_EQ(SetPolicy(policy, &set, token).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
    hsdp::v1::DrainResponse drain;
    EXPECT_EQ(
        control_->Drain(Ctx(std::chrono::seconds(5), token).get(), {}, &drain)
            .error_code(),
        grpc::StatusCode::UNAUTHENTICATED);
    hsdp::v1::RequestCheckpointResponse checkpoint;
    EXPECT_EQ(control_
                  ->RequestCheckpoint(Ctx(std::chrono::seconds(5), token).get(),
                                      {}, &checkpoint)
                  .error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
    hsdp::v1::GetStatusResponse status;
    EXPECT_EQ(
        control_
            ->GetStatus(Ctx(std::chrono::seconds(5), token).get(), {}, &status)
            .error_code(),
        grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_EQ(status.job_id(), "")
        << "an unauthenticated call must not see job data";
    hsdp::v1::ControlServiceGetScheduleRequest sched_request;
    hsdp::v1::ControlServiceGetScheduleResponse sched;
    EXPECT_EQ(control_
                  ->GetSchedule(Ctx(std::chrono::seconds(5), token).get(),
                                sched_request, &sched)
                  .error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  EXPECT_EQ(Snapshot(), before);
  // The right token works (and does change things).
  hsdp::v1::SetPolicyResponse set;
  ASSERT_TRUE(SetPolicy(policy, &set).ok());
  EXPECT_EQ(set.policy_version(), 2);
  EXPECT_EQ(set.effective_step(), 1);
}

// --- Long polls, drain, checkpoint, store, heartbeats.

TEST_F(ServiceTest, ReadBeyondWindowWaitsForTheSlowestRank) {
  StartServer(2, MeshShape{1, 2});
  JoinRank(0);
  JoinRank(1);
  // Window: step <= floor + 1 + read_ahead(4) with floor = -1 before any
  // report: steps 0..4.
  hsdp::v1::GetScheduleResponse response;
  ASSERT_TRUE(Fetch(0, 4, &response).ok());
  // Step 5 waits: with a short deadline it runs out.
  grpc::Status s = Fetch(0, 5, &response, milliseconds(300));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  // A waiting read is released as soon as both ranks completed step 0.
  std::atomic<bool> released{false};
  grpc::Status waited;
  std::thread reader([&] {
    hsdp::v1::GetScheduleResponse r;
    waited = Fetch(0, 5, &r);
    released = true;
  });
  std::this_thread::sleep_for(milliseconds(200));
  EXPECT_FALSE(released.load());
  ASSERT_TRUE(Report(0, 0).ok());
  std::this_thread::sleep_for(milliseconds(100));
  EXPECT_FALSE(released.load()) << "one rank's report must not open the window";
  ASSERT_TRUE(Report(1, 0).ok());
  reader.join();
  EXPECT_TRUE(waited.ok()) << waited.error_message();
}

TEST_F(ServiceTest, ShutdownReleasesLongPollsPromptly) {
  ServerOptions options;
  options.shutdown_deadline = absl::Seconds(20);
  StartServer(2, MeshShape{1, 2}, options);
  JoinRank(0);
  JoinRank(1);
  grpc::Status schedule_status, store_status;
  std::thread poll([&] {
    hsdp::v1::GetScheduleResponse r;
    schedule_status = Fetch(0, 6, &r);  // beyond the window: waits
  });
  std::thread store([&] {
    hsdp::v1::StoreGetRequest request;
    request.set_job_id(kJob);
    request.set_generation(server_->membership().generation());
    request.set_key("never-set");
    request.set_timeout_ms(30'000);
    hsdp::v1::StoreGetResponse response;
    store_status = worker_->StoreGet(Ctx().get(), request, &response);
  });
  std::this_thread::sleep_for(milliseconds(300));
  const auto start = std::chrono::steady_clock::now();
  server_->Shutdown();
  // Shutdown itself does not sit out its deadline for the (idle, connected)
  // client channel either.
  const auto took = std::chrono::steady_clock::now() - start;
  poll.join();
  store.join();
  EXPECT_LT(took, std::chrono::seconds(3))
      << "long polls must not hold shutdown to its deadline";
  EXPECT_EQ(schedule_status.error_code(), grpc::StatusCode::UNAVAILABLE)
      << schedule_status.error_message();
  EXPECT_EQ(store_status.error_code(), grpc::StatusCode::UNAVAILABLE)
      << store_status.error_message();
}

TEST_F(ServiceTest, DrainAndCheckpointShapeTheNextSteps) {
  StartServer(1, MeshShape{1, 1});
  JoinRank(0);
  hsdp::v1::GetScheduleResponse response;
  ASSERT_TRUE(Fetch(0, 0, &response).ok());
  hsdp::v1::RequestCheckpointResponse checkpoint;
  ASSERT_TRUE(
      control_
          ->RequestCheckpoint(Ctx(std::chrono::seconds(5), kToken).get(), {},
                              &checkpoint)
          .ok());
  EXPECT_EQ(checkpoint.step(), 1);
  hsdp::v1::DrainResponse drain;
  ASSERT_TRUE(
      control_->Drain(Ctx(std::chrono::seconds(5), kToken).get(), {}, &drain)
          .ok());
  EXPECT_EQ(drain.last_step(), 1);
  ASSERT_TRUE(Fetch(0, 1, &response).ok());
  EXPECT_TRUE(response.schedule().checkpoint());
  EXPECT_FALSE(response.drained());
  response.Clear();
  ASSERT_TRUE(Fetch(0, 2, &response).ok());
  EXPECT_TRUE(response.drained());
  EXPECT_FALSE(response.has_schedule());
  hsdp::v1::GetStatusResponse status;
  ASSERT_TRUE(
      control_
          ->GetStatus(Ctx(std::chrono::seconds(5), kToken).get(), {}, &status)
          .ok());
  EXPECT_EQ(status.state(), hsdp::v1::JOB_STATE_DRAINING);
  EXPECT_EQ(status.drain_step(), 1);
  // The control read of a sealed step is the worker's schedule, byte for byte.
  hsdp::v1::ControlServiceGetScheduleRequest request;
  request.set_step(1);
  hsdp::v1::ControlServiceGetScheduleResponse sealed;
  ASSERT_TRUE(control_
                  ->GetSchedule(Ctx(std::chrono::seconds(5), kToken).get(),
                                request, &sealed)
                  .ok());
  hsdp::v1::GetScheduleResponse again;
  ASSERT_TRUE(Fetch(0, 1, &again).ok());
  EXPECT_EQ(sealed.schedule().SerializeAsString(),
            again.schedule().SerializeAsString());
}

TEST_F(ServiceTest, StoreBlocksUntilSetAndIsScopedByGeneration) {
  StartServer(2, MeshShape{1, 2});
  const hsdp::v1::JoinResponse joined = JoinRank(0);
  std::string value;
  grpc::Status got;
  std::thread getter([&] {
    hsdp::v1::StoreGetRequest request;
    request.set_job_id(kJob);
    request.set_generation(joined.generation());
    request.set_key("gloo/addr/1");
    request.set_timeout_ms(10'000);
    hsdp::v1::StoreGetResponse response;
    got = worker_->StoreGet(Ctx().get(), request, &response);
    value = response.value();
  });
  std::this_thread::sleep_for(milliseconds(100));
  hsdp::v1::StoreSetRequest set;
  set.set_job_id(kJob);
  set.set_generation(joined.generation());
  set.set_key("gloo/addr/1");
  set.set_value(std::string("\x01\x00\xff", 3));
  hsdp::v1::StoreSetResponse set_response;
  ASSERT_TRUE(worker_->StoreSet(Ctx().get(), set, &set_response).ok());
  getter.join();
  ASSERT_TRUE(got.ok()) << got.error_message();
  EXPECT_EQ(value, std::string("\x01\x00\xff", 3));

  hsdp::v1::StoreWaitRequest wait;
  wait.set_job_id(kJob);
  wait.set_generation(joined.generation());
  wait.add_keys("gloo/addr/1");
  wait.add_keys("gloo/addr/2");
  wait.set_timeout_ms(200);
  hsdp::v1::StoreWaitResponse wait_response;
  grpc::Status s = worker_->StoreWait(Ctx().get(), wait, &wait_response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_NE(s.error_message().find("gloo/addr/2"), std::string::npos)
      << s.error_message();

  // Another generation's scope is refused: a stale worker must re-form
  // first.
  set.set_generation(joined.generation() + 1);
  EXPECT_EQ(worker_->StoreSet(Ctx().get(), set, &set_response).error_code(),
            grpc::StatusCode::ABORTED);
}

// A worker dies mid-step: its schedule stream breaks from its side (as its
// closed connection does), the survivor reports the failed collective and
// confirms, and the next generation forms at once, long before the reform
// window (a minute here) or the heartbeat timeout would end the wait.
TEST_F(ServiceTest, ADeadWorkersBrokenStreamEndsTheReformWait) {
  StartServer(2, MeshShape{2, 1}, ServerOptions{}, absl::Seconds(60),
              absl::Seconds(60));
  const hsdp::v1::JoinResponse j0 = JoinRank(0);
  const hsdp::v1::JoinResponse j1 = JoinRank(1);
  {
    grpc::ClientContext context;
    hsdp::v1::WatchSchedulesRequest request;
    request.set_job_id(kJob);
    request.set_worker_id(j1.worker_id());
    request.set_generation(j1.generation());
    auto stream = worker_->WatchSchedules(&context, request);
    hsdp::v1::WatchSchedulesResponse message;
    ASSERT_TRUE(stream->Read(&message));  // the stream is up
    context.TryCancel();                  // the process is gone
    while (stream->Read(&message)) {
    }
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  hsdp::v1::ReportFailureRequest failure;
  failure.set_job_id(kJob);
  failure.set_worker_id(j0.worker_id());
  failure.set_generation(j0.generation());
  failure.set_step(0);
  failure.set_detail("AllReduce: connection closed by peer rank 1");
  hsdp::v1::ReportFailureResponse failed;
  ASSERT_TRUE(worker_->ReportFailure(Ctx().get(), failure, &failed).ok());
  hsdp::v1::AwaitGenerationResponse next;
  for (int64_t known = j0.generation();;) {
    hsdp::v1::AwaitGenerationRequest request;
    request.set_job_id(kJob);
    request.set_worker_id(j0.worker_id());
    request.set_generation(known);
    grpc::Status s = worker_->AwaitGeneration(
        Ctx(std::chrono::seconds(20)).get(), request, &next);
    ASSERT_TRUE(s.ok()) << s.error_message();
    if (next.outcome() != hsdp::v1::AWAIT_OUTCOME_ENDED) break;
  }
  ASSERT_EQ(next.outcome(), hsdp::v1::AWAIT_OUTCOME_FORMED);
  EXPECT_EQ(next.generation().generation(), j0.generation() + 1);
  ASSERT_EQ(next.generation().worker_ids_size(), 1);
  EXPECT_EQ(next.generation().worker_ids(0), j0.worker_id());
}

// A silent worker is lost; its generation ends; the survivor confirms and
// is told the next generation (without it), which the heartbeats then show.
TEST_F(ServiceTest, SilentWorkerIsLostAndTheSurvivorReforms) {
  StartServer(2, MeshShape{2, 1}, ServerOptions{}, absl::Seconds(1));
  const hsdp::v1::JoinResponse j0 = JoinRank(0);
  const hsdp::v1::JoinResponse j1 = JoinRank(1);
  // Worker 0 keeps beating (10x per timeout, so a loaded machine cannot lose
  // it) and, like its agent, waits in AwaitGeneration; worker 1 goes silent.
  std::atomic<bool> stop{false};
  std::thread beats([&] {
    while (!stop.load()) {
      hsdp::v1::HeartbeatRequest request;
      request.set_job_id(kJob);
      request.set_worker_id(j0.worker_id());
      request.set_generation(j0.generation());
      hsdp::v1::HeartbeatResponse beat;
      EXPECT_TRUE(worker_->Heartbeat(Ctx().get(), request, &beat).ok());
      std::this_thread::sleep_for(milliseconds(100));
    }
  });
  hsdp::v1::AwaitGenerationResponse next;
  ASSERT_NO_FATAL_FAILURE(AwaitPastTheEnd(j0, &next));
  stop = true;
  beats.join();
  ASSERT_EQ(next.outcome(), hsdp::v1::AWAIT_OUTCOME_FORMED);
  EXPECT_EQ(next.generation().generation(), j0.generation() + 1);
  EXPECT_EQ(next.generation().mesh().replicate(), 1);
  ASSERT_EQ(next.generation().worker_ids_size(), 1);
  EXPECT_EQ(next.generation().worker_ids(0), j0.worker_id());
  hsdp::v1::HeartbeatRequest request;
  request.set_job_id(kJob);
  request.set_worker_id(j0.worker_id());
  request.set_generation(next.generation().generation());
  hsdp::v1::HeartbeatResponse beat;
  ASSERT_TRUE(worker_->Heartbeat(Ctx().get(), request, &beat).ok());
  EXPECT_EQ(beat.generation(), j0.generation() + 1);
  EXPECT_EQ(beat.job_state(), hsdp::v1::JOB_STATE_DEGRADED);
  hsdp::v1::ListWorkersResponse workers;
  ASSERT_TRUE(control_
                  ->ListWorkers(Ctx(std::chrono::seconds(5), kToken).get(), {},
                                &workers)
                  .ok());
  ASSERT_EQ(workers.workers_size(), 2);
  EXPECT_EQ(workers.workers(0).worker_id(), j0.worker_id());
  EXPECT_EQ(workers.workers(0).state(), hsdp::v1::WORKER_STATE_ALIVE);
  EXPECT_EQ(workers.workers(1).worker_id(), j1.worker_id());
  EXPECT_EQ(workers.workers(1).state(), hsdp::v1::WORKER_STATE_LOST);
  EXPECT_NE(
      server_->metrics().Serialize().find("hsdp_workers{state=\"lost\"} 1"),
      std::string::npos);
  // The lost worker's calls are refused: it must join again, as a new worker.
  hsdp::v1::GetScheduleResponse response;
  hsdp::v1::GetScheduleRequest fetch;
  fetch.set_job_id(kJob);
  fetch.set_worker_id(j1.worker_id());
  fetch.set_generation(j1.generation());
  EXPECT_EQ(worker_->GetSchedule(Ctx().get(), fetch, &response).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  // The survivor's old generation is over for schedule reads too.
  fetch.set_worker_id(j0.worker_id());
  EXPECT_EQ(worker_->GetSchedule(Ctx().get(), fetch, &response).error_code(),
            grpc::StatusCode::ABORTED);
  const hsdp::v1::JoinResponse again = JoinRank(1);
  EXPECT_NE(again.worker_id(), j1.worker_id());
  EXPECT_EQ(again.worker_state(), hsdp::v1::WORKER_STATE_JOINING);
}

// --- Health, reflection, metrics.

// grpc.health.v1.HealthCheckRequest{service} encoded by hand (no health stubs
// are packaged).
grpc::Status HealthCheck(grpc::Channel* channel, const std::string& service,
                         int* serving) {
  std::string request;
  request.push_back(0x0a);  // field 1, length-delimited
  request.push_back(static_cast<char>(service.size()));
  request += service;
  grpc::Slice slice(request);
  grpc::ByteBuffer request_buffer(&slice, 1), response_buffer;
  grpc::GenericStub stub(channel->shared_from_this());
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(5));
  absl::Mutex mu;
  bool finished = false;
  grpc::Status status;
  stub.UnaryCall(&context, "/grpc.health.v1.Health/Check", grpc::StubOptions(),
                 &request_buffer, &response_buffer, [&](grpc::Status s) {
                   absl::MutexLock lock(&mu);
                   status = s;
                   finished = true;
                 });
  absl::MutexLock lock(&mu);
  mu.Await(absl::Condition(&finished));
  if (!status.ok()) return status;
  std::vector<grpc::Slice> slices;
  response_buffer.Dump(&slices);
  std::string response;
  for (const auto& s : slices)
    response.append(reinterpret_cast<const char*>(s.begin()), s.size());
  // HealthCheckResponse{status = 1 (varint)}; an empty message means UNKNOWN
  // (0).
  *serving = response.size() >= 2 && response[0] == 0x08 ? response[1] : 0;
  return status;
}

TEST_F(ServiceTest, HealthReportsEveryServiceServing) {
  StartServer(1, MeshShape{1, 1});
  constexpr int kServing = 1;
  for (const std::string service :
       {"", kCoordinatorServiceName, kControlServiceName}) {
    int serving = -1;
    grpc::Status s = HealthCheck(channel_.get(), service, &serving);
    ASSERT_TRUE(s.ok()) << "'" << service << "': " << s.error_message();
    EXPECT_EQ(serving, kServing) << "'" << service << "'";
  }
  int serving = -1;
  EXPECT_EQ(
      HealthCheck(channel_.get(), "no.such.Service", &serving).error_code(),
      grpc::StatusCode::NOT_FOUND);
}

// Asks the reflection service to list services, over a generic bidi stream
// (no reflection stubs are packaged): ServerReflectionRequest{list_services:
// ""} is field 7, length 0.
std::string ListServicesByReflection(const std::shared_ptr<grpc::Channel>& ch) {
  grpc::GenericStub stub(ch);
  grpc::CompletionQueue cq;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(5));
  auto call = stub.PrepareCall(
      &context,
      "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  void* tag;
  bool ok = false;
  auto step = [&](void* expected) {
    return cq.Next(&tag, &ok) && ok && tag == expected;
  };
  call->StartCall(reinterpret_cast<void*>(1));
  if (!step(reinterpret_cast<void*>(1))) return "";
  const std::string request("\x3a\x00", 2);
  grpc::Slice slice(request);
  grpc::ByteBuffer out(&slice, 1), in;
  call->Write(out, reinterpret_cast<void*>(2));
  if (!step(reinterpret_cast<void*>(2))) return "";
  call->Read(&in, reinterpret_cast<void*>(3));
  if (!step(reinterpret_cast<void*>(3))) return "";
  call->WritesDone(reinterpret_cast<void*>(4));
  step(reinterpret_cast<void*>(4));
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  step(reinterpret_cast<void*>(5));
  std::vector<grpc::Slice> slices;
  in.Dump(&slices);
  std::string response;
  for (const auto& sl : slices) {
    response.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  }
  return response;
}

TEST_F(ServiceTest, ReflectionListsBothServices) {
  StartServer(1, MeshShape{1, 1});
  const std::string listed = ListServicesByReflection(channel_);
  EXPECT_NE(listed.find(kCoordinatorServiceName), std::string::npos) << listed;
  EXPECT_NE(listed.find(kControlServiceName), std::string::npos) << listed;
}

TEST_F(ServiceTest, StopServingTurnsHealthNotServingAndReleasesPolls) {
  StartServer(1, MeshShape{1, 1});
  JoinRank(0);
  grpc::Status polled;
  std::thread poll([&] {
    hsdp::v1::GetScheduleResponse r;
    polled = Fetch(0, 7, &r);  // beyond the window: waits
  });
  std::this_thread::sleep_for(milliseconds(200));
  server_->StopServing();
  poll.join();
  EXPECT_EQ(polled.error_code(), grpc::StatusCode::UNAVAILABLE)
      << polled.error_message();
  constexpr int kNotServing = 2;
  for (const std::string service :
       {"", kCoordinatorServiceName, kControlServiceName}) {
    int serving = -1;
    ASSERT_TRUE(HealthCheck(channel_.get(), service, &serving).ok());
    EXPECT_EQ(serving, kNotServing) << "'" << service << "'";
  }
  // Still answering while draining: status is readable.
  hsdp::v1::GetStatusResponse status;
  EXPECT_TRUE(
      control_
          ->GetStatus(Ctx(std::chrono::seconds(5), kToken).get(), {}, &status)
          .ok());
}

TEST_F(ServiceTest, MetricsEndpointServesWorkerAndReportMetrics) {
  ServerOptions options;
  options.metrics_listen = "127.0.0.1:0";
  StartServer(2, MeshShape{1, 2}, options);
  ASSERT_GT(server_->metrics_port(), 0);
  JoinRank(0);
  JoinRank(1);
  hsdp::v1::GetScheduleResponse response;
  ASSERT_TRUE(Fetch(0, 0, &response).ok());
  ASSERT_TRUE(Report(1, 0).ok());
  const std::string body = HttpGet(server_->metrics_port(), "/metrics");
  EXPECT_NE(body.find("200 OK"), std::string::npos) << body;
  EXPECT_NE(body.find("hsdp_workers{state=\"alive\"} 2"), std::string::npos)
      << body;
  EXPECT_NE(body.find("hsdp_sealed_step 0"), std::string::npos) << body;
  EXPECT_NE(body.find("hsdp_get_schedule_seconds_count 1"), std::string::npos)
      << body;
  EXPECT_NE(body.find("hsdp_rank_loss{rank=\"1\"} 2.5"), std::string::npos)
      << body;
  EXPECT_NE(body.find("hsdp_rank_step_seconds{rank=\"1\"} 0.125"),
            std::string::npos)
      << body;
  EXPECT_NE(body.find("hsdp_rank_peak_memory_bytes{rank=\"1\"} 1048576"),
            std::string::npos)
      << body;
  EXPECT_NE(body.find("hsdp_policy_version 1"), std::string::npos) << body;
}

TEST(ServerStartTest, BadJobSpecsAreRefused) {
  JobConfig job;
  job.job_id = kJob;
  job.world_size = 4;
  job.mesh = MeshShape{3, 2};
  ServerOptions options;
  options.listen = "127.0.0.1:0";
  auto server = CoordinatorServer::Start(job, options);
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(server.status().message().find("3x2"), std::string::npos)
      << server.status();
  job.mesh = MeshShape{2, 2};
  job.policy.set_backward_prefetch_depth(-2);
  server = CoordinatorServer::Start(job, options);
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
  job.policy.Clear();
  options.tls_cert_pem = "cert only";
  server = CoordinatorServer::Start(job, options);
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace hsdp::coordinator

namespace hsdp::coordinator {
namespace {

TEST(GrpcStatusTest, CodesAndMessagesRoundTrip) {
  for (int code = 1; code <= 16; ++code) {
    const absl::Status in(static_cast<absl::StatusCode>(code), "why");
    const grpc::Status wire = ToGrpcStatus(in);
    EXPECT_EQ(static_cast<int>(wire.error_code()), code);
    EXPECT_EQ(wire.error_message(), "why");
    EXPECT_EQ(FromGrpcStatus(wire), in);
  }
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  EXPECT_TRUE(FromGrpcStatus(grpc::Status::OK).ok());
  // A code outside the shared range never reaches the wire as itself.
  EXPECT_EQ(ToGrpcStatus(absl::Status(static_cast<absl::StatusCode>(42), "x"))
                .error_code(),
            grpc::StatusCode::UNKNOWN);
}

}  // namespace
}  // namespace hsdp::coordinator
