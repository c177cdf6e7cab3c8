// The schedule log: the sealed, immutable per-step schedules every rank reads.
//
// - Sealing: the first read of step s seals it: s and every unsealed step
//   before it are planned, persisted, and their serialized bytes stored. Steps
//   are sealed in order, so the sealed steps are always [0, sealed_step()].
//   Later reads return the same bytes.
// - Generations: a record is sealed in one generation and never changes. When
//   generation g+1 begins at its start step (the last committed step + 1),
//   the steps from there on that g sealed are superseded — they never
//   committed — and are sealed again, as new records, for g+1's world (its
//   microbatch split, sample cursor and generation number); reads of g+1 see
//   only those. The steps before the start step keep their records: they
//   committed. So every rank of a generation still reads byte-identical
//   schedules, and a superseded record stays readable (GetSealed with its
//   generation) and persisted as it was.
// - Global batch (policy batch_mode, with M the policy's microbatches, W0 the
//   job's world and W the generation's): FIXED plans U = W0 * M microbatches
//   per step, ceil(U / W) per rank (the slots past U are zero-weight
//   padding); SHRINK plans U = W * M, M per rank. first_microbatch counts the
//   microbatches of every earlier step, so sample ids never repeat or skip.
// - Policy: SetPolicy validates and applies from the first unsealed step; the
//   answer names that step and the new version. The history maps each step to
//   exactly one policy version, so no step mixes policies and a change lands
//   exactly on the announced step.
// - Read-ahead window: floor = the last committed step, or min over the
//   generation's ranks of the highest completed step (from RecordReport; -1
//   before any report), whichever is higher. Sealing step s is allowed when
//   s <= floor + 1 + read_ahead. Beyond floor + 1 + refuse_ahead a read is
//   refused with OUT_OF_RANGE; in between the caller blocks until the window
//   moves or its deadline passes (DEADLINE_EXCEEDED). Sealed steps are always
//   readable.
// - Drain: Drain() fixes a last step (the first unsealed step); reads past it
//   answer `drained` and nothing past it is ever sealed.
// - Checkpoints: RequestCheckpoint() marks the first unsealed step; the last
//   step every rank reported checkpoint_saved for is tracked
//   (last_checkpoint_step).
//
// Persistence (optional StateStore): policy history, drain step, checkpoint
// requests and records, generation starts, and every sealed step; Create()
// restores them, so a restarted coordinator serves byte-identical sealed
// steps. A generation's start is persisted before any record sealed in it.
// Restoring refuses (DATA_LOSS, naming the file and the step) what a crash
// cannot leave: a step from 0 through the last sealed one without its record,
// a committed step without one, a record of a generation that never began or
// from before its generation's start, generation starts out of order, and a
// truncated or corrupt step file (StateStore). A crash leaves at most a
// leftover temp file, which the store passes over: every file is written to a
// temp file, synced and renamed, so the newest record is whole or absent.
#ifndef HSDP_COORDINATOR_CORE_SCHEDULE_LOG_H_
#define HSDP_COORDINATOR_CORE_SCHEDULE_LOG_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/units.h"
#include "coordinator/core/generation_context.h"
#include "coordinator/core/state_store.h"
#include "coordinator/planner.h"
#include "hsdp/v1/policy.pb.h"
#include "hsdp/v1/schedule.pb.h"

