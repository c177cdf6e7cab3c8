#include "coordinator/schedule_log.h"

#include <algorithm>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/policy.h"
#include "common/status_util.h"
#include "coordinator/trace_collector.h"

namespace hsdp::coordinator {
namespace {

// Refusal distance when Options::refuse_ahead is 0: this many read-ahead
// windows.
constexpr int kDefaultRefuseWindows = 4;
// The state directory's file that holds the generation starts.
constexpr char kStateFileName[] = "state.binpb";

}  // namespace

ScheduleLog::ScheduleLog(Options options, StateStore* store)
    : options_(options), store_(store) {
  completed_.assign(options_.world_size, -1);
  ranks_at_min_ = options_.world_size;
  current_.world_size = options_.world_size;
}

std::shared_ptr<const SealedSchedule> ScheduleLog::FindSealed(
    int64_t step) const {
  absl::ReaderMutexLock lock(&sealed_mu_);
  if (step < 0 || step >= static_cast<int64_t>(sealed_.size())) return nullptr;
  return sealed_[step];
}

void ScheduleLog::AppendSealed(std::shared_ptr<const SealedSchedule> sealed) {
  absl::MutexLock lock(&sealed_mu_);
  records_[{sealed->step, sealed->schedule.generation()}] = sealed;
  next_first_microbatch_ = sealed->schedule.first_microbatch() +
                           sealed->schedule.global_microbatches();
  sealed_.push_back(std::move(sealed));
  ++next_unsealed_;
}

void ScheduleLog::TruncateLocked(int64_t step) {
  absl::MutexLock lock(&sealed_mu_);
  if (step >= static_cast<int64_t>(sealed_.size())) return;
  sealed_.resize(static_cast<size_t>(std::max<int64_t>(step, 0)));
  next_unsealed_ = static_cast<int64_t>(sealed_.size());
  next_first_microbatch_ =
      sealed_.empty() ? 0
                      : sealed_.back()->schedule.first_microbatch() +
                            sealed_.back()->schedule.global_microbatches();
}

ScheduleLog::~ScheduleLog() = default;

absl::StatusOr<std::unique_ptr<ScheduleLog>> ScheduleLog::Create(
    Options options, const hsdp::v1::Policy& initial_policy,
    StateStore* store) {
  if (options.world_size < 1 || options.shard_size < 1 ||
      options.read_ahead < 0 || options.refuse_ahead < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "schedule log options: world ", options.world_size, ", shard ",
        options.shard_size, ", read-ahead ", options.read_ahead,
        ", refuse-ahead ", options.refuse_ahead,
        " (need world, shard >= 1 and read-ahead >= 0)"));
  }
  if (options.refuse_ahead == 0) {
    options.refuse_ahead = kDefaultRefuseWindows * options.read_ahead;
  }
  options.refuse_ahead = std::max(options.refuse_ahead, options.read_ahead + 1);
  if (absl::Status s = ValidatePolicy(initial_policy, {}); !s.ok()) return s;
  std::unique_ptr<ScheduleLog> log(new ScheduleLog(options, store));
  absl::MutexLock lock(&log->mu_);
  if (absl::Status s = log->RestoreLocked(initial_policy); !s.ok()) return s;
  return log;
}

absl::Status ScheduleLog::RestoreLocked(
    const hsdp::v1::Policy& initial_policy) {
  const PersistedState state =
      store_ != nullptr ? store_->state() : PersistedState();
  if (state.policies().empty()) {
    // The first policy is persisted before anything is sealed or committed.
    if (store_ != nullptr && (!store_->SealedSteps().empty() ||
                              store_->commit_point().has_value())) {
      return absl::DataLossError(absl::StrCat(
          store_->dir(), "/", kStateFileName,
          " is missing or holds no policy, but steps were sealed; the state "
          "directory is damaged"));
    }
    policies_.push_back(PolicyInfo{initial_policy, 1, 0});
    return PersistLocked();
  }
  restored_ = true;
  for (const auto& record : state.policies()) {
    policies_.push_back(
        PolicyInfo{record.policy(), record.version(), record.effective_step()});
  }
  drain_step_ = state.has_drain_step() ? state.drain_step() : -1;
  last_checkpoint_step_ =
      state.has_last_checkpoint_step() ? state.last_checkpoint_step() : -1;
  for (int64_t step : state.checkpoint_requests())
    checkpoint_requests_.insert(step);
  if (!state.units().empty()) {
    planner_ = std::make_unique<Planner>(UnitListFromProto(state.units()),
                                         MemoryOptions());
  }
  for (const auto& start : state.generation_starts()) {
    generation_starts_.push_back(GenerationContext{
        start.generation(), start.world_size(), start.start_step()});
  }
  persisted_starts_ = generation_starts_.size();
  HSDP_RETURN_IF_ERROR(RestoreSealedLocked());
  if (!generation_starts_.empty()) current_ = generation_starts_.back();
  completed_.assign(current_.world_size, -1);
  ranks_at_min_ = current_.world_size;
  // Completed steps are not persisted. Sealing the last restored step needed
  // floor >= step - 1 - read_ahead, and the floor never decreases, so that much
  // is known.
  restored_floor_ = next_unsealed_ - 2 - options_.read_ahead;
  return absl::OkStatus();
}

