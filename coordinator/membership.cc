// Membership: workers, joins, heartbeats, evictions, persistence and
// snapshots. Ending and forming generations and the step commits are in
// membership_generation.cc.
#include "coordinator/membership.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/training_spec.h"
#include "coordinator/kv_store.h"

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
  if (rank < 0 || rank >= ids.size() || ids[rank] == 0 ||
      FindLocked(ids[rank]) == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("rank ", rank, " has not joined job ", options_.job_id));
  }
  return FindLocked(ids[rank]);
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

absl::StatusOr<int> Membership::PickOpenRankLocked(const JoinArgs& args) const {
  const auto& ids = current_.info.worker_ids();
  const int world = ids.size();
  if (args.rank_hint.has_value() && *args.rank_hint >= 0) {
    const int hint = *args.rank_hint;
    if (hint >= world) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rank hint ", hint, " is outside the world [0, ", world, ")"));
    }
    if (ids[hint] != 0) {
      const Worker* holder = FindLocked(ids[hint]);
      return absl::AlreadyExistsError(
          absl::StrCat("rank ", hint, " is taken by host ",
                       holder != nullptr ? holder->hostname : "?"));
    }
    return hint;
  }
  // Shard groups are meant to lie inside one host (their collectives run
  // every unit, every step): first a group already on the joiner's host,
  // then a group nobody took yet, so the next joiner from another host does
  // not land beside it.
  const int s = options_.mesh.shard;
  int first_free = -1;
  int first_empty_group = -1;
  for (int start = 0; start < world; start += s) {
    int free_rank = -1;
    bool taken = false;
    bool all_on_host = true;
    for (int rank = start; rank < std::min(world, start + s); ++rank) {
      if (ids[rank] == 0) {
        if (free_rank < 0) free_rank = rank;
        continue;
      }
      taken = true;
      const Worker* holder = FindLocked(ids[rank]);
      all_on_host &= holder != nullptr && holder->hostname == args.hostname;
    }
    if (free_rank < 0) continue;
    if (first_free < 0) first_free = free_rank;
    if (args.hostname.empty()) break;
    if (taken && all_on_host) return free_rank;
    if (!taken && first_empty_group < 0) first_empty_group = free_rank;
  }
  if (first_empty_group >= 0) return first_empty_group;
  if (first_free >= 0) return first_free;
  return absl::InternalError("the open generation has no free rank");
}

std::vector<std::string> Membership::TopologyWarningsLocked() const {
  if (current_.phase == Phase::kNone) return {};
  std::vector<std::string> hosts;
  hosts.reserve(current_.info.worker_ids_size());
  for (const int64_t id : current_.info.worker_ids()) {
    const Worker* w = id != 0 ? FindLocked(id) : nullptr;
    hosts.push_back(w != nullptr ? w->hostname : std::string());
  }
  return ShardGroupsAcrossHosts(current_.info.mesh().shard(), hosts);
}

void Membership::ReportTopologyLocked() {
  if (listener_ == nullptr) return;
  const std::vector<std::string> warnings = TopologyWarningsLocked();
  if (!warnings.empty()) {
    listener_->OnShardGroupsAcrossHosts(current_.info.generation(), warnings);
  }
}

int Membership::NonMembersAliveLocked() const {
  int count = 0;
  for (const auto& [id, w] : workers_) {
    count +=
        w.liveness == Liveness::kAlive && !w.evicted && !IsMemberLocked(id);
  }
  return count;
}

void Membership::PruneDepartedLocked() {
  std::vector<int64_t> departed;
  for (const auto& [id, w] : workers_) {
    if (w.liveness != Liveness::kAlive && !IsMemberLocked(id)) {
      departed.push_back(id);
    }
  }
  // Ids grow with time: the oldest go first.
  for (size_t i = 0;
       departed.size() - i > static_cast<size_t>(kMaxDepartedWorkers); ++i) {
    workers_.erase(departed[i]);
  }
}

JoinResult Membership::JoinResultLocked(const Worker& w) const {
  JoinResult result;
  result.worker_id = w.id;
  result.state = StateOfLocked(w);
  result.rank = IsMemberLocked(w.id) ? RankOfLocked(w.id) : -1;
  result.member = result.rank >= 0;
  result.generation = current_.info;
  if (result.member) {
    result.coord =
        RankToCoord(MeshFromProto(current_.info.mesh()), result.rank);
  }
  return result;
}

