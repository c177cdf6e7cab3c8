// ScheduleLog: sealing, reads, policy changes and progress. Restoring and
// persisting are in schedule_log_persistence.cc.
#include "coordinator/core/schedule_log.h"

#include <algorithm>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/policy.h"
#include "common/status_util.h"
#include "coordinator/core/trace_collector.h"

namespace hsdp::coordinator {
namespace {

// Refusal distance when Options::refuse_ahead is 0: this many read-ahead
// windows.
constexpr int kDefaultRefuseWindows = 4;

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
  planner_ = NewPlannerLocked(units);
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
  cross_hosts_ = false;
  host_group_size_ = 0;
  if (planner_ != nullptr) {
    planner_->SetShardGroupsCrossHosts(false);
    planner_->SetHostGroupSize(0);
  }
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

void ScheduleLog::SetShardGroupsCrossHosts(int64_t generation,
                                           int host_group_size) {
  absl::MutexLock lock(&mu_);
  if (generation != current_.generation) return;
  cross_hosts_ = true;
  host_group_size_ = host_group_size;
  if (planner_ != nullptr) {
    planner_->SetShardGroupsCrossHosts(true);
    planner_->SetHostGroupSize(host_group_size);
  }
}

std::unique_ptr<Planner> ScheduleLog::NewPlannerLocked(
    const UnitList& units) const {
  auto planner = std::make_unique<Planner>(units, MemoryOptions());
  planner->SetLinks(options_.links);
  planner->SetShardGroupsCrossHosts(cross_hosts_);
  planner->SetHostGroupSize(host_group_size_);
  return planner;
}

void ScheduleLog::RecordCommitted(int64_t step, int64_t generation,
                                  bool reform_after) {
  absl::MutexLock lock(&mu_);
  if (generation >= 0) {
    news_.generation = generation;
    news_.step = step;
    news_.reform_after = reform_after;
    ++news_.sequence;
    window_cv_.SignalAll();
  }
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

void ScheduleLog::RecordGenerationEnded(int64_t generation) {
  absl::MutexLock lock(&mu_);
  if (generation <= news_.ended_generation) return;
  news_.ended_generation = generation;
  ++news_.sequence;
  window_cv_.SignalAll();
}

CommitNews ScheduleLog::commit_news() const {
  absl::MutexLock lock(&mu_);
  return news_;
}

ScheduleLog::FeedState ScheduleLog::AwaitFeedChange(int64_t seen_floor,
                                                    int64_t seen_news,
                                                    absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  if (FloorLocked() == seen_floor && news_.sequence == seen_news &&
      !shutdown_) {
    // One wait: any signal (floor, news, seal, drain, shutdown, Wake)
    // returns.
    window_cv_.WaitWithDeadline(&mu_, deadline);
  }
  return FeedState{FloorLocked(), news_};
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
