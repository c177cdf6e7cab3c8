// Membership's persistence: restoring from the state store and saving to it.
#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/mesh_proto.h"
#include "coordinator/core/kv_store.h"
#include "coordinator/core/membership.h"
#include "coordinator/core/state_store.h"

namespace hsdp::coordinator {

using hsdp::v1::WorkerState;

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
  model_ = state.model();
  units_ = UnitListFromProto(state.units());
  if (state.has_training()) training_ = state.training();
  const absl::Time now = options_.clock->Now();
  for (const auto& record : state.workers()) {
    Worker w;
    w.id = record.worker_id();
    w.hostname = record.hostname();
    w.device = record.device();
    w.liveness = FromRecordState(record.state());
    w.restored = w.liveness == Liveness::kAlive;
    w.evicted = record.evicted();
    w.last_heartbeat = now;
    w.generation = record.generation();
    w.rank = record.rank();
    w.role = record.role();
    w.holder_shard = record.holder_shard();
    w.last_shard = w.rank >= 0 ? w.rank % options_.mesh.shard : w.holder_shard;
    w.history.assign(record.history().begin(), record.history().end());
    next_worker_id_ = std::max(next_worker_id_, w.id + 1);
    workers_[w.id] = std::move(w);
  }
  next_worker_id_ = std::max(next_worker_id_, state.next_worker_id());
  if (state.has_current_generation()) {
    const auto& g = state.current_generation();
    current_.info = g.info();
    switch (g.phase()) {
      case state::GENERATION_PHASE_ACTIVE:
        current_.phase = Phase::kActive;
        break;
      case state::GENERATION_PHASE_ENDING:
        current_.phase = Phase::kEnding;
        break;
      case state::GENERATION_PHASE_NONE:
        current_.phase = Phase::kNone;
        break;
      default:
        current_.phase = Phase::kOpen;
        break;
    }
    current_.end_cause = g.end_cause();
    current_.end_detail = g.end_detail();
    current_.ended_at_boundary = g.ended_at_boundary();
  } else if (!state.members().empty() || state.generation() > 0) {
    // A state directory from before worker ids: its members keep their
    // ranks in the first generation, under new ids.
    current_.info.set_generation(state.generation());
    current_.info.set_rendezvous_prefix(
        RendezvousPrefix(options_.job_id, state.generation()));
    for (const auto& member : state.members()) {
      if (member.rank() < 0 || member.rank() >= options_.world_size) continue;
      Worker w;
      w.id = next_worker_id_++;
      w.hostname = member.hostname();
      w.device = member.device();
      w.restored = true;
      w.last_heartbeat = now;
      w.generation = state.generation();
      w.rank = member.rank();
      current_.info.set_worker_ids(member.rank(), w.id);
      workers_[w.id] = std::move(w);
    }
    const bool full = std::count(current_.info.worker_ids().begin(),
                                 current_.info.worker_ids().end(), 0) == 0;
    current_.phase = full ? Phase::kActive : Phase::kOpen;
  }
  // Ended before the restart: the confirm window starts again.
  current_.ended_at = now;
  current_.voted.assign(current_.info.worker_ids_size(), false);
  for (const int64_t id : current_.info.worker_ids()) {
    const Worker* w = FindLocked(id);
    if (w != nullptr && w->evicted && current_.phase == Phase::kActive) {
      current_.evict_since = now;
    }
  }
  starts_[current_.info.generation()] = current_.info.start_step();
  failed_message_ = state.failed_message();
  failures_ = state.failures();
  if (state.has_last_failure()) last_failure_ = state.last_failure();
  if (std::optional<state::CommitPoint> point = store_->commit_point()) {
    last_committed_ = point->step();
    if (point->generation() == current_.info.generation()) {
      current_.committed = point->committed_in_generation();
    }
  }
  return absl::OkStatus();
}

absl::Status Membership::PersistLocked() {
  if (store_ == nullptr) return absl::OkStatus();
  return store_->Update(
      [&](PersistedState* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        s->set_generation(current_.info.generation());
        s->set_model(model_);
        s->mutable_units()->Assign(units_.begin(), units_.end());
        if (training_.has_value()) {
          *s->mutable_training() = *training_;
        } else {
          s->clear_training();
        }
        s->clear_members();
        s->clear_workers();
        for (const auto& [id, w] : workers_) {
          state::WorkerRecord* r = s->add_workers();
          r->set_worker_id(id);
          r->set_hostname(w.hostname);
          r->set_device(w.device);
          r->set_state(RecordState(w.liveness));
          r->set_generation(w.generation);
          r->set_rank(w.rank);
          r->set_role(w.role);
          r->set_holder_shard(w.holder_shard);
          r->set_evicted(w.evicted);
          r->mutable_history()->Assign(w.history.begin(), w.history.end());
        }
        state::GenerationRecord* g = s->mutable_current_generation();
        *g->mutable_info() = current_.info;
        switch (current_.phase) {
          case Phase::kOpen:
            g->set_phase(state::GENERATION_PHASE_OPEN);
            break;
          case Phase::kActive:
            g->set_phase(state::GENERATION_PHASE_ACTIVE);
            break;
          case Phase::kEnding:
            g->set_phase(state::GENERATION_PHASE_ENDING);
            break;
          case Phase::kNone:
            g->set_phase(state::GENERATION_PHASE_NONE);
            break;
        }
        g->set_end_cause(current_.end_cause);
        g->set_end_detail(current_.end_detail);
        g->set_ended_at_boundary(current_.ended_at_boundary);
        s->set_next_worker_id(next_worker_id_);
        s->set_failed_message(failed_message_);
        s->set_failures(failures_);
        if (last_failure_.has_value()) {
          *s->mutable_last_failure() = *last_failure_;
        } else {
          s->clear_last_failure();
        }
      });
}

WorkerState Membership::RecordState(Liveness liveness) {
  switch (liveness) {
    case Liveness::kLost:
      return hsdp::v1::WORKER_STATE_LOST;
    case Liveness::kEvicted:
      return hsdp::v1::WORKER_STATE_EVICTED;
    case Liveness::kFinished:
      return hsdp::v1::WORKER_STATE_FINISHED;
    case Liveness::kAlive:
      break;
  }
  return hsdp::v1::WORKER_STATE_ALIVE;
}

Membership::Liveness Membership::FromRecordState(WorkerState state) {
  switch (state) {
    case hsdp::v1::WORKER_STATE_LOST:
      return Liveness::kLost;
    case hsdp::v1::WORKER_STATE_EVICTED:
      return Liveness::kEvicted;
    case hsdp::v1::WORKER_STATE_FINISHED:
      return Liveness::kFinished;
    default:
      return Liveness::kAlive;
  }
}

absl::Status Membership::PersistCommitLocked() {
  if (store_ == nullptr) return absl::OkStatus();
  state::CommitPoint point;
  point.set_generation(current_.info.generation());
  point.set_step(last_committed_);
  point.set_committed_in_generation(current_.committed);
  return store_->SaveCommitPoint(point);
}

}  // namespace hsdp::coordinator