absl::StatusOr<JoinResult> Membership::Join(const JoinArgs& args) {
  if (absl::Status s = ValidateUnitList(args.units); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  // A replacement may take a rank whose holder timed out but was not swept
  // yet.
  SweepLocked();
  if (!failed_message_.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", options_.job_id, " failed: ", failed_message_));
  }
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
  const absl::Time now = options_.clock->Now();

  // Taking a restored place back: by worker id, or (clients without ids) by
  // rank hint from the same host.
  Worker* back = nullptr;
  if (args.worker_id != 0) {
    back = FindLocked(args.worker_id);
    if (back == nullptr) {
      return absl::NotFoundError(absl::StrCat(
          "worker ", args.worker_id, " is unknown to job ", options_.job_id,
          " (the coordinator lost its state?): join as a new worker"));
    }
    if (absl::Status s = CheckNotLostLocked(*back); !s.ok()) return s;
    if (back->liveness != Liveness::kAlive) {
      return absl::FailedPreconditionError(
          absl::StrCat("worker ", back->id, " already left the job (",
                       hsdp::v1::WorkerState_Name(StateOfLocked(*back)), ")"));
    }
  } else if (args.rank_hint.has_value() && *args.rank_hint >= 0 &&
             *args.rank_hint < current_.info.worker_ids_size()) {
    Worker* holder = FindLocked(current_.info.worker_ids(*args.rank_hint));
    if (holder != nullptr && holder->restored &&
        holder->hostname == args.hostname &&
        holder->liveness == Liveness::kAlive) {
      back = holder;
    }
  }
  if (back != nullptr) {
    back->restored = false;
    back->last_heartbeat = now;
    back->device = args.device;
    AddEventLocked(*back, hsdp::v1::WORKER_EVENT_KIND_REJOINED, "");
    if (args.worker_id == 0 && last_committed_ >= 0) {
      // A new process (no id) in a restored place: whatever state the place
      // held died with the old process, so it holds none, and a generation
      // that counted on it ends (it re-forms from the live holders, or from
      // the newest checkpoint when there are none).
      back->holder_shard = -1;
      if (IsMemberLocked(back->id)) {
        EndLocked(hsdp::v1::FAILURE_CAUSE_LOST,
                  absl::StrCat("worker ", back->id, " (rank ", back->rank,
                               ") came back as a new process without its "
                               "state"),
                  back->id, now, /*at_boundary=*/false);
      }
    }
    (void)PersistLocked();  // history only: best effort
    JoinResult result = JoinResultLocked(*back);
    result.replaced = true;
    return result;
  }

  const std::map<int64_t, Worker> previous_workers = workers_;
  const Current previous_current = current_;
  const int64_t previous_next_id = next_worker_id_;
  Worker w;
  w.id = next_worker_id_++;
  w.hostname = args.hostname;
  w.device = args.device;
  w.last_heartbeat = now;
  w.ready = true;
  bool formed_open = false;
  if (current_.phase == Phase::kOpen) {
    absl::StatusOr<int> rank = PickOpenRankLocked(args);
    if (!rank.ok()) {
      next_worker_id_ = previous_next_id;
      return rank.status();
    }
    current_.info.set_worker_ids(*rank, w.id);
    w.generation = current_.info.generation();
    w.rank = *rank;
    w.role = hsdp::v1::GENERATION_ROLE_TRAIN;
    w.holder_shard = *rank % options_.mesh.shard;
    w.last_shard = w.holder_shard;
    if (std::count(current_.info.worker_ids().begin(),
                   current_.info.worker_ids().end(), 0) == 0) {
      current_.phase = Phase::kActive;
      formed_open = true;
    }
  } else if (NonMembersAliveLocked() >= options_.world_size) {
    next_worker_id_ = previous_next_id;
    return absl::ResourceExhaustedError(absl::StrCat(
        "job ", options_.job_id, " is full: ", current_.info.worker_ids_size(),
        " members and ", options_.world_size, " workers waiting to join"));
  }
  const int64_t id = w.id;
  workers_[id] = std::move(w);
  Worker& joined = workers_[id];
  AddEventLocked(joined, hsdp::v1::WORKER_EVENT_KIND_JOINED,
                 absl::StrCat("host ", args.hostname));
  if (IsMemberLocked(id)) {
    AddEventLocked(joined, hsdp::v1::WORKER_EVENT_KIND_MEMBER, "");
  }
  const std::string previous_model = model_;
  if (establishes) {
    model_ = args.model;
    units_ = args.units;
  }
  if (establishes_training) training_ = args.training;
  PruneDepartedLocked();
  if (absl::Status s = PersistLocked(); !s.ok()) {
    // Nothing changes when the join cannot be made durable.
    workers_ = previous_workers;
    current_ = previous_current;
    next_worker_id_ = previous_next_id;
    if (establishes) {
      model_ = previous_model;
      units_.clear();
    }
    if (establishes_training) training_.reset();
    return s;
  }
  JoinResult result = JoinResultLocked(workers_[id]);
  result.established_model = establishes;
  if (formed_open) ReportTopologyLocked();
  UpdateGrowLocked();
  MaybeFormLocked();
  changed_.SignalAll();
  return result;
}

absl::StatusOr<HeartbeatResult> Membership::Heartbeat(int64_t worker_id,
                                                      int rank, int64_t step) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Worker*> found = ResolveLocked(worker_id, rank);
  if (!found.ok()) return found.status();
  Worker& w = **found;
  if (absl::Status s = CheckNotLostLocked(w); !s.ok()) return s;
  w.restored = false;
  w.last_heartbeat = options_.clock->Now();
  HeardFromLocked(w);
  w.step = step;
  HeartbeatResult result;
  result.worker_id = w.id;
  if (current_.phase == Phase::kActive || current_.phase == Phase::kOpen) {
    result.rank = RankOfLocked(w.id);
  }
  result.generation = current_.info.generation();
  result.job_state = JobStateLocked();
  result.worker_state = StateOfLocked(w);
  if (!failed_message_.empty()) {
    result.message = failed_message_;
  } else if (result.worker_state == hsdp::v1::WORKER_STATE_EVICTED) {
    result.message = "evicted by an operator";
  }
  return result;
}

