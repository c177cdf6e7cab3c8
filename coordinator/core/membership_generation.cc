// Membership: ending and forming generations, AwaitGeneration, failure
// reports and the schedule streams that tell a dead member from a slow one.
#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "coordinator/core/generation_plan.h"
#include "coordinator/core/kv_store.h"
#include "coordinator/core/membership.h"

namespace hsdp::coordinator {
namespace {

// Generations whose start step is kept (CommitStep answers a retried vote
// from one of them; older ones are answered ABORTED).
constexpr int kRememberedStarts = 64;

bool IsFailure(hsdp::v1::FailureCause cause) {
  return cause == hsdp::v1::FAILURE_CAUSE_LOST ||
         cause == hsdp::v1::FAILURE_CAUSE_EVICTED ||
         cause == hsdp::v1::FAILURE_CAUSE_REPORTED;
}

}  // namespace

int64_t Membership::FirstEvictedMemberLocked() const {
  for (const int64_t id : current_.info.worker_ids()) {
    const Worker* w = FindLocked(id);
    if (w != nullptr && w->evicted) return id;
  }
  return 0;
}

GenerationContext Membership::ScheduleContextLocked() const {
  GenerationContext context;
  context.generation = current_.info.generation();
  context.world_size = current_.info.worker_ids_size();
  context.start_step = current_.info.start_step();
  return context;
}

int64_t Membership::StartOfLocked(int64_t generation) const {
  auto it = starts_.find(generation);
  return it == starts_.end() ? std::numeric_limits<int64_t>::max() : it->second;
}

void Membership::EndLocked(hsdp::v1::FailureCause cause,
                           const std::string& detail, int64_t worker_id,
                           absl::Time failed_at, bool at_boundary) {
  if (current_.phase != Phase::kActive && current_.phase != Phase::kOpen) {
    return;
  }
  const absl::Time now = options_.clock->Now();
  current_.phase = Phase::kEnding;
  current_.end_cause = cause;
  current_.end_detail = detail;
  current_.ended_at_boundary = at_boundary;
  current_.ended_at = now;
  current_.confirmed.clear();
  current_.voted.assign(current_.voted.size(), false);
  current_.votes = 0;
  current_.grow_since.reset();
  current_.evict_since.reset();
  if (IsFailure(cause)) {
    ++failures_;
    hsdp::v1::FailureRecord record;
    record.set_cause(cause);
    record.set_generation(current_.info.generation());
    record.set_worker_id(worker_id);
    record.set_detail(detail);
    record.set_failed_unix_ms(absl::ToUnixMillis(failed_at));
    record.set_ended_unix_ms(absl::ToUnixMillis(now));
    last_failure_ = std::move(record);
    awaiting_recovery_ = true;
  }
  if (listener_ != nullptr) {
    listener_->OnGenerationEnded(current_.info.generation(), cause);
  }
  (void)PersistLocked();  // best effort, as for a lost worker
  changed_.SignalAll();
  MaybeFormLocked();
}

void Membership::MaybeFormLocked() {
  if (!failed_message_.empty() || shutdown_) return;
  if (current_.phase == Phase::kEnding) {
    // Waits only for live members whose connection is up and that have not
    // reported in yet (the class comment: slow, not gone).
    bool all_accounted_for = true;
    for (const int64_t id : current_.info.worker_ids()) {
      const Worker* w = FindLocked(id);
      if (w != nullptr && w->liveness == Liveness::kAlive && !w->evicted &&
          !GoneLocked(*w) && current_.confirmed.count(id) == 0) {
        all_accounted_for = false;
        break;
      }
    }
    if (!all_accounted_for &&
        options_.clock->Now() < current_.ended_at + options_.reform_window) {
      return;
    }
    FormLocked();
  } else if (current_.phase == Phase::kNone) {
    FormLocked();
  }
}

FormationInput Membership::FormationInputLocked(bool only_confirmed) const {
  FormationInput input;
  input.shard = options_.mesh.shard;
  input.max_replicas = options_.mesh.replicate;
  input.min_replicas = options_.min_replicas;
  input.state_exists = last_committed_ >= 0;
  const int64_t previous = current_.info.generation();
  std::vector<const Worker*> former, standby, joining;
  for (const auto& [id, w] : workers_) {
    if (w.liveness != Liveness::kAlive || w.evicted) continue;
    if (w.generation == previous && w.rank >= 0) {
      if (only_confirmed && current_.confirmed.count(id) == 0) continue;
      former.push_back(&w);
    } else if (!w.ready) {
      continue;
    } else if (w.generation >= 0) {
      standby.push_back(&w);
    } else {
      joining.push_back(&w);
    }
  }
  std::sort(former.begin(), former.end(),
            [](const Worker* a, const Worker* b) { return a->rank < b->rank; });
  for (const auto* list : {&former, &standby, &joining}) {
    for (const Worker* w : *list) {
      FormationCandidate c;
      c.worker_id = w->id;
      c.holder_shard = w->holder_shard;
      c.last_shard = w->last_shard;
      c.hostname = w->hostname;
      if (list == &former) {
        c.previous_rank = w->rank;
        c.previous_replica = w->rank / options_.mesh.shard;
      }
      input.candidates.push_back(c);
    }
  }
  return input;
}

void Membership::FormLocked() {
  const bool ending = current_.phase == Phase::kEnding;
  GenerationPlan plan = PlanGeneration(FormationInputLocked(ending));
  // No live copy of some shard's state, but a checkpoint of every shard: the
  // live workers form a generation that loads it (on whatever mesh they make)
  // and goes on from the step after it.
  int64_t restore_step = -1;
  if (plan.outcome == FormationOutcome::kNoLiveCopy && listener_ != nullptr) {
    const int64_t checkpoint = listener_->LastCheckpointStep();
    if (checkpoint >= 0) {
      FormationInput input = FormationInputLocked(ending);
      input.state_exists = false;
      GenerationPlan restored = PlanGeneration(input);
      if (restored.outcome == FormationOutcome::kFormed) {
        plan = std::move(restored);
        restore_step = checkpoint;
      } else if (restored.outcome == FormationOutcome::kTooFewReplicas) {
        // Every worker was lost at once (a partition, a coordinator that
        // could not hear them): wait for enough of them to restore.
        plan = std::move(restored);
      }
    }
  }
  // Members of the ended generation that did not confirm in time stand by;
  // their state is not trusted any more.
  if (ending) {
    for (const int64_t id : current_.info.worker_ids()) {
      Worker* w = FindLocked(id);
      if (w == nullptr || w->liveness != Liveness::kAlive) continue;
      if (w->evicted) {
        w->liveness = Liveness::kEvicted;
        continue;
      }
      if (current_.confirmed.count(id) == 0) {
        w->holder_shard = -1;
        w->ready = false;
        AddEventLocked(*w, hsdp::v1::WORKER_EVENT_KIND_STANDBY,
                       GoneLocked(*w)
                           ? "its connection closed (schedule stream lost)"
                           : "did not confirm within the reform window");
        w->generation = current_.info.generation();
        w->rank = -1;
      }
    }
  }
  if (plan.outcome == FormationOutcome::kNoLiveCopy) {
    NoLiveCopyLocked(plan);
    return;
  }
  if (plan.outcome == FormationOutcome::kTooFewReplicas) {
    if (current_.phase != Phase::kNone || waiting_message_ != plan.message) {
      current_.phase = Phase::kNone;
      waiting_message_ = plan.message;
      (void)PersistLocked();
      changed_.SignalAll();
    }
    return;
  }

  const absl::Time now = options_.clock->Now();
  const int s = options_.mesh.shard;
  hsdp::v1::Generation next;
  next.set_generation(current_.info.generation() + 1);
  next.mutable_mesh()->set_replicate(plan.replicas);
  next.mutable_mesh()->set_shard(s);
  next.set_rendezvous_prefix(
      RendezvousPrefix(options_.job_id, next.generation()));
  if (restore_step >= 0) {
    // Steps after the checkpoint are trained again: their updates died with
    // the workers that held them.
    last_committed_ = restore_step;
    next.set_restore_from_checkpoint(true);
  }
  next.set_start_step(last_committed_ + 1);
  for (size_t rank = 0; rank < plan.members.size(); ++rank) {
    next.add_worker_ids(plan.members[rank]);
    next.add_roles(plan.roles[rank]);
  }
  for (const auto& heal : plan.heal_plans) *next.add_heal_plans() = heal;

  current_ = Current();
  current_.info = std::move(next);
  current_.info.set_host_group_size(HostGroupSize(s, HostsByRankLocked()));
  current_.phase = Phase::kActive;
  current_.voted.assign(plan.members.size(), false);
  if (restore_step >= 0) (void)PersistCommitLocked();
  starts_[current_.info.generation()] = current_.info.start_step();
  while (static_cast<int>(starts_.size()) > kRememberedStarts) {
    starts_.erase(starts_.begin());
  }
  waiting_message_.clear();
  for (size_t rank = 0; rank < plan.members.size(); ++rank) {
    Worker* w = FindLocked(plan.members[rank]);
    w->generation = current_.info.generation();
    w->rank = static_cast<int>(rank);
    w->role = plan.roles[rank];
    w->holder_shard = w->role == hsdp::v1::GENERATION_ROLE_HEAL_TARGET
                          ? -1
                          : static_cast<int>(rank) % s;
    w->last_shard = static_cast<int>(rank) % s;
    AddEventLocked(*w, hsdp::v1::WORKER_EVENT_KIND_MEMBER,
                   absl::StrCat("rank ", rank, " of ", plan.members.size()));
  }
  for (const int64_t id : plan.standby) {
    Worker* w = FindLocked(id);
    w->holder_shard = -1;
    w->ready = true;
    if (w->generation >= 0) {
      w->rank = -1;
      AddEventLocked(*w, hsdp::v1::WORKER_EVENT_KIND_STANDBY,
                     "no complete replica group for it");
    }
  }
  if (awaiting_recovery_ && last_failure_.has_value()) {
    last_failure_->set_formed_unix_ms(absl::ToUnixMillis(now));
  }
  if (listener_ != nullptr) listener_->OnGenerationFormed(current_.info);
  ReportTopologyLocked();
  (void)PersistLocked();
  changed_.SignalAll();
}

void Membership::NoLiveCopyLocked(const GenerationPlan& plan) {
  // Without a checkpoint of every shard (FormLocked restores from one when
  // there is), the job cannot continue.
  failed_message_ =
      absl::StrCat(plan.message,
                   "; no checkpoint to restart from (set a checkpoint "
                   "interval in the policy, with --checkpoint-dir on the "
                   "workers)");
  current_.phase = Phase::kNone;
  (void)PersistLocked();
  changed_.SignalAll();
}

void Membership::UpdateGrowLocked() {
  if (current_.phase != Phase::kActive) {
    current_.grow_since.reset();
    return;
  }
  // Members count as holders of their shard even before a commit: only the
  // possible size matters here.
  FormationInput input = FormationInputLocked(/*only_confirmed=*/false);
  for (FormationCandidate& c : input.candidates) {
    if (c.previous_rank >= 0) c.holder_shard = c.previous_rank % input.shard;
  }
  input.state_exists = true;
  const GenerationPlan plan = PlanGeneration(input);
  const bool can_grow = plan.outcome == FormationOutcome::kFormed &&
                        plan.replicas > current_.info.mesh().replicate();
  if (!can_grow) {
    current_.grow_since.reset();
  } else if (!current_.grow_since.has_value()) {
    current_.grow_since = options_.clock->Now();
  }
}

absl::StatusOr<AwaitResult> Membership::AwaitGeneration(
    int64_t worker_id, int64_t known_generation, absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  // A call that starts shows the worker is there. (Not on every wake-up: a
  // dead worker's long poll goes on until its deadline.)
  if (Worker* w = FindLocked(worker_id); w != nullptr) HeardFromLocked(*w);
  // The call began while the caller's generation was active: it reports the
  // end (ENDED) instead of confirming.
  bool watched_active = false;
  bool timed_out = false;
  // Only the call's first pass is evidence that the worker is there.
  bool first_pass = true;
  for (;; first_pass = false) {
    if (shutdown_) {
      return absl::UnavailableError("coordinator is shutting down");
    }
    absl::StatusOr<Worker*> found = FindLiveLocked(worker_id);
    if (!found.ok()) return found.status();
    Worker* w = *found;
    const bool member = IsMemberLocked(worker_id);
    if (first_pass && !member && !w->ready && w->liveness == Liveness::kAlive) {
      // It is there after all: it may be placed, and may make the job grow.
      w->ready = true;
      UpdateGrowLocked();
      MaybeFormLocked();
      continue;
    }
    AwaitResult result;
    result.worker_state = StateOfLocked(*w);
    result.generation.set_generation(current_.info.generation());
    const bool running =
        current_.phase == Phase::kActive || current_.phase == Phase::kOpen;
    if (!failed_message_.empty()) {
      result.outcome = hsdp::v1::AWAIT_OUTCOME_EXIT;
      result.message = absl::StrCat("the job failed: ", failed_message_);
      return result;
    }
    if (w->liveness == Liveness::kEvicted || (w->evicted && !running)) {
      result.outcome = hsdp::v1::AWAIT_OUTCOME_EXIT;
      result.message = "evicted by an operator";
      return result;
    }
    if (w->liveness == Liveness::kFinished ||
        JobStateLocked() == hsdp::v1::JOB_STATE_FINISHED) {
      result.outcome = hsdp::v1::AWAIT_OUTCOME_EXIT;
      result.message = "the job finished";
      return result;
    }
    if (known_generation > current_.info.generation()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "generation ", known_generation, " is ahead of this coordinator's (",
          current_.info.generation(),
          "): it lost its state; restart the "
          "worker"));
    }
    if (running && known_generation < current_.info.generation()) {
      if (member) {
        result.outcome = hsdp::v1::AWAIT_OUTCOME_FORMED;
        result.generation = current_.info;
      } else {
        result.outcome = hsdp::v1::AWAIT_OUTCOME_STANDBY;
      }
      return result;
    }
    if (running && member) watched_active = true;
    if (current_.phase == Phase::kEnding && member) {
      if (watched_active) {
        result.outcome = hsdp::v1::AWAIT_OUTCOME_ENDED;
        result.message = current_.end_detail;
        return result;
      }
      if (current_.confirmed.insert(worker_id).second) {
        MaybeFormLocked();
        continue;  // formed now, perhaps
      }
    }
    if (timed_out) {
      return absl::DeadlineExceededError(absl::StrCat(
          "generation ", current_.info.generation(), " unchanged"));
    }
    timed_out = changed_.WaitWithDeadline(&mu_, deadline);
  }
}

