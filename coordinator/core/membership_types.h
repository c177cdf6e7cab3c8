// The values Membership's calls take and return, and the listener it tells
// about generations and commits (membership.h has the rules).
#ifndef HSDP_COORDINATOR_CORE_MEMBERSHIP_TYPES_H_
#define HSDP_COORDINATOR_CORE_MEMBERSHIP_TYPES_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "common/units.h"
#include "coordinator/core/generation_context.h"
#include "hsdp/mesh.h"
#include "hsdp/v1/common.pb.h"
#include "hsdp/v1/control_service.pb.h"
#include "hsdp/v1/coordinator_service.pb.h"

namespace hsdp::coordinator {

// History entries kept per worker (the oldest are dropped).
inline constexpr int kMaxWorkerHistory = 32;
// Workers that left (lost, evicted, finished) kept for ListWorkers.
inline constexpr int kMaxDepartedWorkers = 256;

struct JoinArgs {
  // Unset or negative: no preference. Used in the open first generation.
  std::optional<int> rank_hint;
  std::string hostname;
  std::string device;
  std::string model;
  UnitList units;
  // Non-zero: re-joining a restarted coordinator as this worker.
  int64_t worker_id = 0;
  // The worker's training settings; unset: not checked.
  std::optional<hsdp::v1::TrainingSpec> training;
};

struct JoinResult {
  int64_t worker_id = 0;
  // A member of the current generation: `rank`, `coord` and `generation` say
  // where.
  bool member = false;
  int rank = -1;
  MeshCoord coord;
  hsdp::v1::Generation generation;
  hsdp::v1::WorkerState state = hsdp::v1::WORKER_STATE_UNSPECIFIED;
  // This join established the job's model.
  bool established_model = false;
  // This join took a restored place back (coordinator restart).
  bool replaced = false;
};

struct HeartbeatResult {
  int64_t worker_id = 0;
  // Rank in the current generation (running), -1 otherwise.
  int rank = -1;
  int64_t generation = 0;
  hsdp::v1::JobState job_state = hsdp::v1::JOB_STATE_UNSPECIFIED;
  hsdp::v1::WorkerState worker_state = hsdp::v1::WORKER_STATE_UNSPECIFIED;
  std::string message;
};

// A worker-scoped call resolved to a member of the current generation.
struct MemberContext {
  int64_t worker_id = 0;
  int rank = 0;
  GenerationContext generation;
};

struct AwaitResult {
  hsdp::v1::AwaitOutcome outcome = hsdp::v1::AWAIT_OUTCOME_UNSPECIFIED;
  hsdp::v1::Generation generation;
  hsdp::v1::WorkerState worker_state = hsdp::v1::WORKER_STATE_UNSPECIFIED;
  std::string message;
};

struct CommitResult {
  int64_t step = 0;
  bool reform_after = false;
};

struct EvictResult {
  int64_t worker_id = 0;
  // The generation that ends without it, or -1.
  int64_t generation = -1;
};

// A snapshot of one worker, for ListWorkers/status/metrics.
struct WorkerSnapshot {
  int64_t worker_id = 0;
  // Rank in the current generation, -1 when not a member.
  int rank = -1;
  hsdp::v1::WorkerState state = hsdp::v1::WORKER_STATE_UNSPECIFIED;
  std::string hostname;
  std::string device;
  MeshCoord coord;
  absl::Duration heartbeat_age;
  // Restored from the store and not confirmed by a heartbeat or join since.
  bool restored = false;
  // Step from the latest heartbeat (-1 if none).
  int64_t step = -1;
  // The generation it is (or was last) a member of, -1 if none, and its role.
  int64_t generation = -1;
  hsdp::v1::GenerationRole role = hsdp::v1::GENERATION_ROLE_UNSPECIFIED;
  std::vector<hsdp::v1::WorkerEvent> history;
};

// The elastic state, for GetStatus.
struct MembershipStatus {
  hsdp::v1::JobState job_state = hsdp::v1::JOB_STATE_UNSPECIFIED;
  int64_t generation = 0;
  int replicas = 0;
  int members_alive = 0;
  int standby = 0;
  int joining = 0;
  int64_t last_committed_step = -1;
  // While a generation ends: its members that confirmed so far.
  int confirmed = 0;
  std::string message;
  int64_t failures = 0;
  std::optional<hsdp::v1::FailureRecord> last_failure;
  // The current generation's shard groups that span hosts, one line each
  // (ShardGroupsAcrossHosts); empty when each lies inside one host.
  std::vector<std::string> topology_warnings;
};

// What Membership tells the rest of the coordinator. Called with the
// Membership lock held: implementations must not call back into Membership
// (they may call the schedule log, the store, metrics).
class MembershipListener {
 public:
  virtual ~MembershipListener() = default;
  // `generation` ended (its rendezvous and votes are over).
  virtual void OnGenerationEnded(int64_t generation,
                                 hsdp::v1::FailureCause cause) = 0;
  virtual void OnGenerationFormed(const hsdp::v1::Generation& generation) = 0;
  // `generation` formed (the open first one: once its last rank was taken)
  // with shard groups that span hosts, one line each, and its
  // hsdp.v1.Generation.host_group_size.
  virtual void OnShardGroupsAcrossHosts(
      int64_t /*generation*/, int /*host_group_size*/,
      const std::vector<std::string>& /*warnings*/) {}
  // `commit.step` committed in `generation` (durably), with the answer every
  // voter gets: reform_after when the generation ends at this step boundary
  // (that end is announced after this call).
  virtual void OnStepCommitted(int64_t generation,
                               const CommitResult& commit) = 0;
  // The first step after a failure committed: the failure's cost is known.
  virtual void OnRecovered(const hsdp::v1::FailureRecord& failure) = 0;
  // The newest step every rank saved a checkpoint of, or -1: where a job
  // whose state no live worker holds any more restarts.
  virtual int64_t LastCheckpointStep() = 0;
};

}  // namespace hsdp::coordinator

#endif  // HSDP_COORDINATOR_CORE_MEMBERSHIP_TYPES_H_