absl::Status ScheduleLog::RestoreSealedLocked() {
  const std::string state_file =
      absl::StrCat(store_->dir(), "/", kStateFileName);
  // Generations begin in order; generation 0 (the first) has no record.
  std::map<int64_t, int64_t> start_of = {{0, 0}};
  for (const GenerationContext& g : generation_starts_) {
    if (g.generation <= start_of.rbegin()->first || g.world_size < 1 ||
        g.start_step < 0) {
      return absl::DataLossError(absl::StrCat(
          state_file, ": generation ", g.generation, " (world ", g.world_size,
          ", start step ", g.start_step, ") does not follow generation ",
          start_of.rbegin()->first, "; the state directory is damaged"));
    }
    start_of[g.generation] = g.start_step;
  }
  // A step's record is the one of the latest generation (in order) that
  // started at or before it: a later generation supersedes the uncommitted
  // steps of earlier ones, and a restore from a checkpoint may start one
  // before the previous start. Every step before the last start committed,
  // so each step from 0 through the last sealed one has its owner's record.
  auto owner = [&](int64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    int64_t generation = 0;
    for (const GenerationContext& g : generation_starts_) {
      if (g.start_step <= step) generation = g.generation;
    }
    return generation;
  };
  // Files from before generations were tracked carry no start records: then
  // the latest generation's record of a step wins.
  const bool legacy = generation_starts_.empty();
  std::map<int64_t, std::shared_ptr<SealedSchedule>> effective;
  for (auto& [key, bytes] : store_->SealedSteps()) {
    const auto [step, generation] = key;
    auto sealed = std::make_shared<SealedSchedule>();
    sealed->step = step;
    sealed->bytes = bytes;
    if (!sealed->schedule.ParseFromString(bytes)) {
      return absl::DataLossError(absl::StrCat(
          "sealed step ", step, ": ", store_->SealedStepPath(step, generation),
          " does not parse"));
    }
    if (!legacy) {
      auto start = start_of.find(generation);
      if (start == start_of.end()) {
        return absl::DataLossError(absl::StrCat(
            "sealed step ", step, ": ",
            store_->SealedStepPath(step, generation),
            " was sealed in generation ", generation, ", which ", state_file,
            " never began (the latest is ", start_of.rbegin()->first,
            "); the state directory is damaged"));
      }
      if (step < start->second) {
        return absl::DataLossError(absl::StrCat(
            "sealed step ", step, ": ",
            store_->SealedStepPath(step, generation), " belongs to generation ",
            generation, ", which began at step ", start->second,
            "; the state directory is damaged"));
      }
    }
    {
      absl::MutexLock lock(&sealed_mu_);
      records_[key] = sealed;
    }
    const bool owns = legacy || generation == owner(step);
    auto& slot = effective[step];
    if (owns && (slot == nullptr || slot->schedule.generation() < generation)) {
      slot = sealed;
    }
  }
  // The last step with an owning record: every step before it must have one.
  int64_t last = -1;
  for (const auto& [step, sealed] : effective) {
    if (sealed != nullptr) last = step;
  }
  for (int64_t step = 0; step <= last; ++step) {
    auto it = effective.find(step);
    if (it == effective.end() || it->second == nullptr) {
      return absl::DataLossError(absl::StrCat(
          "sealed step ", step,
          " is missing: ", store_->SealedStepPath(step, owner(step)),
          " is not there, but steps through ", last,
          " are sealed; the state directory is damaged"));
    }
    AppendSealed(std::move(it->second));
  }
  // A committed step was sealed (and persisted) before any rank read it.
  if (std::optional<state::CommitPoint> point = store_->commit_point();
      point.has_value() && point->step() > last) {
    return absl::DataLossError(absl::StrCat(
        "sealed step ", point->step(), " is missing: ",
        store_->SealedStepPath(point->step(), owner(point->step())),
        " is not there, but ", store_->dir(),
        "/commit.binpb says it committed; the state directory is damaged"));
  }
  return absl::OkStatus();
}