void Membership::HeardFromLocked(Worker& w) { w.stream_lost_generation = -1; }

bool Membership::GoneLocked(const Worker& w) const {
  return w.stream_lost_generation == current_.info.generation();
}

void Membership::ScheduleStreamLost(int64_t worker_id, int64_t generation) {
  absl::MutexLock lock(&mu_);
  if (shutdown_ || generation != current_.info.generation() ||
      !IsMemberLocked(worker_id)) {
    return;
  }
  Worker* w = FindLocked(worker_id);
  if (w == nullptr || w->liveness != Liveness::kAlive) return;
  w->stream_lost_generation = generation;
  MaybeFormLocked();
}

absl::StatusOr<bool> Membership::ReportFailure(int64_t worker_id,
                                               int64_t generation, int64_t step,
                                               const std::string& detail) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Worker*> found = FindLiveLocked(worker_id);
  if (!found.ok()) return found.status();
  Worker* w = *found;
  HeardFromLocked(*w);
  if (generation > current_.info.generation()) {
    return absl::InvalidArgumentError(absl::StrCat("generation: ", generation,
                                                   " is ahead of the current ",
                                                   current_.info.generation()));
  }
  if (generation < current_.info.generation()) return false;
  const int rank = RankOfLocked(worker_id);
  if (current_.phase == Phase::kEnding) {
    // Another report (or a lost worker) ended it first: this one reports in.
    if (rank >= 0 && current_.confirmed.insert(worker_id).second) {
      MaybeFormLocked();
      changed_.SignalAll();
    }
    return false;
  }
  const bool running =
      current_.phase == Phase::kActive || current_.phase == Phase::kOpen;
  if (!running) return false;
  if (rank < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "worker ", worker_id, " is not a member of generation ", generation));
  }
  AddEventLocked(*w, hsdp::v1::WORKER_EVENT_KIND_REPORTED_FAILURE, detail);
  EndLocked(hsdp::v1::FAILURE_CAUSE_REPORTED,
            absl::StrCat("worker ", worker_id, " (rank ", rank, ") at step ",
                         step, ": ", detail),
            worker_id, options_.clock->Now(), /*at_boundary=*/false);
  // The reporter is alive and holds the last committed state: it reported in.
  if (current_.phase == Phase::kEnding) {
    current_.confirmed.insert(worker_id);
    MaybeFormLocked();
  }
  return true;
}

absl::StatusOr<bool> Membership::FailJob(int64_t worker_id, int64_t step,
                                         const std::string& reason) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Worker*> found = FindLiveLocked(worker_id);
  if (!found.ok()) return found.status();
  if (!failed_message_.empty()) return false;
  Worker* w = *found;
  AddEventLocked(*w, hsdp::v1::WORKER_EVENT_KIND_REPORTED_FAILURE, reason);
  // Set before the generation ends, so that no next generation forms.
  failed_message_ = reason;
  const int rank = RankOfLocked(worker_id);
  EndLocked(hsdp::v1::FAILURE_CAUSE_REPORTED,
            absl::StrCat("worker ", worker_id, " (rank ", rank, ") at step ",
                         step, ": ", reason),
            worker_id, options_.clock->Now(), /*at_boundary=*/false);
  (void)PersistLocked();  // EndLocked does not when no generation was active
  changed_.SignalAll();
  return true;
}

}  // namespace hsdp::coordinator