namespace hsdp::coordinator {

inline constexpr int kDefaultReadAhead = 4;

// An immutable sealed step: the stored bytes and the same schedule parsed (so
// serving it does not re-parse). bytes == schedule.SerializeAsString().
struct SealedSchedule {
  int64_t step = 0;
  std::string bytes;
  hsdp::v1::StepSchedule schedule;
};

struct ScheduleRead {
  // Null when drained.
  std::shared_ptr<const SealedSchedule> sealed;
  // The step is past the drain step: the worker should stop.
  bool drained = false;
};

struct PolicyInfo {
  hsdp::v1::Policy policy;
  int64_t version = 0;
  // First step planned (or to be planned) from this version.
  int64_t effective_step = 0;
};

// What a pusher of sealed steps (ScheduleFeed) announces besides schedules:
// the latest commit, as every voter of its step is answered, and the newest
// generation that ended (a generation that ends at a commit's boundary ends
// after that commit's news).
struct CommitNews {
  // The generation and step of the latest commit (-1: none since the start).
  int64_t generation = -1;
  int64_t step = -1;
  // Its generation ended at that step (CommitStepResponse.reform_after).
  bool reform_after = false;
  // The newest generation that ended, or -1.
  int64_t ended_generation = -1;
  // Changes with every record.
  int64_t sequence = 0;
};

// Thread-safe. Planning, sealing and persisting happen under one mutex; reads
// of already sealed steps take only a separate reader lock. Lock order:
// callers may hold Membership's lock (BeginGeneration, RecordCommitted,
// RecordGenerationEnded); the
// log never calls out except to the StateStore.
class ScheduleLog {
 public:
  struct Options {
    // The job's world size (W0: the fixed global batch's reference), and the
    // first generation's.
    int world_size = 1;
    // The mesh's S, for the memory model.
    int shard_size = 1;
    int read_ahead = kDefaultReadAhead;
    // Reads further than this past floor + 1 are refused; 0 means 4 *
    // read_ahead (at least read_ahead + 1).
    int refuse_ahead = 0;
    // What an all-gather costs within a host and across hosts, as the job
    // declares it (planner.h: memory-budget mode weighs kept blocks by it).
    LinkCosts links;
  };

  // Starts from `initial_policy` (version 1, effective step 0) — or, when
  // `store` already holds a policy history, from the persisted history, sealed
  // steps, drain step and checkpoint state (the persisted policy wins over
  // `initial_policy`; restored() says so). The initial policy is validated
  // (without units). `store` may be null (no persistence) and must outlive the
  // log.
  static absl::StatusOr<std::unique_ptr<ScheduleLog>> Create(
      Options options, const hsdp::v1::Policy& initial_policy,
      StateStore* store);

  ScheduleLog(const ScheduleLog&) = delete;
  ScheduleLog& operator=(const ScheduleLog&) = delete;
  ~ScheduleLog();

  // Generation `generation`'s shard groups span hosts: its steps sealed from
  // now on are planned for the inter-host link, and with its host groups
  // (hsdp.v1.Generation.host_group_size; 0: none) for hierarchical reshard.
  // A new generation starts without either (its formation says so again).
  // Other generations are ignored.
  void SetShardGroupsCrossHosts(int64_t generation, int host_group_size)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Sets the job's unit list (once the first worker joined; also restored from
  // the store's units when present). Setting the same list again is a no-op; a
  // different list is FAILED_PRECONDITION. If the current policy has an
  // override matching no unit this returns INVALID_ARGUMENT but keeps the units
  // (such overrides then do nothing).
  absl::Status SetUnits(const UnitList& units);
  bool has_units() const;

  // Worker read of `step` in generation `context` (seals it on first read).
  // A newer generation than the log's begins here (BeginGeneration). Blocks
  // while the step is beyond the read-ahead window, until `deadline`.
  // Errors: ABORTED (an older generation than the log's: it ended),
  // INVALID_ARGUMENT (negative step), FAILED_PRECONDITION (unit list
  // unknown), OUT_OF_RANGE (too far ahead), DEADLINE_EXCEEDED, UNAVAILABLE
  // (Shutdown), or the store's error if persisting failed (the step then stays
  // unsealed).
  absl::StatusOr<ScheduleRead> GetSchedule(int64_t step,
                                           const GenerationContext& context,
                                           absl::Time deadline);

  // Starts `context.generation` (no-op unless it is newer than the log's):
  // supersedes the sealed steps from its start step on, resets the window to
  // its world. Persists the generation's start. Wakes blocked readers (those
  // of the ended generation then fail with ABORTED).
  absl::Status BeginGeneration(const GenerationContext& context);

  // `step` committed: the window's floor is at least `step`, and checkpoint
  // requests up to it are settled. With its generation (not -1) the commit is
  // also news for the pusher (commit_news()), in the same update as the
  // floor, with its voters' answer (`reform_after`).
  void RecordCommitted(int64_t step, int64_t generation = -1,
                       bool reform_after = false);
  // A generation that ended: news for the pusher.
  void RecordGenerationEnded(int64_t generation);
  CommitNews commit_news() const;