absl::Status ScheduleLog::PersistLocked() {
  if (store_ == nullptr) return absl::OkStatus();
  const absl::Status status =
      store_->Update([&](PersistedState* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        s->clear_policies();
        for (const PolicyInfo& info : policies_) {
          auto* record = s->add_policies();
          record->set_version(info.version);
          record->set_effective_step(info.effective_step);
          *record->mutable_policy() = info.policy;
        }
        s->set_drain_step(drain_step_);
        s->set_last_checkpoint_step(last_checkpoint_step_);
        s->clear_checkpoint_requests();
        for (int64_t step : checkpoint_requests_) {
          s->add_checkpoint_requests(step);
        }
        s->clear_generation_starts();
        for (const GenerationContext& g : generation_starts_) {
          auto* record = s->add_generation_starts();
          record->set_generation(g.generation);
          record->set_start_step(g.start_step);
          record->set_world_size(g.world_size);
        }
      });
  if (status.ok()) persisted_starts_ = generation_starts_.size();
  return status;
}

absl::Status ScheduleLog::SetUnits(const UnitList& units) {
  absl::MutexLock lock(&mu_);
  if (planner_ != nullptr) {
    absl::Status same = CompareUnitLists(units, planner_->units());
    if (!same.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the schedule log already has a unit list: ", same.message()));
    }
    return absl::OkStatus();
  }
  if (absl::Status s = ValidateUnitList(units); !s.ok()) return s;
  planner_ = std::make_unique<Planner>(units, MemoryOptions());
  absl::Status policy_ok = ValidatePolicy(policies_.back().policy, units);
  if (!policy_ok.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the current policy does not fit the model (such overrides are "
        "ignored): ",
        policy_ok.message()));
  }
  return absl::OkStatus();
}

bool ScheduleLog::has_units() const {
  absl::MutexLock lock(&mu_);
  return planner_ != nullptr;
}

const PolicyInfo& ScheduleLog::PolicyForStepLocked(int64_t step) const {
  // Effective steps never decrease along the history; the latest record that
  // started at or before `step` governs it.
  for (auto it = policies_.rbegin(); it != policies_.rend(); ++it) {
    if (it->effective_step <= step) return *it;
  }
  return policies_.front();
}

MemoryModel::Options ScheduleLog::MemoryOptions() const {
  MemoryModel::Options memory;
  memory.shard_size = options_.shard_size;
  memory.replicate_size =
      std::max(1, options_.world_size / std::max(1, options_.shard_size));
  return memory;
}

int64_t ScheduleLog::FloorLocked() const {
  return std::max({min_completed_, restored_floor_, committed_floor_});
}

absl::Status ScheduleLog::SealThroughLocked(int64_t step) {
  // A generation's start is durable before any record sealed in it, so a
  // restart never finds a record of a generation it does not know.
  if (store_ != nullptr && persisted_starts_ < generation_starts_.size()) {
    HSDP_RETURN_IF_ERROR(PersistLocked());
  }
  for (int64_t s = next_unsealed_; s <= step; ++s) {
    const PolicyInfo& policy = PolicyForStepLocked(s);
    const hsdp::v1::Policy resolved = ResolvePolicyDefaults(policy.policy);
    const bool shrink = resolved.batch_mode() == hsdp::v1::BATCH_MODE_SHRINK;
    const int64_t per_rank = resolved.microbatches();
    const int64_t world = current_.world_size;
    // The global batch: fixed at the job's world, or the generation's.
    const int64_t global = per_rank * (shrink ? world : options_.world_size);
    PlanInput input;
    input.step = s;
    input.policy_version = policy.version;
    input.generation = current_.generation;
    input.checkpoint_requested = checkpoint_requests_.count(s) > 0;
    input.microbatches = static_cast<int>((global + world - 1) / world);
    auto sealed = std::make_shared<SealedSchedule>();
    sealed->step = s;
    sealed->schedule = planner_->Plan(policy.policy, input);
    sealed->schedule.set_world_size(current_.world_size);
    sealed->schedule.set_global_microbatches(global);
    sealed->schedule.set_first_microbatch(next_first_microbatch_);
    sealed->schedule.set_batch_mode(shrink ? hsdp::v1::BATCH_MODE_SHRINK
                                           : hsdp::v1::BATCH_MODE_FIXED);
    sealed->schedule.set_trace(trace_requests_.count(s) > 0);
    sealed->bytes = sealed->schedule.SerializeAsString();
    if (sealed->schedule.over_memory_budget()) {
      ReportOverBudgetLocked(sealed->schedule, policy);
    }
    if (store_ != nullptr) {
      // Persist before anyone can see the step: a restart must serve the same
      // bytes.
      if (absl::Status st =
              store_->SaveSealedStep(s, current_.generation, sealed->bytes);
          !st.ok())
        return st;
    }
    AppendSealed(std::move(sealed));
  }
  window_cv_.SignalAll();
  return absl::OkStatus();
}

