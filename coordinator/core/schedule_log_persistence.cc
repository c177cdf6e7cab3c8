// ScheduleLog: restoring the policies, generations and sealed steps from the
// state store, and persisting them.
#include <algorithm>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/policy.h"
#include "common/status_util.h"
#include "coordinator/core/schedule_log.h"

namespace hsdp::coordinator {
namespace {

// The state directory's file that holds the generation starts.
constexpr char kStateFileName[] = "state.binpb";

}  // namespace

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
    planner_ = NewPlannerLocked(UnitListFromProto(state.units()));
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

}  // namespace hsdp::coordinator