  // Control read: the step's current record (generation unset) or the one
  // sealed in `generation`, never seals. NOT_FOUND if there is none.
  absl::StatusOr<std::shared_ptr<const SealedSchedule>> GetSealed(
      int64_t step, std::optional<int64_t> generation = std::nullopt) const;

  // Validates `policy` (against the units when known; a memory budget below
  // the least predicted peak of the model is refused, see
  // Planner::CheckMemoryBudget) and applies it from the first unsealed step.
  // INVALID_ARGUMENT leaves everything unchanged.
  absl::StatusOr<PolicyInfo> SetPolicy(const hsdp::v1::Policy& policy);
  // The latest policy (what SetPolicy last installed).
  PolicyInfo CurrentPolicy() const;
  // Every version in order (version 1 first).
  std::vector<PolicyInfo> PolicyHistory() const;

  // Requests a checkpoint after the first unsealed step and returns that step
  // (FAILED_PRECONDITION if that step is past the drain step). The request
  // holds until the step commits, so a re-sealed step keeps it.
  absl::StatusOr<int64_t> RequestCheckpoint();

  // Marks steps first..last (first 0: the first unsealed step; last 0: first)
  // to be traced and returns the range. FAILED_PRECONDITION if first is
  // already sealed; INVALID_ARGUMENT for a bad range (ValidateTraceRange).
  // Not persisted: a restarted coordinator traces nothing it was asked before.
  absl::StatusOr<std::pair<int64_t, int64_t>> RequestTrace(int64_t first,
                                                           int64_t last);

  // Stops sealing after the first unsealed step and returns it (the last step
  // that runs). Idempotent: a second call returns the same step. Fails only if
  // persisting fails.
  absl::StatusOr<int64_t> Drain();

  // Records a rank's step report: its completed step (moves the window, wakes
  // readers), checkpoint_saved (last_checkpoint_step advances when every rank
  // saved a step) and peak memory and activations (planner feedback).
  // INVALID_ARGUMENT for a
  // rank outside [0, world) or a negative step.
  absl::Status RecordReport(const hsdp::v1::StepReport& report);

  // Wakes every blocked GetSchedule with UNAVAILABLE and refuses new blocking
  // reads.
  void Shutdown();

  // What a pusher of sealed steps (ScheduleFeed) reads in one snapshot: the
  // floor (see min_completed_step; restored lower bound and committed step
  // included) and the commit news. A commit raises the floor and is news in
  // one update, so a snapshot with the news of step s has a floor of at least
  // s, and one with a floor raised by a commit has its news.
  struct FeedState {
    int64_t floor = -1;
    CommitNews news;
  };
  // Blocks until the floor differs from `seen_floor`, the commit news'
  // sequence from `seen_news`, the log drains or shuts down, Wake() is
  // called, or `deadline`; returns the state then.
  FeedState AwaitFeedChange(int64_t seen_floor, int64_t seen_news,
                            absl::Time deadline);
  // Wakes AwaitFeedChange (and lets blocked reads re-check).
  void Wake();
  bool is_shut_down() const;

  // Highest sealed step, or -1.
  int64_t sealed_step() const;
  // The generation the log seals for now.
  int64_t generation() const;
  // Drain step, or -1.
  int64_t drain_step() const;
  // Latest step every rank reported a saved checkpoint for, or -1.
  int64_t last_checkpoint_step() const;
  // min over ranks of the highest completed step (-1 before reports).
  int64_t min_completed_step() const;
  // Bytes the planner adds to its memory model from reported peaks.
  int64_t memory_correction_bytes() const;
  bool restored() const { return restored_; }
  const Options& options() const { return options_; }

 private:
  ScheduleLog(Options options, StateStore* store);