absl::Status ScheduleLog::BeginGeneration(const GenerationContext& context) {
  absl::MutexLock lock(&mu_);
  return BeginGenerationLocked(context);
}

absl::Status ScheduleLog::BeginGenerationLocked(
    const GenerationContext& context) {
  if (context.generation <= current_.generation) return absl::OkStatus();
  if (context.world_size < 1 || context.start_step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("generation ", context.generation, ": world ",
                     context.world_size, ", start step ", context.start_step));
  }
  current_ = context;
  generation_starts_.push_back(context);
  TruncateLocked(context.start_step);
  completed_.assign(context.world_size, context.start_step - 1);
  min_completed_ = context.start_step - 1;
  ranks_at_min_ = context.world_size;
  checkpoint_saves_.clear();
  window_cv_.SignalAll();
  // A generation that cannot be persisted now still begins; its first seal
  // persists it again and fails while it cannot.
  return PersistLocked();
}

void ScheduleLog::RecordCommitted(int64_t step) {
  absl::MutexLock lock(&mu_);
  if (step <= committed_floor_) return;
  committed_floor_ = step;
  checkpoint_requests_.erase(checkpoint_requests_.begin(),
                             checkpoint_requests_.upper_bound(step));
  trace_requests_.erase(trace_requests_.begin(),
                        trace_requests_.upper_bound(step));
  window_cv_.SignalAll();
}

absl::StatusOr<ScheduleRead> ScheduleLog::GetSchedule(
    int64_t step, const GenerationContext& context, absl::Time deadline) {
  if (step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("step ", step, " is negative"));
  }
  // A record serves this generation if it was sealed in it, or committed
  // before it started.
  auto serves = [&](const SealedSchedule& sealed) {
    return sealed.schedule.generation() == context.generation ||
           step < context.start_step;
  };
  // Fast path: a sealed step needs only the sealed-steps lock.
  if (std::shared_ptr<const SealedSchedule> sealed = FindSealed(step)) {
    if (serves(*sealed)) return ScheduleRead{std::move(sealed), false};
  }
  absl::MutexLock lock(&mu_);
  if (context.generation > current_.generation) {
    if (absl::Status s = BeginGenerationLocked(context); !s.ok()) return s;
  }
  while (true) {
    if (shutdown_) {
      return absl::UnavailableError("coordinator is shutting down");
    }
    if (context.generation < current_.generation) {
      return absl::AbortedError(
          absl::StrCat("generation ", context.generation, " ended (generation ",
                       current_.generation, " started at step ",
                       current_.start_step, "): re-form"));
    }
    if (step < next_unsealed_) return ScheduleRead{FindSealed(step), false};
    if (drain_step_ >= 0 && step > drain_step_)
      return ScheduleRead{nullptr, true};
    if (planner_ == nullptr) {
      return absl::FailedPreconditionError(
          "no worker has joined yet: the model's unit list is unknown");
    }
    const int64_t floor = FloorLocked();
    if (step > floor + 1 + options_.refuse_ahead) {
      return absl::OutOfRangeError(absl::StrCat(
          "step ", step, " is too far ahead: the slowest rank completed step ",
          floor, " and reads may run at most ", options_.refuse_ahead,
          " steps past step ", floor + 1));
    }
    if (step <= floor + 1 + options_.read_ahead) {
      if (absl::Status s = SealThroughLocked(step); !s.ok()) return s;
      return ScheduleRead{FindSealed(step), false};
    }
    // Inside the refusal limit but past the window: wait for the slowest rank
    // (or for a drain, a shutdown, or another reader to seal it).
    // A condition variable signalled only when something a waiter checks
    // changes (floor, seal, drain, shutdown), rather than a Mutex::Await
    // condition that every unlock would re-evaluate for every waiter.
    auto movable = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return shutdown_ || context.generation < current_.generation ||
             step < next_unsealed_ ||
             (drain_step_ >= 0 && step > drain_step_) ||
             step <= FloorLocked() + 1 + options_.read_ahead;
    };
    while (!movable()) {
      if (window_cv_.WaitWithDeadline(&mu_, deadline) && !movable()) {
        return absl::DeadlineExceededError(absl::StrCat(
            "step ", step,
            " is past the read-ahead window (slowest rank completed step ",
            FloorLocked(), ", read-ahead ", options_.read_ahead,
            ") and did not open in time"));
      }
    }
  }
}

