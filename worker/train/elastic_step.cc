// One step of the elastic loop (ElasticLoop::Step, elastic_loop_internal.h):
// the schedule, the microbatches, the loss over every rank, the commit vote,
// the checkpoint and the report.
#include <glog/logging.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_util.h"
#include "worker/fsdp/memory_meter.h"
#include "worker/train/elastic_loop_internal.h"
#include "worker/train/microbatch.h"
#include "worker/train/run_setup.h"
#include "worker/train/task_checks.h"
#include "worker/train/worker_mesh.h"

namespace hsdp::train::internal {
namespace {

// LibTorch's words for a tensor whose storage bytes are freed: what reading a
// resharded unit's parameters outside its forward gives.
bool IsFreedStorageError(const std::string& what) {
  return absl::StrContains(what, "data is not allocated yet") ||
         (absl::StrContains(what, "setStorage") &&
          absl::StrContains(what, "storage of size 0"));
}

// FAILED_PRECONDITION naming the likely unit (fsdp::Engine::ForwardPosition)
// instead of LibTorch's allocation error.
absl::Status UnitUsedOutsideItsForward(int64_t step, const fsdp::Engine& engine,
                                       const std::string& what) {
  const auto [entered, next] = engine.ForwardPosition();
  const std::string where =
      next.empty() ? absl::StrCat("after the last unit, ", entered)
                   : absl::StrCat("after unit ", entered,
                                  " and before the forward entered unit ", next,
                                  ": most likely unit ", next,
                                  "'s module was called directly");
  return absl::FailedPreconditionError(absl::StrCat(
      "step ", step,
      ": a sharded unit's parameters were used outside its forward, ", where,
      ". Call a unit's module through its hsdp::train::Unit<> wrapper or "
      "ShardContext::Forward (LibTorch said: ",
      what.substr(0, what.find('\n')), ")"));
}

}  // namespace

absl::StatusOr<Next> ElasticLoop::Step(int64_t step) {
  agent_->SetCurrentStep(step);
  HSDP_ASSIGN_OR_RETURN(std::optional<StepPlan> plan, FetchSchedule(step));
  if (!plan.has_value()) {
    LOG(INFO) << "rank " << rank_ << " drained before step " << step;
    return Next::kFinish;
  }
  StepTrace trace(*engine_, plan->schedule.trace());
  trace.Add("schedule fetch", plan->fetch_begin, plan->fetch_end);

  const auto t0 = std::chrono::steady_clock::now();
  HSDP_ASSIGN_OR_RETURN(const MicrobatchLosses losses,
                        RunMicrobatches(step, *plan));
  const fsdp::EngineStats stats = engine_->Stats();
  HSDP_ASSIGN_OR_RETURN(const StepLoss loss, ReduceLoss(step, losses));

  // Every collective of the step is done: vote. Nothing changed the state
  // yet, so an aborted step only needs its gradients dropped.
  HSDP_ASSIGN_OR_RETURN(const CommitVote vote,
                        VoteAndApply(step, loss.nonfinite.empty(), trace));
  const double step_seconds = SecondsSince(t0);

  // The step is committed: a checkpoint that fails for a lost peer re-forms
  // from the next step, after the step is reported.
  HSDP_ASSIGN_OR_RETURN(const CheckpointOutcome checkpoint,
                        SaveCheckpoint(step, *plan, trace));
  trace.Add("step", plan->fetch_begin, StepTrace::Now());

  HSDP_RETURN_IF_ERROR(Report(step, *plan, stats, loss, step_seconds, vote,
                              checkpoint.saved, trace));
  if (!checkpoint.lost_peer.ok()) {
    return CollectiveFailure(checkpoint.lost_peer);
  }
  return vote.reform_after ? Next::kReform : Next::kStep;
}

absl::StatusOr<std::optional<ElasticLoop::StepPlan>> ElasticLoop::FetchSchedule(
    int64_t step) {
  StepPlan plan;
  plan.fetch_begin = StepTrace::Now();
  HSDP_ASSIGN_OR_RETURN(hsdp::v1::GetScheduleResponse resp,
                        agent_->GetSchedule(step, last_step_));
  plan.fetch_end = StepTrace::Now();
  if (resp.drained()) return std::nullopt;
  plan.schedule = std::move(*resp.mutable_schedule());
  const hsdp::v1::StepSchedule& schedule = plan.schedule;
  plan.micro = std::max(1, schedule.microbatches_size());
  plan.world = schedule.world_size() > 0
                   ? schedule.world_size()
                   : mesh_->shard().size() * mesh_->replicate().size();
  plan.global = schedule.global_microbatches() > 0
                    ? schedule.global_microbatches()
                    : static_cast<int64_t>(plan.world) * plan.micro;
  plan.scale = static_cast<double>(plan.global) / plan.world;
  plan.first_slot = static_cast<int64_t>(rank_) * plan.micro;
  plan.real = std::clamp<int64_t>(plan.global - plan.first_slot, 0, plan.micro);
  return plan;
}

absl::StatusOr<ElasticLoop::MicrobatchLosses> ElasticLoop::RunMicrobatches(
    int64_t step, const StepPlan& plan) {
  ApplyLearningRate(*opt_, t_, step);
  engine_->ResetStats();
  MicrobatchLosses losses;
  losses.sum =
      at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device_));
  try {
    for (int mb = 0; mb < plan.micro; ++mb) {
      if (absl::Status s = engine_->Apply(plan.schedule, mb); !s.ok()) {
        return engine_->status().ok() ? s : CollectiveFailure(s);
      }
      const bool padding = mb >= plan.real;
      // Padding runs real data (slot 0's) at weight 0: the same collectives.
      const int64_t slot = padding ? 0 : plan.first_slot + mb;
      BatchRequest request{step, slot * t_.microbatch_size, t_.microbatch_size,
                           t_.seed};
      HSDP_ASSIGN_OR_RETURN(Batch batch,
                            MicrobatchBatch(*task_, request, device_));
      // Once per process: the task's data and graph are what a run needs.
      const bool check_task = !task_checked_;
      if (check_task) {
        task_checked_ = true;
        HSDP_RETURN_IF_ERROR(CheckDeterministicBatch(*task_, request, batch));
      }
      absl::Status loss_status;
      at::Tensor loss = engine_->Root().Forward(
          std::vector<at::Tensor>{},
          [&](const std::vector<at::Tensor>&) -> std::vector<at::Tensor> {
            absl::StatusOr<at::Tensor> l = MicrobatchLoss(*task_, batch);
            if (l.ok() && check_task) {
              absl::Status graph = CheckLossGraph(*l, *task_->Model());
              if (!graph.ok()) l = graph;
            }
            if (!l.ok()) {
              loss_status = l.status();
              return {at::zeros({}, at::TensorOptions().device(device_))};
            }
            return {padding ? *l * 0.0 : *l / plan.scale};
          })[0];
      HSDP_RETURN_IF_ERROR(loss_status);
      loss.backward();
      if (!engine_->status().ok()) return CollectiveFailure(engine_->status());
      if (!padding) {
        losses.each.push_back(loss.detach().to(at::kDouble));
        losses.sum += losses.each.back();
      }
    }
  } catch (const std::exception& e) {
    // A collective that failed under forward or backward surfaces as a
    // c10::Error; the engine keeps its status.
    if (!engine_->status().ok()) return CollectiveFailure(engine_->status());
    const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
    const std::string what =
        c10_error != nullptr ? c10_error->what_without_backtrace() : e.what();
    if (IsFreedStorageError(what)) {
      return UnitUsedOutsideItsForward(step, *engine_, what);
    }
    if (absl::StartsWith(what, fsdp::kUsageErrorPrefix)) {
      return absl::FailedPreconditionError(
          absl::StrCat("step ", step, ": ", what));
    }
    return absl::InternalError(absl::StrCat("step ", step, ": ", what));
  }
  return losses;
}