  // A planner for `units` with the job's links and the generation's layout.
  std::unique_ptr<Planner> NewPlannerLocked(const UnitList& units) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  MemoryModel::Options MemoryOptions() const;
  // Logs (stderr) that a sealed step runs over its memory budget.
  void ReportOverBudgetLocked(const hsdp::v1::StepSchedule& schedule,
                              const PolicyInfo& policy)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  const PolicyInfo& PolicyForStepLocked(int64_t step) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int64_t FloorLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The sealed step, or null.
  std::shared_ptr<const SealedSchedule> FindSealed(int64_t step) const
      ABSL_LOCKS_EXCLUDED(sealed_mu_);
  void AppendSealed(std::shared_ptr<const SealedSchedule> sealed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status SealThroughLocked(int64_t step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status BeginGenerationLocked(const GenerationContext& context)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops the effective records from `step` on (they stay in records_).
  void TruncateLocked(int64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status RestoreLocked(const hsdp::v1::Policy& initial_policy)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Restores the sealed records (store_ set, generation_starts_ restored);
  // DATA_LOSS naming the file and the step for damage a crash cannot leave.
  absl::Status RestoreSealedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status PersistLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  StateStore* const store_;
  bool restored_ = false;

  mutable absl::Mutex mu_;
  std::vector<PolicyInfo> policies_ ABSL_GUARDED_BY(mu_);
  // The current generation's shard groups span hosts.
  bool cross_hosts_ ABSL_GUARDED_BY(mu_) = false;
  int host_group_size_ ABSL_GUARDED_BY(mu_) = 0;
  std::unique_ptr<Planner> planner_ ABSL_GUARDED_BY(mu_);
  // Steps [0, next_unsealed_) are sealed. Sealing holds mu_ (planning,
  // persisting) and appends under sealed_mu_ too, so reads of sealed steps only
  // take sealed_mu_ and are never stalled behind a seal's fsync.
  int64_t next_unsealed_ ABSL_GUARDED_BY(mu_) = 0;
  mutable absl::Mutex sealed_mu_ ABSL_ACQUIRED_AFTER(mu_);
  // The effective record of each sealed step.
  std::vector<std::shared_ptr<const SealedSchedule>> sealed_
      ABSL_GUARDED_BY(sealed_mu_);
  // Every record ever sealed, superseded ones included, by (step, generation).
  std::map<std::pair<int64_t, int64_t>, std::shared_ptr<const SealedSchedule>>
      records_ ABSL_GUARDED_BY(sealed_mu_);
  // The generation sealed for now: its number, world and start step, and the
  // first microbatch of the next unsealed step.
  GenerationContext current_ ABSL_GUARDED_BY(mu_);
  int64_t next_first_microbatch_ ABSL_GUARDED_BY(mu_) = 0;
  // Every generation begun after the first, in order (persisted).
  std::vector<GenerationContext> generation_starts_ ABSL_GUARDED_BY(mu_);
  // How many of generation_starts_ the store holds.
  size_t persisted_starts_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t committed_floor_ ABSL_GUARDED_BY(mu_) = -1;
  CommitNews news_ ABSL_GUARDED_BY(mu_);
  // Highest completed step per rank, with its minimum and how many ranks sit at
  // it, kept incrementally so a report costs O(1) amortized even with 1000+
  // ranks.
  std::vector<int64_t> completed_ ABSL_GUARDED_BY(mu_);
  int64_t min_completed_ ABSL_GUARDED_BY(mu_) = -1;
  int ranks_at_min_ ABSL_GUARDED_BY(mu_) = 0;
  // Lower bound on the floor after a restart (the window as it was when the
  // last restored step was sealed), since completed steps are not persisted.
  int64_t restored_floor_ ABSL_GUARDED_BY(mu_) = -1;
  int64_t drain_step_ ABSL_GUARDED_BY(mu_) = -1;
  std::set<int64_t> checkpoint_requests_ ABSL_GUARDED_BY(mu_);
  // Steps to trace (RequestTrace); settled like checkpoint requests.
  std::set<int64_t> trace_requests_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, std::set<int>> checkpoint_saves_ ABSL_GUARDED_BY(mu_);
  int64_t last_checkpoint_step_ ABSL_GUARDED_BY(mu_) = -1;
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  int64_t over_budget_reported_version_ ABSL_GUARDED_BY(mu_) = 0;
  // Signalled (with mu_ held) when the floor, the sealed steps, the drain step
  // or shutdown_ change: what blocked GetSchedule calls wait for.
  absl::CondVar window_cv_;
};

}  // namespace hsdp::coordinator

#endif  // HSDP_COORDINATOR_CORE_SCHEDULE_LOG_H_
