// Membership: creation, the lookups every part uses, and snapshots. The
// other parts: membership_workers.cc (joins, heartbeats, evictions, the
// sweep), membership_generation.cc (ending and forming generations),
// membership_commit.cc (the step commit), membership_persistence.cc (the
// state store).
#include "coordinator/core/membership.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/mesh_proto.h"
#include "common/training_spec.h"
#include "coordinator/core/generation_plan.h"
#include "coordinator/core/kv_store.h"
#include "coordinator/core/state_store.h"

namespace hsdp::coordinator {
namespace {

using hsdp::v1::WorkerState;

int64_t UnixMillis(absl::Time t) { return absl::ToUnixMillis(t); }

// The first generation: the job's mesh, every rank free.
hsdp::v1::Generation FirstGeneration(const std::string& job_id,
                                     const MeshShape& mesh) {
  hsdp::v1::Generation g;
  g.set_generation(0);
  *g.mutable_mesh() = MeshToProto(mesh);
  g.set_rendezvous_prefix(RendezvousPrefix(job_id, 0));
  g.set_start_step(0);
  for (int r = 0; r < mesh.world_size(); ++r) {
    g.add_worker_ids(0);
    g.add_roles(hsdp::v1::GENERATION_ROLE_TRAIN);
  }
  return g;
}

}  // namespace

Membership::Membership(Options options, StateStore* store)
    : options_(std::move(options)), store_(store) {
  current_.info = FirstGeneration(options_.job_id, options_.mesh);
  current_.voted.assign(options_.world_size, false);
  starts_[0] = 0;
  last_sweep_ = options_.clock->Now();
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
  if (options.min_replicas < 1 ||
      options.min_replicas > options.mesh.replicate) {
    return absl::InvalidArgumentError(
        absl::StrCat("min replicas ", options.min_replicas, " is outside [1, ",
                     options.mesh.replicate, "] (the mesh's replica groups)"));
  }
  if (options.join_wait < absl::ZeroDuration() ||
      options.reform_window < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "join wait ", absl::FormatDuration(options.join_wait),
        " and reform window ", absl::FormatDuration(options.reform_window),
        " must not be negative"));
  }
  if (options.clock == nullptr) options.clock = Clock::Real();
  std::unique_ptr<Membership> membership(
      new Membership(std::move(options), store));
  absl::MutexLock lock(&membership->mu_);
  if (absl::Status s = membership->RestoreLocked(); !s.ok()) return s;
  return membership;
}

void Membership::SetListener(MembershipListener* listener) {
  absl::MutexLock lock(&mu_);
  listener_ = listener;
}

absl::Status Membership::CheckJobId(absl::string_view job_id) const {
  if (job_id == options_.job_id) return absl::OkStatus();
  return absl::NotFoundError(absl::StrCat(
      "job ", job_id, " is not served here (this coordinator runs job ",
      options_.job_id, ")"));
}

Membership::Worker* Membership::FindLocked(int64_t worker_id) {
  auto it = workers_.find(worker_id);
  return it == workers_.end() ? nullptr : &it->second;
}

const Membership::Worker* Membership::FindLocked(int64_t worker_id) const {
  auto it = workers_.find(worker_id);
  return it == workers_.end() ? nullptr : &it->second;
}

absl::StatusOr<Membership::Worker*> Membership::FindLiveLocked(
    int64_t worker_id) {
  Worker* w = FindLocked(worker_id);
  if (w == nullptr) {
    return absl::NotFoundError(absl::StrCat(
        "worker ", worker_id, " is unknown to job ", options_.job_id,
        " (a coordinator restarted without its state?): join again"));
  }
  if (absl::Status s = CheckNotLostLocked(*w); !s.ok()) return s;
  return w;
}

absl::StatusOr<Membership::Worker*> Membership::ResolveLocked(int64_t worker_id,
                                                              int rank) {
  if (worker_id != 0) {
    Worker* w = FindLocked(worker_id);
    if (w == nullptr) return FindLiveLocked(worker_id).status();
    return w;
  }
  const auto& ids = current_.info.worker_ids();
  Worker* w = rank < 0 || rank >= ids.size() || ids[rank] == 0
                  ? nullptr
                  : FindLocked(ids[rank]);
  if (w == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("rank ", rank, " has not joined job ", options_.job_id));
  }
  return w;
}

