#include "coordinator/membership.h"

#include "absl/strings/str_cat.h"
#include "common/training_spec.h"

namespace hsdp::coordinator {

Membership::Membership(Options options, StateStore* store)
    : options_(std::move(options)), store_(store) {
  slots_.resize(options_.world_size);
}

absl::StatusOr<std::unique_ptr<Membership>> Membership::Create(
    Options options, StateStore* store) {
  if (absl::Status s = ValidateMesh(options.mesh, options.world_size); !s.ok())
    return s;
  if (options.heartbeat_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "heartbeat timeout ", absl::FormatDuration(options.heartbeat_timeout),
        " must be positive"));
  }
  if (options.clock == nullptr) options.clock = Clock::Real();
  std::unique_ptr<Membership> membership(
      new Membership(std::move(options), store));
  absl::MutexLock lock(&membership->mu_);
  if (absl::Status s = membership->RestoreLocked(); !s.ok()) return s;
  return membership;
}

absl::Status Membership::RestoreLocked() {
  if (store_ == nullptr) return absl::OkStatus();
  const PersistedState state = store_->state();
  if (!state.has_job()) {
    return store_->Update(
        [&](PersistedState* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          s->mutable_job()->set_job_id(options_.job_id);
          s->mutable_job()->set_world_size(options_.world_size);
          *s->mutable_job()->mutable_mesh() = MeshToProto(options_.mesh);
        });
  }
  const auto& job = state.job();
  if (job.job_id() != options_.job_id ||
      job.world_size() != options_.world_size ||
      MeshFromProto(job.mesh()) != options_.mesh) {
    return absl::FailedPreconditionError(
        absl::StrCat("state directory ", store_->dir(), " belongs to job ",
                     job.job_id(), " (world ", job.world_size(), ", mesh ",
                     MeshToString(MeshFromProto(job.mesh())), "), not job ",
                     options_.job_id, " (world ", options_.world_size,
                     ", mesh ", MeshToString(options_.mesh), ")"));
  }
  generation_ = state.generation();
  model_ = state.model();
  units_ = UnitListFromProto(state.units());
  if (state.has_training()) training_ = state.training();
  const absl::Time now = options_.clock->Now();
  for (const auto& member : state.members()) {
    if (member.rank() < 0 || member.rank() >= options_.world_size) continue;
    Slot& slot = slots_[member.rank()];
    slot.state = SlotState::kRestored;
    slot.hostname = member.hostname();
    slot.device = member.device();
    slot.last_heartbeat = now;
  }
  return absl::OkStatus();
}

absl::Status Membership::PersistLocked() {
  if (store_ == nullptr) return absl::OkStatus();
  return store_->Update(
      [&](PersistedState* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        s->set_generation(generation_);
        s->set_model(model_);
        s->mutable_units()->Assign(units_.begin(), units_.end());
        if (training_.has_value()) {
          *s->mutable_training() = *training_;
        } else {
          s->clear_training();
        }
        s->clear_members();
        for (int rank = 0; rank < static_cast<int>(slots_.size()); ++rank) {
          const Slot& slot = slots_[rank];
          if (slot.state == SlotState::kFree) continue;
          auto* member = s->add_members();
          member->set_rank(rank);
          member->set_hostname(slot.hostname);
          member->set_device(slot.device);
        }
      });
}

absl::Status Membership::CheckJobId(absl::string_view job_id) const {
  if (job_id == options_.job_id) return absl::OkStatus();
  return absl::NotFoundError(absl::StrCat(
      "job ", job_id, " is not served here (this coordinator runs job ",
      options_.job_id, ")"));
}

