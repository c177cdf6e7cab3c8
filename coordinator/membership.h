// Membership of one job: rank assignment, the job's model (unit list),
// heartbeats, lost workers, the generation and the job state.
//
// Join rules:
// - Rank hint given (0 <= hint < world): a free slot is taken; a slot whose
//   holder is LOST, or is a restored-but-unconfirmed holder on the same host
//   (see Restart), is taken over; a slot held by an ALIVE or FINISHED worker
//   (or restored on another host) is ALREADY_EXISTS "rank N is taken by host
//   H". A hint outside [0, world) is INVALID_ARGUMENT.
// - No hint: the lowest free slot, else the lowest LOST slot; none left is
//   RESOURCE_EXHAUSTED.
// - The first joiner's model name + unit list become the job's model
//   (persisted); a later joiner with a different model or list is
//   FAILED_PRECONDITION naming the first differing unit. A malformed unit list
//   is INVALID_ARGUMENT.
// - The first joiner that reports training settings makes them the job's
//   (persisted); a later joiner whose settings differ is FAILED_PRECONDITION
//   naming the field (CompareTrainingSpecs).
// - A refused join changes nothing.
//
// Heartbeats: a worker not heard from for `heartbeat_timeout` (by the
// injectable clock) is marked LOST by SweepHeartbeats() (Join sweeps too), the
// job becomes DEGRADED and the generation is bumped (once per sweep that loses
// someone). Taking over a LOST slot does not bump it again.
//
// Restart: with a StateStore, the model, generation and members (rank, host,
// device) are persisted. After a restart the members come back "restored":
// alive for status purposes, their heartbeat clock starting at the restart. A
// heartbeat confirms them (workers simply continue); a Join with their rank
// hint from the same hostname takes the slot over (the worker re-joining after
// a coordinator restart) without a generation bump; if they stay silent they
// become LOST like anyone else. The draining flag is not persisted: the server
// re-applies it from ScheduleLog::drain_step() at start-up.
//
// Job state: FINISHED when every rank finished; else DRAINING when
// SetDraining(true); else DEGRADED when some slot is LOST; else WAITING when a
// slot is free; else RUNNING.
#ifndef HSDP_COORDINATOR_MEMBERSHIP_H_
#define HSDP_COORDINATOR_MEMBERSHIP_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/mesh.h"
#include "common/units.h"
#include "coordinator/state_store.h"
#include "hsdp/v1/common.pb.h"

namespace hsdp::coordinator {

struct JoinArgs {
  // Unset or negative: no preference.
  std::optional<int> rank_hint;
  std::string hostname;
  std::string device;
  std::string model;
  UnitList units;
  // The worker's training settings; unset: not checked.
  std::optional<hsdp::v1::TrainingSpec> training;
};

struct JoinResult {
  int rank = 0;
  MeshCoord coord;
  int64_t generation = 0;
  // This join established the job's model.
  bool established_model = false;
  // This join took over a LOST or restored slot.
  bool replaced = false;
};

// A snapshot of one slot, for ListWorkers/status/metrics.
struct WorkerSnapshot {
  int rank = 0;
  hsdp::v1::WorkerState state = hsdp::v1::WORKER_STATE_UNSPECIFIED;
  std::string hostname;
  std::string device;
  MeshCoord coord;
  absl::Duration heartbeat_age;
  // Restored from the store and not confirmed by a heartbeat or join since.
  bool restored = false;
  // Step from the latest heartbeat (-1 if none).
  int64_t step = -1;
};

// Thread-safe; every method takes the internal mutex.
class Membership {
 public:
  struct Options {
    std::string job_id;
    int world_size = 1;
    MeshShape mesh;
    absl::Duration heartbeat_timeout = absl::Seconds(10);
    // Null: Clock::Real().
    Clock* clock = nullptr;
  };

  // Validates the options (world >= 1, mesh matches world: INVALID_ARGUMENT)
  // and restores the model, generation and members from `store` when it holds
  // them (store may be null; must outlive this object). A store whose job
  // record names a different job id, world or mesh is FAILED_PRECONDITION; a
  // store without a job record gets this job's record.
  static absl::StatusOr<std::unique_ptr<Membership>> Create(Options options,
                                                            StateStore* store);

  Membership(const Membership&) = delete;
  Membership& operator=(const Membership&) = delete;

  // NOT_FOUND "job X is not served here (this coordinator runs job Y)" for
  // another id.
  absl::Status CheckJobId(absl::string_view job_id) const;

  absl::StatusOr<JoinResult> Join(const JoinArgs& args);

  // Records a heartbeat. NOT_FOUND if the rank holds no slot (never joined /
  // out of range), FAILED_PRECONDITION if it was declared LOST (it must
  // re-join). `step` is informational.
  absl::Status Heartbeat(int rank, int64_t step);

  // OK iff `rank` currently holds a live (alive, restored or finished) slot;
  // NOT_FOUND or FAILED_PRECONDITION (lost) otherwise. For per-rank RPCs
  // (GetSchedule, ReportStep).
  absl::Status CheckMember(int rank) const;

  // Marks the rank FINISHED (it reported its last step). Same errors as
  // CheckMember.
  absl::Status MarkFinished(int rank);

  // Marks workers silent for longer than the timeout LOST; bumps the generation
  // once if any was lost. Returns the ranks newly lost. Call periodically (e.g.
  // every timeout/4).
  std::vector<int> SweepHeartbeats();

  // Bumps the generation (persisted) and returns the new one, e.g. if the
  // service decides a restart requires a new rendezvous.
  int64_t BumpGeneration();

  void SetDraining(bool draining);

  hsdp::v1::JobState job_state() const;
  int64_t generation() const;
  int workers_alive()
      const;  // ALIVE + restored (not LOST, not FINISHED, not free)
  std::vector<WorkerSnapshot> Workers() const;  // joined slots, by rank
  // The job's model, empty until the first join (or restored).
  std::string model() const;
  UnitList units() const;
  bool has_model() const;
  // The training settings the first worker reported (unset until then).
  std::optional<hsdp::v1::TrainingSpec> training() const;

  const std::string& job_id() const { return options_.job_id; }
  int world_size() const { return options_.world_size; }
  const MeshShape& mesh() const { return options_.mesh; }
  absl::Duration heartbeat_timeout() const {
    return options_.heartbeat_timeout;
  }

 private:
  enum class SlotState { kFree, kAlive, kRestored, kLost, kFinished };
  struct Slot {
    SlotState state = SlotState::kFree;
    std::string hostname;
    std::string device;
    absl::Time last_heartbeat;
    int64_t step = -1;
  };

  Membership(Options options, StateStore* store);
  absl::Status RestoreLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckMemberLocked(int rank) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<int> PickRankLocked(const JoinArgs& args) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::vector<int> SweepLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status PersistLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  StateStore* const store_;

  mutable absl::Mutex mu_;
  std::vector<Slot> slots_ ABSL_GUARDED_BY(mu_);
  std::string model_ ABSL_GUARDED_BY(mu_);
  UnitList units_ ABSL_GUARDED_BY(mu_);
  std::optional<hsdp::v1::TrainingSpec> training_ ABSL_GUARDED_BY(mu_);
  int64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace hsdp::coordinator

#endif  // HSDP_COORDINATOR_MEMBERSHIP_H_