absl::Status Membership::CheckNotLostLocked(const Worker& w) const {
  if (w.liveness != Liveness::kLost) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("worker ", w.id, " was declared lost (no heartbeat within ",
                   absl::FormatDuration(options_.heartbeat_timeout),
                   "); join again as a new worker"));
}

bool Membership::IsMemberLocked(int64_t worker_id) const {
  return worker_id != 0 && current_.phase != Phase::kNone &&
         RankOfLocked(worker_id) >= 0;
}

int Membership::RankOfLocked(int64_t worker_id) const {
  const auto& ids = current_.info.worker_ids();
  if (worker_id != 0) {  // 0 marks open ranks: the first one is scanned for
    auto it = rank_cache_.find(worker_id);
    if (it != rank_cache_.end() && it->second < ids.size() &&
        ids[it->second] == worker_id) {
      return it->second;
    }
  }
  int rank = -1;
  for (int r = 0; r < ids.size(); ++r) {
    if (ids[r] == worker_id) {
      rank = r;
      break;
    }
  }
  if (rank >= 0 && worker_id != 0) {
    rank_cache_.clear();
    // The first rank holding an id, as the scan answers.
    for (int r = 0; r < ids.size(); ++r) {
      if (ids[r] != 0) rank_cache_.emplace(ids[r], r);
    }
  }
  return rank;
}

WorkerState Membership::StateOfLocked(const Worker& w) const {
  if (w.evicted || w.liveness == Liveness::kEvicted)
    return hsdp::v1::WORKER_STATE_EVICTED;
  if (w.liveness == Liveness::kLost) return hsdp::v1::WORKER_STATE_LOST;
  if (w.liveness == Liveness::kFinished) return hsdp::v1::WORKER_STATE_FINISHED;
  if (IsMemberLocked(w.id)) return hsdp::v1::WORKER_STATE_ALIVE;
  return w.generation >= 0 ? hsdp::v1::WORKER_STATE_STANDBY
                           : hsdp::v1::WORKER_STATE_JOINING;
}

hsdp::v1::JobState Membership::JobStateLocked() const {
  if (!failed_message_.empty()) return hsdp::v1::JOB_STATE_FAILED;
  if (current_.phase == Phase::kOpen || current_.phase == Phase::kNone) {
    return hsdp::v1::JOB_STATE_WAITING;
  }
  bool all_finished = current_.info.worker_ids_size() > 0;
  // Stops at the first member still training: O(1) while a job runs (this is
  // on every heartbeat and report).
  for (const int64_t id : current_.info.worker_ids()) {
    const Worker* w = FindLocked(id);
    if (w == nullptr || w->liveness != Liveness::kFinished) {
      all_finished = false;
      break;
    }
  }
  if (all_finished) return hsdp::v1::JOB_STATE_FINISHED;
  if (draining_) return hsdp::v1::JOB_STATE_DRAINING;
  if (current_.phase == Phase::kEnding) return hsdp::v1::JOB_STATE_REFORMING;
  if (current_.info.mesh().replicate() < options_.mesh.replicate) {
    return hsdp::v1::JOB_STATE_DEGRADED;
  }
  return hsdp::v1::JOB_STATE_RUNNING;
}

void Membership::AddEventLocked(Worker& w, hsdp::v1::WorkerEventKind kind,
                                const std::string& detail) {
  hsdp::v1::WorkerEvent event;
  event.set_time_unix_ms(UnixMillis(options_.clock->Now()));
  event.set_kind(kind);
  event.set_generation(current_.info.generation());
  const int rank = RankOfLocked(w.id);
  event.set_rank(rank);
  if (rank >= 0) event.set_role(current_.info.roles(rank));
  event.set_detail(detail);
  w.history.push_back(std::move(event));
  while (static_cast<int>(w.history.size()) > kMaxWorkerHistory) {
    w.history.pop_front();
  }
}