absl::StatusOr<ElasticLoop::StepLoss> ElasticLoop::ReduceLoss(
    int64_t step, const MicrobatchLosses& losses) {
  std::optional<double> grad_norm;
  if (t_.clip_grad_norm > 0) {
    absl::StatusOr<double> norm =
        fsdp::ClipGradNormGlobal(*engine_, t_.clip_grad_norm);
    if (!norm.ok()) return CollectiveFailure(norm.status());
    grad_norm = *norm;
  }
  absl::StatusOr<double> mean_loss =
      MeshAverage(*mesh_, losses.sum.item<double>(), device_);
  if (!mean_loss.ok()) return CollectiveFailure(mean_loss.status());
  StepLoss loss;
  loss.mean = *mean_loss;
  // The mean and the norm are the same on every rank: every rank decides
  // alike, and a non-finite loss anywhere makes the mean non-finite.
  if (!std::isfinite(loss.mean) ||
      (grad_norm.has_value() && !std::isfinite(*grad_norm))) {
    absl::StatusOr<std::string> what =
        DescribeNonFinite(step, loss.mean, grad_norm, losses.each);
    if (!what.ok()) return CollectiveFailure(what.status());
    if (t_.on_nonfinite == NonFiniteAction::kStop) {
      return StopForNonFinite(step, *what);
    }
    loss.nonfinite = WithNonFiniteAction(*what, t_.on_nonfinite);
    LOG(WARNING) << "rank " << rank_ << ": " << loss.nonfinite;
  }
  return loss;
}

