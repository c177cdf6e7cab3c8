// Membership of one job: workers (one id per process incarnation), the job's
// model, heartbeats, and the generations — one fixed membership and mesh each
// — with the commit of every step. The protocol a worker follows is in
// worker/agent/ELASTIC.md; the rules the coordinator follows are here.
//
// Workers. Join hands out a new worker id (never reused). The first
// generation is "open": a joiner takes a free rank at once: its hint (a hint
// held by a live worker is ALREADY_EXISTS, outside [0, world)
// INVALID_ARGUMENT); without one, by host, since a shard group (ranks
// [k*S, (k+1)*S)) is meant to lie inside one host: the lowest free rank of
// the first shard group whose taken ranks are all on the joiner's host, else
// the lowest free rank of the first shard group nobody took yet, else the
// lowest free rank (also for a joiner that reports no host). A generation
// whose shard group spans hosts still forms; Status() and the listener say
// which (ShardGroupsAcrossHosts). Once every rank is taken it is active, and
// later joiners wait (JOINING) in AwaitGeneration for a generation that
// includes them. Non-members (joining or standby) are capped at the world
// size (RESOURCE_EXHAUSTED beyond). The first joiner's model name and unit
// list become the job's; a later joiner with another model is
// FAILED_PRECONDITION naming the first differing unit, a malformed unit list
// INVALID_ARGUMENT. The first joiner that reports training settings makes them
// the job's (persisted); a later joiner whose settings differ is
// FAILED_PRECONDITION naming the field (CompareTrainingSpecs). A refused join
// changes nothing.
//
// A generation ends (ENDING) when one of its members
// - is lost: no heartbeat within `heartbeat_timeout` (Tick(); while the first
//   generation is still open the rank is simply freed),
// - reports a failed collective (ReportFailure: at once, no heartbeat wait),
// - was evicted, or joiners can complete another replica group (then at the
//   next step boundary — the commit of a step — or after `join_wait` without
//   one, aborting the step in flight).
// Members report in while it ends: by calling AwaitGeneration (their agents'
// watcher confirms within milliseconds) or by the ReportFailure that ended
// it. The next one is formed as soon as every member is accounted for, and
// at the latest once `reform_window` passed. A member is accounted for when
// it reported in, left (lost, evicted, finished), or is gone: its schedule
// stream of that generation broke from its side (ScheduleStreamLost: its
// process died, so its connection closed) and it has started no call since.
// A member that is merely slow (a long step, a loaded host, a stopped
// process) keeps its connection, so it is waited for, up to the window: it
// is not dropped before. Any call it starts later (a heartbeat,
// AwaitGeneration, ReportFailure, CommitStep) takes "gone" back; a wake-up
// of a long poll it started earlier does not (a dead worker's poll goes on
// until its deadline). A member that streams no schedules (an older agent)
// is waited for until the window.
// The next generation is formed (generation_plan.h) from the members that
// reported in (the holders of the state), the standby workers and the
// joiners, starting at the last committed step + 1. The others stand by.
// Too few workers for min_replicas groups: no generation until more join
// (the job WAITs; the holders keep the state). A shard index without a live
// holder: the job FAILs (the hook to restart from the latest checkpoint
// instead is NoLiveCopy()).
//
// Steps commit in two phases: every member votes (CommitStep) after the
// step's collectives and before its optimizer step; the last vote commits the
// step for all (persisted first); a generation that ends before the last vote
// aborts the step (ABORTED) for every voter, and the next generation trains it
// again. A step commits once: a re-vote of a committed step answers the same.
//
// Restart: with a StateStore, the model, workers (id, host, device, state,
// history), the current generation and the failure record are persisted on
// every change, and the last committed step in its own small file on every
// commit. After a restart live workers come back "restored" (heartbeat clock
// from the restart); a heartbeat, or a Join carrying their worker id (or, for
// clients without ids, their rank hint from the same host), confirms them in
// place, without a new generation; silent ones are lost like anyone else.
// Votes and confirmations are not persisted: workers retry and re-send them.
//
// Job state: FAILED (no live copy); else WAITING while the first generation
// has free ranks or no generation can be formed; FINISHED when every member
// finished; DRAINING when SetDraining(true); REFORMING while a generation
// ends; DEGRADED when running with fewer replica groups than the mesh;
// else RUNNING.
#ifndef HSDP_COORDINATOR_CORE_MEMBERSHIP_H_
#define HSDP_COORDINATOR_CORE_MEMBERSHIP_H_

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/units.h"
#include "coordinator/core/membership_types.h"
#include "hsdp/mesh.h"
#include "hsdp/v1/common.pb.h"
#include "hsdp/v1/coordinator_service.pb.h"