void Membership::Shutdown() {
  absl::MutexLock lock(&mu_);
  shutdown_ = true;
  changed_.SignalAll();
}

void Membership::SetDraining(bool draining) {
  absl::MutexLock lock(&mu_);
  draining_ = draining;
}

hsdp::v1::JobState Membership::job_state() const {
  absl::MutexLock lock(&mu_);
  return JobStateLocked();
}

int64_t Membership::generation() const {
  absl::MutexLock lock(&mu_);
  return current_.info.generation();
}

hsdp::v1::Generation Membership::current_generation() const {
  absl::MutexLock lock(&mu_);
  return current_.info;
}

int64_t Membership::last_committed_step() const {
  absl::MutexLock lock(&mu_);
  return last_committed_;
}

int Membership::workers_alive() const {
  absl::MutexLock lock(&mu_);
  int alive = 0;
  for (const auto& [id, w] : workers_) {
    alive += w.liveness == Liveness::kAlive && IsMemberLocked(id);
  }
  return alive;
}

MembershipStatus Membership::Status() const {
  absl::MutexLock lock(&mu_);
  MembershipStatus status;
  status.job_state = JobStateLocked();
  status.generation = current_.info.generation();
  status.replicas =
      current_.phase == Phase::kNone ? 0 : current_.info.mesh().replicate();
  for (const auto& [id, w] : workers_) {
    const WorkerState state = StateOfLocked(w);
    status.members_alive += state == hsdp::v1::WORKER_STATE_ALIVE;
    status.standby += state == hsdp::v1::WORKER_STATE_STANDBY;
    status.joining += state == hsdp::v1::WORKER_STATE_JOINING;
  }
  status.last_committed_step = last_committed_;
  if (!failed_message_.empty()) {
    status.message = failed_message_;
  } else if (current_.phase == Phase::kNone) {
    status.message = absl::StrCat("waiting for workers: ", waiting_message_);
  } else if (current_.phase == Phase::kEnding) {
    status.confirmed = static_cast<int>(current_.confirmed.size());
    status.message =
        absl::StrCat("generation ", current_.info.generation(), " ended (",
                     current_.end_detail, "); ", status.confirmed, " of ",
                     current_.info.worker_ids_size(), " members confirmed");
  } else if (current_.phase == Phase::kOpen) {
    const int free =
        static_cast<int>(std::count(current_.info.worker_ids().begin(),
                                    current_.info.worker_ids().end(), 0));
    status.message = absl::StrCat(free, " of ", options_.world_size,
                                  " rank(s) not joined yet");
  }
  status.failures = failures_;
  status.last_failure = last_failure_;
  status.topology_warnings = TopologyWarningsLocked();
  return status;
}

std::map<hsdp::v1::WorkerState, int> Membership::StateCounts() const {
  absl::MutexLock lock(&mu_);
  std::map<hsdp::v1::WorkerState, int> counts;
  for (const auto& [id, w] : workers_) ++counts[StateOfLocked(w)];
  return counts;
}

std::vector<WorkerSnapshot> Membership::Workers() const {
  absl::MutexLock lock(&mu_);
  const absl::Time now = options_.clock->Now();
  const MeshShape mesh = MeshFromProto(current_.info.mesh());
  std::vector<WorkerSnapshot> members, others;
  for (const auto& [id, w] : workers_) {
    WorkerSnapshot s;
    s.worker_id = id;
    s.state = StateOfLocked(w);
    s.rank = IsMemberLocked(id) ? RankOfLocked(id) : -1;
    s.hostname = w.hostname;
    s.device = w.device;
    if (s.rank >= 0) s.coord = RankToCoord(mesh, s.rank);
    s.heartbeat_age = now - w.last_heartbeat;
    s.restored = w.restored;
    s.step = w.step;
    s.generation = w.generation;
    s.role = w.role;
    s.history.assign(w.history.begin(), w.history.end());
    (s.rank >= 0 ? members : others).push_back(std::move(s));
  }
  std::sort(members.begin(), members.end(),
            [](const WorkerSnapshot& a, const WorkerSnapshot& b) {
              return a.rank < b.rank;
            });
  members.insert(members.end(), others.begin(), others.end());
  return members;
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