absl::StatusOr<int> Membership::PickRankLocked(const JoinArgs& args) const {
  const int world = options_.world_size;
  if (args.rank_hint.has_value() && *args.rank_hint >= 0) {
    const int hint = *args.rank_hint;
    if (hint >= world) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rank hint ", hint, " is outside the world [0, ", world, ")"));
    }
    const Slot& slot = slots_[hint];
    // A restored holder is taken over only by its own host (the worker
    // re-joining after the coordinator restarted); anyone else is a duplicate
    // rank.
    const bool restored_by_other =
        slot.state == SlotState::kRestored && slot.hostname != args.hostname;
    if (slot.state == SlotState::kAlive || slot.state == SlotState::kFinished ||
        restored_by_other) {
      return absl::AlreadyExistsError(
          absl::StrCat("rank ", hint, " is taken by host ", slot.hostname));
    }
    return hint;
  }
  for (int rank = 0; rank < world; ++rank) {
    if (slots_[rank].state == SlotState::kFree) return rank;
  }
  for (int rank = 0; rank < world; ++rank) {
    if (slots_[rank].state == SlotState::kLost) return rank;
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "job ", options_.job_id, " is full: all ", world, " ranks are taken"));
}

absl::StatusOr<JoinResult> Membership::Join(const JoinArgs& args) {
  if (absl::Status s = ValidateUnitList(args.units); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  // A replacement may take a slot whose holder timed out but was not swept yet.
  SweepLocked();
  const bool establishes = units_.empty();
  if (!establishes) {
    if (args.model != model_) {
      return absl::FailedPreconditionError(
          absl::StrCat("model \"", args.model,
                       "\" differs from the job's model \"", model_, "\""));
    }
    if (absl::Status s = CompareUnitLists(args.units, units_); !s.ok())
      return s;
  }
  if (args.training.has_value() && training_.has_value()) {
    if (absl::Status s = CompareTrainingSpecs(*args.training, *training_);
        !s.ok()) {
      return s;
    }
  }
  const bool establishes_training =
      args.training.has_value() && !training_.has_value();
  absl::StatusOr<int> rank = PickRankLocked(args);
  if (!rank.ok()) return rank.status();

  Slot& slot = slots_[*rank];
  const Slot previous = slot;
  const std::string previous_model = model_;
  JoinResult result;
  result.rank = *rank;
  result.replaced =
      slot.state == SlotState::kLost || slot.state == SlotState::kRestored;
  result.established_model = establishes;
  slot.state = SlotState::kAlive;
  slot.hostname = args.hostname;
  slot.device = args.device;
  slot.last_heartbeat = options_.clock->Now();
  slot.step = -1;
  if (establishes) {
    model_ = args.model;
    units_ = args.units;
  }
  if (establishes_training) training_ = args.training;
  if (absl::Status s = PersistLocked(); !s.ok()) {
    // Nothing changes when the join cannot be made durable.
    slot = previous;
    if (establishes) {
      model_ = previous_model;
      units_.clear();
    }
    if (establishes_training) training_.reset();
    return s;
  }
  result.coord = RankToCoord(options_.mesh, *rank);
  result.generation = generation_;
  return result;
}

absl::Status Membership::CheckMemberLocked(int rank) const {
  if (rank < 0 || rank >= options_.world_size ||
      slots_[rank].state == SlotState::kFree) {
    return absl::NotFoundError(
        absl::StrCat("rank ", rank, " has not joined job ", options_.job_id));
  }
  if (slots_[rank].state == SlotState::kLost) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", rank, " was declared lost (no heartbeat within ",
        absl::FormatDuration(options_.heartbeat_timeout), "); join again"));
  }
  return absl::OkStatus();
}

absl::Status Membership::CheckMember(int rank) const {
  absl::MutexLock lock(&mu_);
  return CheckMemberLocked(rank);
}

absl::Status Membership::Heartbeat(int rank, int64_t step) {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = CheckMemberLocked(rank); !s.ok()) return s;
  Slot& slot = slots_[rank];
  if (slot.state == SlotState::kRestored) slot.state = SlotState::kAlive;
  slot.last_heartbeat = options_.clock->Now();
  slot.step = step;
  return absl::OkStatus();
}

absl::Status Membership::MarkFinished(int rank) {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = CheckMemberLocked(rank); !s.ok()) return s;
  slots_[rank].state = SlotState::kFinished;
  slots_[rank].last_heartbeat = options_.clock->Now();
  return absl::OkStatus();
}