absl::StatusOr<MemberContext> Membership::ResolveMember(
    int64_t worker_id, int rank, std::optional<int64_t> generation) const {
  absl::MutexLock lock(&mu_);
  const Worker* w = nullptr;
  if (worker_id != 0) {
    w = FindLocked(worker_id);
    if (w == nullptr) {
      return absl::NotFoundError(absl::StrCat("worker ", worker_id,
                                              " is unknown to job ",
                                              options_.job_id, ": join again"));
    }
  } else {
    const auto& ids = current_.info.worker_ids();
    if (rank >= 0 && rank < ids.size()) w = FindLocked(ids[rank]);
    if (w == nullptr) {
      return absl::NotFoundError(
          absl::StrCat("rank ", rank, " has not joined job ", options_.job_id));
    }
  }
  if (absl::Status s = CheckNotLostLocked(*w); !s.ok()) return s;
  const bool ended =
      current_.phase == Phase::kEnding || current_.phase == Phase::kNone;
  if ((generation.has_value() && *generation != current_.info.generation()) ||
      (ended && (generation.has_value() || RankOfLocked(w->id) >= 0))) {
    return absl::AbortedError(absl::StrCat(
        "generation ",
        generation.has_value() ? *generation : current_.info.generation(),
        " ended (the current one is ", current_.info.generation(),
        ended ? ", ending" : "", "): abort the communicators and re-form"));
  }
  const int member_rank = IsMemberLocked(w->id) ? RankOfLocked(w->id) : -1;
  if (member_rank < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("worker ", w->id, " is not a member of generation ",
                     current_.info.generation(), " (",
                     hsdp::v1::WorkerState_Name(StateOfLocked(*w)),
                     "): wait for a generation in AwaitGeneration"));
  }
  MemberContext context;
  context.worker_id = w->id;
  context.rank = member_rank;
  context.generation = ScheduleContextLocked();
  return context;
}

absl::Status Membership::MarkFinished(int64_t worker_id, int rank) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Worker*> found = ResolveLocked(worker_id, rank);
  if (!found.ok()) return found.status();
  Worker& w = **found;
  if (absl::Status s = CheckNotLostLocked(w); !s.ok()) return s;
  if (w.liveness == Liveness::kFinished) return absl::OkStatus();
  w.liveness = Liveness::kFinished;
  w.last_heartbeat = options_.clock->Now();
  AddEventLocked(w, hsdp::v1::WORKER_EVENT_KIND_FINISHED, "");
  (void)PersistLocked();  // best effort: finishing does not fail on disk
  changed_.SignalAll();
  return absl::OkStatus();
}

