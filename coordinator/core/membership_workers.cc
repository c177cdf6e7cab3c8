// Membership: joins, heartbeats, finishing, evictions and the sweep that
// loses silent workers.
#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/mesh_proto.h"
#include "common/training_spec.h"
#include "coordinator/core/generation_plan.h"
#include "coordinator/core/membership.h"
#include "coordinator/core/state_store.h"

namespace hsdp::coordinator {

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

std::vector<std::string> Membership::HostsByRankLocked() const {
  std::vector<std::string> hosts;
  hosts.reserve(current_.info.worker_ids_size());
  for (const int64_t id : current_.info.worker_ids()) {
    const Worker* w = id != 0 ? FindLocked(id) : nullptr;
    hosts.push_back(w != nullptr ? w->hostname : std::string());
  }
  return hosts;
}

std::vector<std::string> Membership::TopologyWarningsLocked() const {
  if (current_.phase == Phase::kNone) return {};
  return ShardGroupsAcrossHosts(current_.info.mesh().shard(),
                                HostsByRankLocked());
}

void Membership::ReportTopologyLocked() {
  if (listener_ == nullptr) return;
  const std::vector<std::string> warnings = TopologyWarningsLocked();
  if (!warnings.empty()) {
    listener_->OnShardGroupsAcrossHosts(
        current_.info.generation(), current_.info.host_group_size(), warnings);
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
  if (formed_open) {
    current_.info.set_host_group_size(
        HostGroupSize(options_.mesh.shard, HostsByRankLocked()));
  }
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

}  // namespace hsdp::coordinator