absl::StatusOr<ElasticLoop::CommitVote> ElasticLoop::VoteAndApply(
    int64_t step, bool apply, StepTrace& trace) {
  const int64_t vote_begin = StepTrace::Now();
  absl::StatusOr<hsdp::v1::CommitStepResponse> commit =
      agent_->CommitStep(step);
  if (!commit.ok()) {
    opt_->zero_grad();
    return commit.status();  // ABORTED re-forms; anything else stops
  }
  const int64_t vote_end = StepTrace::Now();
  trace.Add("commit vote", vote_begin, vote_end);
  const int64_t optimizer_begin = StepTrace::Now();
  if (apply) opt_->step();
  opt_->zero_grad();
  trace.Add("optimizer", optimizer_begin, StepTrace::Now());
  return CommitVote{commit->reform_after(),
                    static_cast<double>(vote_end - vote_begin) * 1e-9};
}

absl::StatusOr<ElasticLoop::CheckpointOutcome> ElasticLoop::SaveCheckpoint(
    int64_t step, const StepPlan& plan, StepTrace& trace) {
  CheckpointOutcome outcome;
  if (!plan.schedule.checkpoint()) return outcome;
  if (o_.checkpoint_dir.empty()) {
    LOG_FIRST_N(WARNING, 1)
        << "step " << step
        << " asks for a checkpoint but --checkpoint-dir is not set";
    return outcome;
  }
  const int64_t checkpoint_begin = StepTrace::Now();
  absl::Status s = checkpointing_->Save(step, *engine_, *opt_,
                                        plan.schedule.policy_version(),
                                        plan.global * t_.microbatch_size);
  trace.Add("checkpoint", checkpoint_begin, StepTrace::Now());
  outcome.saved = s.ok();
  if (!outcome.saved && !IsCommunicationCode(s.code())) return s;
  outcome.lost_peer = std::move(s);
  return outcome;
}

