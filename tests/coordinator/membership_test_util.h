// A Membership on a fake clock, and the worker side of its protocol driven
// from test threads (votes, confirmations), for the membership tests.
#ifndef HSDP_TESTS_COORDINATOR_MEMBERSHIP_TEST_UTIL_H_
#define HSDP_TESTS_COORDINATOR_MEMBERSHIP_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <future>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "coordinator/core/membership.h"
#include "coordinator/core/state_store.h"
#include "tests/coordinator/core_test_util.h"

namespace hsdp::coordinator::testing {

inline constexpr absl::Duration kHeartbeatTimeout = absl::Seconds(10);
inline constexpr absl::Duration kReformWindow = absl::Seconds(2);
inline constexpr absl::Duration kJoinWait = absl::Seconds(30);
// Real-time bound of one long poll in these tests: they return on events.
inline constexpr absl::Duration kPoll = absl::Seconds(10);

// Records what the listener heard, in order.
class RecordingListener final : public MembershipListener {
 public:
  void OnGenerationEnded(int64_t generation,
                         hsdp::v1::FailureCause cause) override {
    events.push_back(absl::StrCat("ended ", generation, " ",
                                  hsdp::v1::FailureCause_Name(cause)));
  }
  void OnGenerationFormed(const hsdp::v1::Generation& generation) override {
    events.push_back(absl::StrCat("formed ", generation.generation()));
  }
  void OnShardGroupsAcrossHosts(
      int64_t generation, int host_group_size,
      const std::vector<std::string>& warnings) override {
    host_group_sizes.push_back(host_group_size);
    for (const std::string& warning : warnings) {
      topology.push_back(
          absl::StrCat("generation ", generation, ": ", warning));
    }
  }
  void OnStepCommitted(int64_t generation,
                       const CommitResult& commit) override {
    events.push_back(absl::StrCat("committed ", generation, ":", commit.step));
    answers.push_back(absl::StrCat(generation, ":", commit.step,
                                   commit.reform_after ? " reform" : ""));
  }
  void OnRecovered(const hsdp::v1::FailureRecord& failure) override {
    recovered.push_back(failure);
  }
  int64_t LastCheckpointStep() override { return last_checkpoint_step; }
  // What LastCheckpointStep answers.
  int64_t last_checkpoint_step = -1;
  // Written under Membership's lock, read by the test thread after the calls
  // returned.
  std::vector<std::string> events;
  std::vector<hsdp::v1::FailureRecord> recovered;
  // The commit answers heard: "generation:step", " reform" when it ended
  // there.
  std::vector<std::string> answers;
  // What OnShardGroupsAcrossHosts heard: the host group sizes, and one line
  // per shard group.
  std::vector<int> host_group_sizes;
  std::vector<std::string> topology;
};

// The elastic options a test may change.
struct ElasticSettings {
  int min_replicas = 1;
  absl::Duration reform_window = kReformWindow;
  absl::Duration join_wait = kJoinWait;
  absl::Duration pause_threshold = absl::ZeroDuration();
};

class MembershipFixture : public ::testing::Test {
 protected:
  using Settings = ElasticSettings;

  std::unique_ptr<Membership> Make(MeshShape mesh, StateStore* store = nullptr,
                                   Settings settings = Settings()) {
    Membership::Options options;
    options.job_id = "job";
    options.world_size = mesh.world_size();
    options.mesh = mesh;
    options.heartbeat_timeout = kHeartbeatTimeout;
    options.min_replicas = settings.min_replicas;
    options.reform_window = settings.reform_window;
    options.join_wait = settings.join_wait;
    options.pause_threshold = settings.pause_threshold;
    options.clock = &clock_;
    auto m = Membership::Create(options, store);
    EXPECT_TRUE(m.ok()) << m.status();
    if (!m.ok()) return nullptr;
    (*m)->SetListener(&listener_);
    return std::move(*m);
  }

  static JoinArgs Args(std::optional<int> hint, const std::string& host,
                       UnitList units = MakeUnits(2)) {
    JoinArgs args;
    args.rank_hint = hint;
    args.hostname = host;
    args.device = "cpu";
    args.model = "gpt-tiny";
    args.units = std::move(units);
    return args;
  }

  // Joins every rank of the open first generation; worker ids by rank.
  std::vector<int64_t> JoinAll(Membership& m) {
    std::vector<int64_t> ids;
    for (int r = 0; r < m.world_size(); ++r) {
      absl::StatusOr<JoinResult> j = m.Join(Args(r, absl::StrCat("host-", r)));
      EXPECT_TRUE(j.ok()) << j.status();
      ids.push_back(j.ok() ? j->worker_id : 0);
    }
    return ids;
  }

  // A new worker joining a running job.
  int64_t JoinLate(Membership& m, const std::string& host) {
    absl::StatusOr<JoinResult> j = m.Join(Args(std::nullopt, host));
    EXPECT_TRUE(j.ok()) << j.status();
    return j.ok() ? j->worker_id : 0;
  }

  // Every id in `ids` votes `step` of `generation` at once (one thread each);
  // results in the same order.
  static std::vector<absl::StatusOr<CommitResult>> VoteAll(
      Membership& m, const std::vector<int64_t>& ids, int64_t generation,
      int64_t step) {
    std::vector<absl::StatusOr<CommitResult>> results(
        ids.size(), absl::UnknownError("not run"));
    std::vector<std::thread> threads;
    for (size_t i = 0; i < ids.size(); ++i) {
      threads.emplace_back([&, i] {
        results[i] =
            m.CommitStep(ids[i], generation, step, absl::Now() + kPoll);
      });
    }
    for (auto& t : threads) t.join();
    return results;
  }

  // The current members commit `step` (all must succeed).
  static void Commit(Membership& m, int64_t step) {
    const hsdp::v1::Generation g = m.current_generation();
    const std::vector<int64_t> ids(g.worker_ids().begin(),
                                   g.worker_ids().end());
    for (const auto& r : VoteAll(m, ids, g.generation(), step)) {
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(r->step, step);
    }
  }

  // AwaitGeneration on its own thread.
  static std::future<absl::StatusOr<AwaitResult>> AwaitAsync(Membership& m,
                                                             int64_t id,
                                                             int64_t known) {
    return std::async(std::launch::async, [&m, id, known] {
      return m.AwaitGeneration(id, known, absl::Now() + kPoll);
    });
  }

  // Heartbeats from `ids` (keeps them alive while the clock moves).
  static void Beat(Membership& m, const std::vector<int64_t>& ids) {
    for (int64_t id : ids) {
      EXPECT_TRUE(m.Heartbeat(id, -1, 0).ok()) << id;
    }
  }

  static hsdp::v1::WorkerState StateOf(Membership& m, int64_t id) {
    for (const WorkerSnapshot& w : m.Workers()) {
      if (w.worker_id == id) return w.state;
    }
    return hsdp::v1::WORKER_STATE_UNSPECIFIED;
  }

  static std::vector<int64_t> Members(Membership& m) {
    const hsdp::v1::Generation g = m.current_generation();
    return std::vector<int64_t>(g.worker_ids().begin(), g.worker_ids().end());
  }

  FakeClock clock_;
  RecordingListener listener_;
};

}  // namespace hsdp::coordinator::testing

#endif  // HSDP_TESTS_COORDINATOR_MEMBERSHIP_TEST_UTIL_H_