absl::StatusOr<std::shared_ptr<const SealedSchedule>> ScheduleLog::GetSealed(
    int64_t step, std::optional<int64_t> generation) const {
  if (generation.has_value()) {
    absl::ReaderMutexLock lock(&sealed_mu_);
    auto it = records_.find({step, *generation});
    if (it != records_.end()) return it->second;
    return absl::NotFoundError(absl::StrCat(
        "step ", step, " was not sealed in generation ", *generation));
  }
  if (std::shared_ptr<const SealedSchedule> sealed = FindSealed(step))
    return sealed;
  const int64_t last = sealed_step();
  return absl::NotFoundError(absl::StrCat(
      "step ", step, " is not sealed (sealed: ",
      last < 0 ? std::string("none") : absl::StrCat("0..", last), ")"));
}

absl::StatusOr<PolicyInfo> ScheduleLog::SetPolicy(
    const hsdp::v1::Policy& policy) {
  absl::MutexLock lock(&mu_);
  const UnitList no_units;
  if (absl::Status s = ValidatePolicy(
          policy, planner_ != nullptr ? planner_->units() : no_units);
      !s.ok()) {
    return s;
  }
  if (planner_ != nullptr) {
    if (absl::Status s = planner_->CheckMemoryBudget(policy); !s.ok()) return s;
  }
  PolicyInfo info{policy, policies_.back().version + 1, next_unsealed_};
  policies_.push_back(info);
  if (absl::Status s = PersistLocked(); !s.ok()) {
    policies_.pop_back();
    return s;
  }
  return info;
}

PolicyInfo ScheduleLog::CurrentPolicy() const {
  absl::MutexLock lock(&mu_);
  return policies_.back();
}

std::vector<PolicyInfo> ScheduleLog::PolicyHistory() const {
  absl::MutexLock lock(&mu_);
  return policies_;
}

absl::StatusOr<int64_t> ScheduleLog::RequestCheckpoint() {
  absl::MutexLock lock(&mu_);
  const int64_t step = next_unsealed_;
  if (drain_step_ >= 0 && step > drain_step_) {
    return absl::FailedPreconditionError(
        absl::StrCat("the job is draining: its last step ", drain_step_,
                     " is already sealed"));
  }
  if (!checkpoint_requests_.insert(step).second) return step;
  if (absl::Status s = PersistLocked(); !s.ok()) {
    checkpoint_requests_.erase(step);
    return s;
  }
  return step;
}

absl::StatusOr<std::pair<int64_t, int64_t>> ScheduleLog::RequestTrace(
    int64_t first, int64_t last) {
  absl::MutexLock lock(&mu_);
  if (first == 0) first = next_unsealed_;
  if (last == 0) last = first;
  HSDP_RETURN_IF_ERROR(ValidateTraceRange(first, last));
  if (first < next_unsealed_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "first_step ", first, " is already sealed: the first unsealed step is ",
        next_unsealed_));
  }
  if (drain_step_ >= 0 && last > drain_step_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "last_step ", last, " is past the drain step ", drain_step_));
  }
  for (int64_t s = first; s <= last; ++s) trace_requests_.insert(s);
  return std::make_pair(first, last);
}