absl::Status ElasticLoop::Report(int64_t step, const StepPlan& plan,
                                 const fsdp::EngineStats& stats,
                                 const StepLoss& loss, double step_seconds,
                                 const CommitVote& vote, bool saved,
                                 StepTrace& trace) {
  const hsdp::v1::StepSchedule& schedule = plan.schedule;
  // Measured where the device allows (fsdp/memory_meter.h).
  const int64_t peak_bytes = fsdp::MeasuredPeakBytes(stats);
  const double tokens = static_cast<double>(plan.real * t_.microbatch_size *
                                            task_->TokensPerSample());
  hsdp::v1::StepReport report;
  report.set_rank(rank_);
  report.set_step(step);
  report.set_loss(loss.mean);
  report.set_step_seconds(step_seconds);
  report.set_tokens_per_second(tokens / step_seconds);
  report.set_peak_memory_bytes(peak_bytes);
  report.set_activation_bytes(stats.activation_bytes);
  report.set_checkpoint_saved(saved);
  for (size_t u = 0; u < stats.units.size(); ++u) {
    hsdp::v1::UnitCommTime* c = report.add_unit_comm();
    c->set_unit_index(static_cast<int>(u));
    c->set_all_gather_seconds(stats.units[u].all_gather_seconds);
    c->set_reduce_scatter_seconds(stats.units[u].reduce_scatter_seconds +
                                  stats.units[u].all_reduce_seconds);
  }
  trace.AttachTo(report, agent_->clock_offset());

  StepLine line;
  line.rank = rank_;
  line.step = step;
  line.loss = loss.mean;
  line.step_seconds = step_seconds;
  line.tokens_per_second = tokens / step_seconds;
  line.learning_rate =
      t_.lr_schedule.LearningRate(t_.optimizer.lr, step, t_.steps);
  line.peak_memory_bytes = peak_bytes;
  line.activation_bytes = stats.activation_bytes;
  line.parameter_state_bytes = stats.peak_memory.shards +
                               stats.peak_memory.sharded_grads +
                               OptimizerStateBytes(*opt_);
  line.gathered_peak_bytes = stats.peak_unsharded_bytes;
  line.policy_version = schedule.policy_version();
  for (const auto& u : schedule.units())
    line.reshard_after_forward += u.reshard_after_forward() ? '1' : '0';
  line.microbatches = plan.micro;
  line.all_gather_seconds = stats.all_gather_seconds;
  line.all_gathers = stats.all_gathers;
  line.host_all_gathers = stats.host_all_gathers;
  line.reduce_scatter_seconds =
      stats.reduce_scatter_seconds + stats.all_reduce_seconds;
  line.checkpoint = saved;
  line.world_size = plan.world;
  line.generation = generation_.generation();
  line.first_microbatch = schedule.first_microbatch() + plan.first_slot;
  line.microbatch_count = plan.real;
  line.first_sample = line.first_microbatch * t_.microbatch_size;
  line.sample_count = plan.real * t_.microbatch_size;
  line.heal_crc32c = heal_crc_;
  line.commit_seconds = vote.seconds;
  line.nonfinite = loss.nonfinite;
  heal_crc_.reset();
  report_file_.SetSettings(RunSettings{
      plan.world, plan.micro, plan.global * t_.microbatch_size, spec_});
  report_file_.Write(line);

  // The last step is reported as finished after the final collectives
  // (Finish): a finished job ends every generation watch.
  if (step < last_step_) {
    absl::Status s = agent_->ReportStep(report, /*finished=*/false);
    if (!s.ok()) return s;
  }
  report.clear_trace();
  last_report_ = report;
  have_report_ = true;
  return absl::OkStatus();
}

absl::StatusOr<std::string> ElasticLoop::DescribeNonFinite(
    int64_t step, double loss, std::optional<double> norm,
    const std::vector<at::Tensor>& microbatch_losses) {
  if (std::isfinite(loss)) {
    return NonFiniteNormMessage(step, norm.value_or(0), t_.clip_grad_norm);
  }
  // Per rank: 1 + its first non-finite microbatch (0: none), how many, and
  // that microbatch's loss.
  std::vector<double> mine(3, 0.0);
  for (size_t mb = 0; mb < microbatch_losses.size(); ++mb) {
    const double value = microbatch_losses[mb].item<double>();
    if (std::isfinite(value)) continue;
    if (mine[0] == 0) {
      mine[0] = static_cast<double>(mb + 1);
      mine[2] = value;
    }
    mine[1] += 1;
  }
  HSDP_ASSIGN_OR_RETURN(const std::vector<double> all,
                        MeshGather(*mesh_, mine, device_));
  int64_t count = 0;
  int first_rank = -1;
  for (size_t r = 0; r * 3 < all.size(); ++r) {
    count += static_cast<int64_t>(all[r * 3 + 1]);
    if (first_rank < 0 && all[r * 3] > 0) first_rank = static_cast<int>(r);
  }
  if (first_rank < 0) {
    // Finite microbatch losses whose mean over the mesh overflowed.
    return absl::StrCat("step ", step, ": the mean loss over every rank is ",
                        loss, " (every microbatch's loss is finite)");
  }
  const size_t at = static_cast<size_t>(first_rank) * 3;
  return NonFiniteLossMessage(step, all[at + 2], first_rank,
                              static_cast<int>(all[at]) - 1, count);
}

absl::Status ElasticLoop::StopForNonFinite(int64_t step,
                                           const std::string& message) {
  opt_->zero_grad();
  const std::string reason = WithNonFiniteAction(message, t_.on_nonfinite);
  LOG(ERROR) << "rank " << rank_ << ": " << reason;
  // Every rank reports: the first report fails the job, the others find it
  // failed.
  absl::StatusOr<bool> failed = agent_->FailJob(step, reason);
  if (!failed.ok()) {
    LOG(WARNING) << "rank " << rank_
                 << ": could not fail the job at the coordinator: "
                 << failed.status();
  }
  return absl::InternalError(reason);
}

}  // namespace hsdp::train::internal