std::vector<int> Membership::SweepLocked() {
  const absl::Time now = options_.clock->Now();
  std::vector<int> lost;
  for (int rank = 0; rank < static_cast<int>(slots_.size()); ++rank) {
    Slot& slot = slots_[rank];
    if ((slot.state == SlotState::kAlive ||
         slot.state == SlotState::kRestored) &&
        now - slot.last_heartbeat > options_.heartbeat_timeout) {
      slot.state = SlotState::kLost;
      lost.push_back(rank);
    }
  }
  if (!lost.empty()) {
    ++generation_;
    // Best effort: losing a worker must not fail because the disk did; the
    // generation is persisted again with the next successful write.
    (void)PersistLocked();
  }
  return lost;
}

std::vector<int> Membership::SweepHeartbeats() {
  absl::MutexLock lock(&mu_);
  return SweepLocked();
}

int64_t Membership::BumpGeneration() {
  absl::MutexLock lock(&mu_);
  ++generation_;
  (void)PersistLocked();
  return generation_;
}

void Membership::SetDraining(bool draining) {
  absl::MutexLock lock(&mu_);
  draining_ = draining;
}

hsdp::v1::JobState Membership::job_state() const {
  absl::MutexLock lock(&mu_);
  bool all_finished = true, any_lost = false, any_free = false;
  for (const Slot& slot : slots_) {
    all_finished &= slot.state == SlotState::kFinished;
    any_lost |= slot.state == SlotState::kLost;
    any_free |= slot.state == SlotState::kFree;
  }
  if (all_finished) return hsdp::v1::JOB_STATE_FINISHED;
  if (draining_) return hsdp::v1::JOB_STATE_DRAINING;
  if (any_lost) return hsdp::v1::JOB_STATE_DEGRADED;
  if (any_free) return hsdp::v1::JOB_STATE_WAITING;
  return hsdp::v1::JOB_STATE_RUNNING;
}

int64_t Membership::generation() const {
  absl::MutexLock lock(&mu_);
  return generation_;
}

int Membership::workers_alive() const {
  absl::MutexLock lock(&mu_);
  int alive = 0;
  for (const Slot& slot : slots_) {
    alive +=
        slot.state == SlotState::kAlive || slot.state == SlotState::kRestored;
  }
  return alive;
}

std::vector<WorkerSnapshot> Membership::Workers() const {
  absl::MutexLock lock(&mu_);
  const absl::Time now = options_.clock->Now();
  std::vector<WorkerSnapshot> workers;
  for (int rank = 0; rank < static_cast<int>(slots_.size()); ++rank) {
    const Slot& slot = slots_[rank];
    if (slot.state == SlotState::kFree) continue;
    WorkerSnapshot w;
    w.rank = rank;
    switch (slot.state) {
      case SlotState::kAlive:
      case SlotState::kRestored:
        w.state = hsdp::v1::WORKER_STATE_ALIVE;
        break;
      case SlotState::kLost:
        w.state = hsdp::v1::WORKER_STATE_LOST;
        break;
      case SlotState::kFinished:
        w.state = hsdp::v1::WORKER_STATE_FINISHED;
        break;
      case SlotState::kFree:
        break;
    }
    w.hostname = slot.hostname;
    w.device = slot.device;
    w.coord = RankToCoord(options_.mesh, rank);
    w.heartbeat_age = now - slot.last_heartbeat;
    w.restored = slot.state == SlotState::kRestored;
    w.step = slot.step;
    workers.push_back(std::move(w));
  }
  return workers;
}

std::string Membership::model() const {
  absl::MutexLock lock(&mu_);
  return model_;
}

UnitList Membership::units() const {
  absl::MutexLock lock(&mu_);
  return units_;
}

bool Membership::has_model() const {
  absl::MutexLock lock(&mu_);
  return !units_.empty();
}

std::optional<hsdp::v1::TrainingSpec> Membership::training() const {
  absl::MutexLock lock(&mu_);
  return training_;
}

}  // namespace hsdp::coordinator