namespace hsdp::coordinator {

class StateStore;
struct FormationInput;
struct GenerationPlan;

// Thread-safe; every method takes the internal mutex. The long polls
// (AwaitGeneration, CommitStep) wait on it until their deadline.
class Membership {
 public:
  struct Options {
    std::string job_id;
    int world_size = 1;
    MeshShape mesh;
    absl::Duration heartbeat_timeout = absl::Seconds(10);
    // Generations of fewer replica groups are not formed (the job waits).
    int min_replicas = 1;
    // How long a joining worker (or an eviction) waits for a step boundary
    // before the generation is ended anyway.
    absl::Duration join_wait = absl::Seconds(60);
    // How long an ending generation waits, at most, for a live member whose
    // connection is up to report in (see the class comment).
    absl::Duration reform_window = absl::Seconds(5);
    // Null: Clock::Real().
    Clock* clock = nullptr;
    // Longer than this between two sweeps, the coordinator itself was not
    // running (SIGSTOP, a VM pause, a starved host): the time is not held
    // against workers — their heartbeats, and an ending generation's reform
    // window, are moved on by the gap. Zero: off (the server sets it above
    // its sweep period).
    absl::Duration pause_threshold = absl::ZeroDuration();
  };

  // Validates the options (world >= 1, mesh matches world, positive timeout,
  // 1 <= min_replicas <= mesh.replicate: INVALID_ARGUMENT) and restores the
  // state from `store` when it holds one (store may be null; must outlive
  // this object). A store whose job record names a different job id, world or
  // mesh is FAILED_PRECONDITION; a store without a job record gets this job's
  // record.
  static absl::StatusOr<std::unique_ptr<Membership>> Create(Options options,
                                                            StateStore* store);

  Membership(const Membership&) = delete;
  Membership& operator=(const Membership&) = delete;

  // Set once, before serving; must outlive this object.
  void SetListener(MembershipListener* listener) ABSL_LOCKS_EXCLUDED(mu_);

  // NOT_FOUND "job X is not served here (this coordinator runs job Y)" for
  // another id.
  absl::Status CheckJobId(absl::string_view job_id) const;