absl::StatusOr<EvictResult> Membership::Evict(
    std::optional<int> rank, std::optional<int64_t> worker_id) {
  absl::MutexLock lock(&mu_);
  Worker* w = nullptr;
  if (worker_id.has_value()) {
    w = FindLocked(*worker_id);
    if (w == nullptr) {
      return absl::NotFoundError(absl::StrCat(
          "worker_id: no worker ", *worker_id, " in job ", options_.job_id));
    }
  } else if (rank.has_value()) {
    if (current_.phase == Phase::kNone || *rank < 0 ||
        *rank >= current_.info.worker_ids_size() ||
        current_.info.worker_ids(*rank) == 0) {
      return absl::NotFoundError(
          absl::StrCat("rank: generation ", current_.info.generation(),
                       " has no member at rank ", *rank));
    }
    w = FindLocked(current_.info.worker_ids(*rank));
  } else {
    return absl::InvalidArgumentError("target: set a rank or a worker_id");
  }
  if (w->liveness != Liveness::kAlive || w->evicted) {
    return absl::FailedPreconditionError(
        absl::StrCat("worker ", w->id, " already left the job (",
                     hsdp::v1::WorkerState_Name(StateOfLocked(*w)), ")"));
  }
  EvictResult result;
  result.worker_id = w->id;
  AddEventLocked(*w, hsdp::v1::WORKER_EVENT_KIND_EVICTED, "by an operator");
  const bool member = IsMemberLocked(w->id);
  if (member && current_.phase == Phase::kOpen) {
    // Nobody trained yet: the rank is simply free again.
    current_.info.set_worker_ids(RankOfLocked(w->id), 0);
    w->liveness = Liveness::kEvicted;
  } else if (member && current_.phase == Phase::kActive) {
    // Leaves at the next step boundary.
    w->evicted = true;
    result.generation = current_.info.generation();
    if (!current_.evict_since.has_value()) {
      current_.evict_since = options_.clock->Now();
    }
  } else {
    w->liveness = Liveness::kEvicted;
    if (member) result.generation = current_.info.generation();
  }
  (void)PersistLocked();
  MaybeFormLocked();
  changed_.SignalAll();
  return result;
}

std::vector<int64_t> Membership::SweepLocked() {
  const absl::Time now = options_.clock->Now();
  const absl::Duration gap = now - last_sweep_;
  last_sweep_ = now;
  if (options_.pause_threshold > absl::ZeroDuration() &&
      gap > options_.pause_threshold) {
    // Nobody could have been heard while the coordinator did not run.
    for (auto& [id, w] : workers_) {
      if (w.liveness == Liveness::kAlive) {
        w.last_heartbeat = std::min(now, w.last_heartbeat + gap);
      }
    }
    if (current_.phase == Phase::kEnding) {
      current_.ended_at = std::min(now, current_.ended_at + gap);
    }
  }
  std::vector<int64_t> lost;
  // All of them first: forming a generation must not count one that is lost
  // in this same sweep.
  int64_t lost_member = 0;
  int lost_rank = -1;
  for (auto& [id, w] : workers_) {
    if (w.liveness != Liveness::kAlive ||
        now - w.last_heartbeat <= options_.heartbeat_timeout) {
      continue;
    }
    w.liveness = Liveness::kLost;
    lost.push_back(id);
    AddEventLocked(w, hsdp::v1::WORKER_EVENT_KIND_LOST,
                   absl::StrCat("no heartbeat for ",
                                absl::FormatDuration(now - w.last_heartbeat)));
    const int rank = RankOfLocked(id);
    if (rank < 0 || current_.phase == Phase::kNone) continue;
    if (current_.phase == Phase::kOpen) {
      current_.info.set_worker_ids(rank, 0);
    } else if (lost_member == 0) {
      lost_member = id;
      lost_rank = rank;
    }
  }
  if (lost_member != 0) {
    EndLocked(hsdp::v1::FAILURE_CAUSE_LOST,
              absl::StrCat("worker ", lost_member, " (rank ", lost_rank,
                           ") missed its heartbeats"),
              lost_member, workers_[lost_member].last_heartbeat,
              /*at_boundary=*/false);
  }
  if (!lost.empty()) {
    // Best effort: losing a worker must not fail because the disk did; the
    // state is persisted again with the next successful write.
    (void)PersistLocked();
    changed_.SignalAll();
  }
  return lost;
}

std::vector<int64_t> Membership::Tick() {
  absl::MutexLock lock(&mu_);
  std::vector<int64_t> lost = SweepLocked();
  const absl::Time now = options_.clock->Now();
  if (current_.phase == Phase::kActive) {
    UpdateGrowLocked();
    if (current_.evict_since.has_value() &&
        now - *current_.evict_since >= options_.join_wait) {
      const int64_t evicted = FirstEvictedMemberLocked();
      EndLocked(hsdp::v1::FAILURE_CAUSE_EVICTED,
                absl::StrCat("worker ", evicted,
                             " evicted; no step boundary within the join wait"),
                evicted, now, /*at_boundary=*/false);
    } else if (current_.grow_since.has_value() &&
               now - *current_.grow_since >= options_.join_wait) {
      EndLocked(hsdp::v1::FAILURE_CAUSE_UNSPECIFIED,
                "workers joined; no step boundary within the join wait", 0, now,
                /*at_boundary=*/false);
    }
  }
  MaybeFormLocked();
  return lost;
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