absl::StatusOr<int64_t> ScheduleLog::Drain() {
  absl::MutexLock lock(&mu_);
  if (drain_step_ >= 0) return drain_step_;
  drain_step_ = next_unsealed_;
  window_cv_.SignalAll();
  if (absl::Status s = PersistLocked(); !s.ok()) {
    drain_step_ = -1;
    return s;
  }
  return drain_step_;
}

absl::Status ScheduleLog::RecordReport(const hsdp::v1::StepReport& report) {
  if (report.step() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("report step ", report.step(), " is negative"));
  }
  absl::MutexLock lock(&mu_);
  if (report.rank() < 0 || report.rank() >= current_.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("report rank ", report.rank(),
                     " is outside the world [0, ", current_.world_size, ")"));
  }
  int64_t& completed = completed_[report.rank()];
  if (report.step() > completed) {
    const int64_t old = completed;
    completed = report.step();
    if (old == min_completed_ && --ranks_at_min_ == 0) {
      // The last rank at the minimum moved: recompute (once per advance of the
      // floor).
      min_completed_ = *std::min_element(completed_.begin(), completed_.end());
      ranks_at_min_ = static_cast<int>(
          std::count(completed_.begin(), completed_.end(), min_completed_));
      window_cv_.SignalAll();
    }
  }
  if (planner_ != nullptr && report.peak_memory_bytes() > 0) {
    planner_->ObservePeakMemory(report.step(), report.peak_memory_bytes(),
                                report.activation_bytes());
  }
  if (report.checkpoint_saved() && report.step() > last_checkpoint_step_) {
    auto& savers = checkpoint_saves_[report.step()];
    savers.insert(report.rank());
    if (static_cast<int>(savers.size()) == current_.world_size) {
      const int64_t previous = last_checkpoint_step_;
      last_checkpoint_step_ = report.step();
      checkpoint_saves_.erase(checkpoint_saves_.begin(),
                              checkpoint_saves_.upper_bound(report.step()));
      if (absl::Status s = PersistLocked(); !s.ok()) {
        last_checkpoint_step_ = previous;
        return s;
      }
    }
  }
  return absl::OkStatus();
}

void ScheduleLog::Shutdown() {
  absl::MutexLock lock(&mu_);
  shutdown_ = true;
  window_cv_.SignalAll();
}

int64_t ScheduleLog::AwaitFloorChange(int64_t seen_floor, absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  if (FloorLocked() == seen_floor && !shutdown_) {
    // One wait: any signal (floor, seal, drain, shutdown, Wake) returns.
    window_cv_.WaitWithDeadline(&mu_, deadline);
  }
  return FloorLocked();
}

void ScheduleLog::Wake() {
  absl::MutexLock lock(&mu_);
  window_cv_.SignalAll();
}

bool ScheduleLog::is_shut_down() const {
  absl::MutexLock lock(&mu_);
  return shutdown_;
}

int64_t ScheduleLog::sealed_step() const {
  absl::ReaderMutexLock lock(&sealed_mu_);
  return static_cast<int64_t>(sealed_.size()) - 1;
}

int64_t ScheduleLog::generation() const {
  absl::MutexLock lock(&mu_);
  return current_.generation;
}

int64_t ScheduleLog::drain_step() const {
  absl::MutexLock lock(&mu_);
  return drain_step_;
}

int64_t ScheduleLog::last_checkpoint_step() const {
  absl::MutexLock lock(&mu_);
  return last_checkpoint_step_;
}

int64_t ScheduleLog::min_completed_step() const {
  absl::MutexLock lock(&mu_);
  return min_completed_;
}

int64_t ScheduleLog::memory_correction_bytes() const {
  absl::MutexLock lock(&mu_);
  return planner_ != nullptr ? planner_->memory_correction_bytes() : 0;
}

void ScheduleLog::ReportOverBudgetLocked(const hsdp::v1::StepSchedule& schedule,
                                         const PolicyInfo& policy) {
  // Once per policy version: every later step of it is over budget too until
  // the reports say otherwise.
  if (policy.version == over_budget_reported_version_) return;
  over_budget_reported_version_ = policy.version;
  std::cerr << absl::StrFormat(
      "hsdp-coordinator: step %d (policy version %d): memory budget %d bytes "
      "is below the least predicted peak %d bytes; running with every unit "
      "resharded after forward\n",
      schedule.step(), policy.version, policy.policy.memory_budget_bytes(),
      schedule.predicted_peak_bytes());
}

}  // namespace hsdp::coordinator
