// Membership: the two-phase step commit (CommitStep, and Vote for votes that
// arrive on a stream).
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "coordinator/core/membership.h"

namespace hsdp::coordinator {

absl::StatusOr<CommitResult> Membership::CommitStep(int64_t worker_id,
                                                    int64_t generation,
                                                    int64_t step,
                                                    absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  if (Worker* w = FindLocked(worker_id); w != nullptr) HeardFromLocked(*w);
  bool timed_out = false;
  while (true) {
    absl::StatusOr<std::optional<CommitResult>> answer =
        VoteLocked(worker_id, generation, step);
    if (!answer.ok()) return answer.status();
    if (answer->has_value()) return **answer;
    if (timed_out) {
      std::vector<int> missing;
      for (int r = 0; r < static_cast<int>(current_.voted.size()); ++r) {
        if (!current_.voted[r]) missing.push_back(r);
      }
      return absl::DeadlineExceededError(
          absl::StrCat("step ", step, ": waiting for the votes of rank(s) ",
                       absl::StrJoin(missing, ", "), ": vote again"));
    }
    timed_out = changed_.WaitWithDeadline(&mu_, deadline);
  }
}

absl::StatusOr<std::optional<CommitResult>> Membership::Vote(int64_t worker_id,
                                                             int64_t generation,
                                                             int64_t step) {
  absl::MutexLock lock(&mu_);
  if (Worker* w = FindLocked(worker_id); w != nullptr) HeardFromLocked(*w);
  absl::StatusOr<std::optional<CommitResult>> answer =
      VoteLocked(worker_id, generation, step);
  if (answer.ok() && !answer->has_value() && current_.phase != Phase::kActive) {
    // Not counted: a generation still taking its ranks trains no step.
    // CommitStep waits for it to form instead.
    return absl::UnavailableError(absl::StrCat(
        "generation ", current_.info.generation(),
        " has not formed yet (ranks still joining): vote with CommitStep"));
  }
  return answer;
}

absl::StatusOr<std::optional<CommitResult>> Membership::VoteLocked(
    int64_t worker_id, int64_t generation, int64_t step) {
  if (shutdown_) return absl::UnavailableError("coordinator is shutting down");
  if (absl::Status s = FindLiveLocked(worker_id).status(); !s.ok()) return s;
  const int64_t current = current_.info.generation();
  if (generation > current) {
    return absl::FailedPreconditionError(
        absl::StrCat("generation ", generation,
                     " is ahead of this coordinator's (", current, ")"));
  }
  // Committed in that generation: the same answer as the first time.
  const int64_t next_start = generation == current
                                 ? std::numeric_limits<int64_t>::max()
                                 : StartOfLocked(generation + 1);
  if (step <= last_committed_ && step >= StartOfLocked(generation) &&
      step < next_start) {
    CommitResult result;
    result.step = step;
    result.reform_after =
        generation != current || current_.phase != Phase::kActive;
    return result;
  }
  if (generation < current ||
      (current_.phase != Phase::kActive && current_.phase != Phase::kOpen)) {
    return absl::AbortedError(absl::StrCat(
        "generation ", generation, " ended before step ", step, " committed (",
        generation == current ? current_.end_detail : "a later one formed",
        "): discard the step and re-form"));
  }
  const int rank = RankOfLocked(worker_id);
  if (rank < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "worker ", worker_id, " is not a member of generation ", current));
  }
  // The next step, or — before the job's first commit — the step of the first
  // vote (the job may have resumed from a checkpoint).
  const int64_t expected = last_committed_ >= 0 ? last_committed_ + 1
                           : current_.votes > 0 ? current_.vote_step
                                                : step;
  if (step != expected) {
    return absl::OutOfRangeError(
        absl::StrCat("step ", step, " is not the next step to commit (",
                     expected, ") in generation ", current));
  }
  if (current_.phase != Phase::kActive) return std::nullopt;
  if (current_.votes == 0) current_.vote_step = step;
  if (!current_.voted[rank]) {
    current_.voted[rank] = true;
    ++current_.votes;
  }
  if (current_.votes < static_cast<int>(current_.voted.size())) {
    return std::nullopt;
  }
  if (absl::Status s = CommitLocked(step); !s.ok()) return s;
  // Answered as a re-vote of the committed step is.
  return VoteLocked(worker_id, generation, step);
}

absl::Status Membership::CommitLocked(int64_t step) {
  const int64_t current = current_.info.generation();
  last_committed_ = step;
  ++current_.committed;
  if (absl::Status s = PersistCommitLocked(); !s.ok()) {
    // Not committed until durable: a restart must not forget a step some ranks
    // applied.
    last_committed_ = step - 1;
    --current_.committed;
    return absl::UnavailableError(
        absl::StrCat("step ", step, " could not be committed durably (",
                     s.message(), "): vote again"));
  }
  current_.voted.assign(current_.voted.size(), false);
  current_.votes = 0;
  if (current_.committed == 1) {
    for (int r = 0; r < current_.info.worker_ids_size(); ++r) {
      if (current_.info.roles(r) != hsdp::v1::GENERATION_ROLE_HEAL_TARGET) {
        continue;
      }
      Worker* target = FindLocked(current_.info.worker_ids(r));
      target->holder_shard = r % options_.mesh.shard;
      AddEventLocked(*target, hsdp::v1::WORKER_EVENT_KIND_HEALED,
                     absl::StrCat("step ", step, " committed"));
    }
    if (awaiting_recovery_ && last_failure_.has_value()) {
      last_failure_->set_recovered_unix_ms(
          absl::ToUnixMillis(options_.clock->Now()));
      awaiting_recovery_ = false;
      if (listener_ != nullptr) listener_->OnRecovered(*last_failure_);
      (void)PersistLocked();
    }
  }
  // Membership changes waiting for a step boundary happen here, after the
  // commit is announced with its answer.
  UpdateGrowLocked();
  const bool evict = current_.evict_since.has_value();
  const bool grow = current_.grow_since.has_value();
  if (listener_ != nullptr) {
    CommitResult commit;
    commit.step = step;
    commit.reform_after = evict || grow;
    listener_->OnStepCommitted(current, commit);
  }
  if (evict) {
    const int64_t evicted = FirstEvictedMemberLocked();
    EndLocked(
        hsdp::v1::FAILURE_CAUSE_EVICTED,
        absl::StrCat("worker ", evicted, " evicted (at the step boundary)"),
        evicted, options_.clock->Now(), /*at_boundary=*/true);
  } else if (grow) {
    EndLocked(hsdp::v1::FAILURE_CAUSE_UNSPECIFIED,
              "workers joined: growing (at the step boundary)", 0,
              options_.clock->Now(), /*at_boundary=*/true);
  }
  changed_.SignalAll();
  return absl::OkStatus();
}

}  // namespace hsdp::coordinator