  absl::StatusOr<JoinResult> Join(const JoinArgs& args)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Records a heartbeat of `worker_id` (or, when 0, of `rank` in the current
  // generation). NOT_FOUND for an unknown worker, FAILED_PRECONDITION if it
  // was declared lost (it must join again). An evicted worker gets OK with
  // its state and the reason. `step` is informational.
  absl::StatusOr<HeartbeatResult> Heartbeat(int64_t worker_id, int rank,
                                            int64_t step)
      ABSL_LOCKS_EXCLUDED(mu_);

  // The member a per-step call comes from: `worker_id` (or `rank` when 0),
  // which must be a member of the current generation. With `generation` set
  // (worker ids only) the caller's generation must be the current, active
  // one: ABORTED otherwise ("re-form"). NOT_FOUND / FAILED_PRECONDITION for
  // unknown, lost or non-member workers.
  absl::StatusOr<MemberContext> ResolveMember(
      int64_t worker_id, int rank, std::optional<int64_t> generation) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // Marks the worker FINISHED (it reported its last step).
  absl::Status MarkFinished(int64_t worker_id, int rank)
      ABSL_LOCKS_EXCLUDED(mu_);

  // The long poll of coordinator_service.proto's AwaitGeneration. Returns
  // DEADLINE_EXCEEDED when nothing changed by `deadline` (real time),
  // UNAVAILABLE after Shutdown().
  absl::StatusOr<AwaitResult> AwaitGeneration(int64_t worker_id,
                                              int64_t known_generation,
                                              absl::Time deadline)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Ends `generation` if it is the current, active one; returns whether this
  // call ended it. The reporter must have been a member of it; its report
  // counts as its confirmation of that generation's end (it is alive and
  // holds the state of the last committed step).
  absl::StatusOr<bool> ReportFailure(int64_t worker_id, int64_t generation,
                                     int64_t step, const std::string& detail)
      ABSL_LOCKS_EXCLUDED(mu_);

  // A worker met an error no new generation would get past (a non-finite
  // loss): the job is FAILED with `reason` (the first reason is kept), its
  // generation ends, and no other forms. Returns whether this call failed the
  // job. Any live worker may report, member or not.
  absl::StatusOr<bool> FailJob(int64_t worker_id, int64_t step,
                               const std::string& reason)
      ABSL_LOCKS_EXCLUDED(mu_);

  // The long poll of CommitStep: OK once every member voted for `step`,
  // ABORTED when the generation ended first, DEADLINE_EXCEEDED at
  // `deadline` (vote again), UNAVAILABLE after Shutdown() or when the commit
  // could not be persisted (vote again). OUT_OF_RANGE for a step other than
  // the next one to commit.
  absl::StatusOr<CommitResult> CommitStep(int64_t worker_id, int64_t generation,
                                          int64_t step, absl::Time deadline)
      ABSL_LOCKS_EXCLUDED(mu_);
  // CommitStep's vote without the wait: the answer when the step is committed
  // (by this vote or before), nullopt while votes are missing (the commit is
  // announced by MembershipListener::OnStepCommitted), or CommitStep's error
  // (DEADLINE_EXCEEDED aside). UNAVAILABLE, not counted, while the first
  // generation still takes its ranks (CommitStep waits for it instead).
  absl::StatusOr<std::optional<CommitResult>> Vote(int64_t worker_id,
                                                   int64_t generation,
                                                   int64_t step)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Takes a worker out (by rank in the current generation, or by id); see the
  // class comment for when its generation ends. NOT_FOUND for an unknown
  // target, FAILED_PRECONDITION for a worker that already left.
  absl::StatusOr<EvictResult> Evict(std::optional<int> rank,
                                    std::optional<int64_t> worker_id)
      ABSL_LOCKS_EXCLUDED(mu_);

  // The schedule stream `worker_id` held for `generation` ended from the
  // worker's side (cancelled, or its connection closed) before the
  // coordinator ended it: if that is the current generation, the worker is
  // taken for gone until it starts another call, and an ending generation
  // forms without waiting for it (see the class comment). Other generations,
  // non-members and unknown workers are ignored.
  void ScheduleStreamLost(int64_t worker_id, int64_t generation)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Time-driven work, called periodically (every heartbeat_timeout / 4 or
  // so): loses silent workers, forms the next generation once the confirm
  // window passed, ends a generation whose joiners or eviction waited
  // join_wait for a step boundary. Returns the workers newly lost.
  std::vector<int64_t> Tick() ABSL_LOCKS_EXCLUDED(mu_);

  // Wakes every long poll with UNAVAILABLE and refuses new ones.
  void Shutdown() ABSL_LOCKS_EXCLUDED(mu_);

  void SetDraining(bool draining) ABSL_LOCKS_EXCLUDED(mu_);

  hsdp::v1::JobState job_state() const ABSL_LOCKS_EXCLUDED(mu_);
  // The latest generation's number.
  int64_t generation() const ABSL_LOCKS_EXCLUDED(mu_);
  // The latest generation.
  hsdp::v1::Generation current_generation() const ABSL_LOCKS_EXCLUDED(mu_);
  int64_t last_committed_step() const ABSL_LOCKS_EXCLUDED(mu_);
  // Live members of the current generation.
  int workers_alive() const ABSL_LOCKS_EXCLUDED(mu_);
  MembershipStatus Status() const ABSL_LOCKS_EXCLUDED(mu_);
  // Current members by rank, then the other workers by id.
  std::vector<WorkerSnapshot> Workers() const ABSL_LOCKS_EXCLUDED(mu_);
  // How many workers are in each state (Workers()' states, without copying
  // every worker and its history: the metrics refresh after each join).
  std::map<hsdp::v1::WorkerState, int> StateCounts() const
      ABSL_LOCKS_EXCLUDED(mu_);
  // The job's model, empty until the first join (or restored).
  std::string model() const ABSL_LOCKS_EXCLUDED(mu_);
  UnitList units() const ABSL_LOCKS_EXCLUDED(mu_);
  bool has_model() const ABSL_LOCKS_EXCLUDED(mu_);
  // The training settings the first worker reported (unset until then).
  std::optional<hsdp::v1::TrainingSpec> training() const
      ABSL_LOCKS_EXCLUDED(mu_);

  const std::string& job_id() const { return options_.job_id; }
  int world_size() const { return options_.world_size; }
  const MeshShape& mesh() const { return options_.mesh; }
  absl::Duration heartbeat_timeout() const {
    return options_.heartbeat_timeout;
  }
  const Options& options() const { return options_; }

 private:
  enum class Liveness { kAlive, kLost, kEvicted, kFinished };
  enum class Phase { kOpen, kActive, kEnding, kNone };

  struct Worker {
    int64_t id = 0;
    std::string hostname;
    std::string device;
    Liveness liveness = Liveness::kAlive;
    // Evicted while a member: leaves at the next step boundary.
    bool evicted = false;
    bool restored = false;
    absl::Time last_heartbeat;
    int64_t step = -1;
    // The generation it was last a member of (-1: never), rank and role.
    int64_t generation = -1;
    int rank = -1;
    hsdp::v1::GenerationRole role = hsdp::v1::GENERATION_ROLE_UNSPECIFIED;
    // Shard index of the state it holds as of the last committed step.
    int holder_shard = -1;
    // Shard index of its last membership (-1: never a member, or not known
    // after a restart): its engine's shards are cut for it, so it is placed
    // there again when it can be.
    int last_shard = -1;
    // A non-member that showed it is there to be placed (it joined, confirmed
    // the last ending, or called AwaitGeneration since): only such workers
    // are placed in a new generation or make it grow. A member that did not
    // confirm is not ready until it calls again (it may be dead).
    bool ready = false;
    // The generation whose schedule stream it lost (ScheduleStreamLost) with
    // no call started since; -1: none.
    int64_t stream_lost_generation = -1;
    std::deque<hsdp::v1::WorkerEvent> history;
  };

  // The latest generation and what is going on with it.
  struct Current {
    hsdp::v1::Generation info;
    Phase phase = Phase::kOpen;
    // Steps committed in it.
    int64_t committed = 0;
    // Ending: why, since when, who confirmed.
    hsdp::v1::FailureCause end_cause = hsdp::v1::FAILURE_CAUSE_UNSPECIFIED;
    std::string end_detail;
    bool ended_at_boundary = false;
    absl::Time ended_at;
    std::set<int64_t> confirmed;
    // Votes on the step being committed (last committed + 1), by rank.
    std::vector<bool> voted;
    int votes = 0;
    // The step the votes are for, while no step of the job has committed (a
    // job resumed from a checkpoint first commits the step after it).
    int64_t vote_step = -1;
    // A membership change waiting for a step boundary since then.
    std::optional<absl::Time> grow_since;
    std::optional<absl::Time> evict_since;
  };

  Membership(Options options, StateStore* store);

  // --- membership.cc (lookups), membership_persistence.cc,
  // --- membership_workers.cc (joins, heartbeats, the sweep).
  absl::Status RestoreLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status PersistLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Worker* FindLocked(int64_t worker_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  const Worker* FindLocked(int64_t worker_id) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `worker_id`, or the current member at `rank` when it is 0.
  absl::StatusOr<Worker*> ResolveLocked(int64_t worker_id, int rank)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `worker_id`, which must be known (NOT_FOUND) and not lost
  // (FAILED_PRECONDITION).
  absl::StatusOr<Worker*> FindLiveLocked(int64_t worker_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A worker's liveness as persisted (ALIVE for a live one) and back.
  static hsdp::v1::WorkerState RecordState(Liveness liveness);
  static Liveness FromRecordState(hsdp::v1::WorkerState state);
  // A call of `w` started: it is there (takes ScheduleStreamLost back).
  void HeardFromLocked(Worker& w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Its schedule stream of the current generation broke and it started no
  // call since.
  bool GoneLocked(const Worker& w) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // FAILED_PRECONDITION for a lost worker.
  absl::Status CheckNotLostLocked(const Worker& w) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool IsMemberLocked(int64_t worker_id) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // O(1) through rank_cache_ (every call of every RPC asks, often twice).
  int RankOfLocked(int64_t worker_id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  hsdp::v1::WorkerState StateOfLocked(const Worker& w) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  hsdp::v1::JobState JobStateLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AddEventLocked(Worker& w, hsdp::v1::WorkerEventKind kind,
                      const std::string& detail)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<int> PickOpenRankLocked(const JoinArgs& args) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The hostnames of the current generation's members by rank (empty where
  // unknown or free).
  std::vector<std::string> HostsByRankLocked() const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The current generation's shard groups that span hosts (none while no
  // generation runs).
  std::vector<std::string> TopologyWarningsLocked() const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Tells the listener when the generation just formed has such groups.
  void ReportTopologyLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int NonMembersAliveLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PruneDepartedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::vector<int64_t> SweepLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  JoinResult JoinResultLocked(const Worker& w) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // --- membership_generation.cc (ending, forming), membership_commit.cc.
  void EndLocked(hsdp::v1::FailureCause cause, const std::string& detail,
                 int64_t worker_id, absl::Time failed_at, bool at_boundary)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Forms the next generation when the ending one may (confirmations or the
  // window) or when the job waits for workers.
  void MaybeFormLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FormLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  FormationInput FormationInputLocked(bool only_confirmed) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sets grow_since when the live workers could form more replica groups
  // than the active generation has.
  void UpdateGrowLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // No live copy of a shard's state: fails the job. The place to restart from
  // the latest checkpoint at the size the job has, once checkpoints load on
  // any mesh.
  void NoLiveCopyLocked(const GenerationPlan& plan)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status PersistCommitLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One vote, counted once: the answer, nullopt while votes are missing, or
  // the error CommitStep returns.
  absl::StatusOr<std::optional<CommitResult>> VoteLocked(int64_t worker_id,
                                                         int64_t generation,
                                                         int64_t step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The commit of `step` (the last vote came): persists it, then the step
  // boundary's work (heals, recovery, grow, evict).
  absl::Status CommitLocked(int64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The generation context a member's schedule reads use.
  GenerationContext ScheduleContextLocked() const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int64_t StartOfLocked(int64_t generation) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The id of an evicted member waiting for the step boundary, or 0.
  int64_t FirstEvictedMemberLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  StateStore* const store_;
  MembershipListener* listener_ = nullptr;

  mutable absl::Mutex mu_;
  // Signalled on every change a long poll waits for.
  absl::CondVar changed_;
  std::map<int64_t, Worker> workers_ ABSL_GUARDED_BY(mu_);
  int64_t next_worker_id_ ABSL_GUARDED_BY(mu_) = 1;
  // The last sweep (Options::pause_threshold).
  absl::Time last_sweep_ ABSL_GUARDED_BY(mu_);
  Current current_ ABSL_GUARDED_BY(mu_);
  // Worker id -> rank in current_.info.worker_ids(): a cache, not an index to
  // keep up to date. A hit counts only when worker_ids still holds the id at
  // that rank; otherwise RankOfLocked scans, and rebuilds the cache when the
  // scan finds the id (worker_ids changed). A linear scan per call made every
  // step's N reports O(N^2) under mu_.
  mutable std::unordered_map<int64_t, int> rank_cache_ ABSL_GUARDED_BY(mu_);
  // Start step of recent generations (to tell whether a step committed in a
  // given generation).
  std::map<int64_t, int64_t> starts_ ABSL_GUARDED_BY(mu_);
  int64_t last_committed_ ABSL_GUARDED_BY(mu_) = -1;
  std::string model_ ABSL_GUARDED_BY(mu_);
  UnitList units_ ABSL_GUARDED_BY(mu_);
  std::optional<hsdp::v1::TrainingSpec> training_ ABSL_GUARDED_BY(mu_);
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  std::string failed_message_ ABSL_GUARDED_BY(mu_);
  // Why no generation is formed while phase is kNone (and not failed).
  std::string waiting_message_ ABSL_GUARDED_BY(mu_);
  int64_t failures_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<hsdp::v1::FailureRecord> last_failure_ ABSL_GUARDED_BY(mu_);
  // The failure whose next generation has not committed yet.
  bool awaiting_recovery_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace hsdp::coordinator

#endif  // HSDP_COORDINATOR_CORE_MEMBERSHIP_H_
