#include "hsdp/runner.h"

#include <glog/logging.h>
#include <torch/torch.h>

#include <cmath>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_util.h"
#include "worker/train/checkpointing.h"
#include "worker/train/elastic_loop.h"
#include "worker/train/microbatch.h"
#include "worker/train/optimizer.h"
#include "worker/train/report_file.h"
#include "worker/train/run_setup.h"
#include "worker/train/task_checks.h"
#include "worker/train/task_units.h"
#include "worker/train/training_options.h"
#include "worker/train/unit_entry.h"

namespace hsdp::train {
namespace {

// Runs `fn`, turning any exception (c10::Error from LibTorch, gloo::Exception,
// std::exception) into a one-line status: nothing crosses the worker boundary
// as an exception.
template <typename Fn>
absl::Status Guard(const std::string& what, Fn fn) {
  try {
    return fn();
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat(what, ": ", e.what_without_backtrace()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(what, ": ", e.what()));
  }
}

// `s` with "step N: " before its message.
absl::Status StepError(int64_t step, const absl::Status& s) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat("step ", step, ": ", s.message()));
}

// Clips the gradients of `params` (unsharded) as fsdp::ClipGradNormGlobal
// clips shards: the global norm in double precision, one coefficient. Returns
// the norm before clipping.
double ClipGradNorm(const std::vector<at::Tensor>& params, double max_norm) {
  constexpr double kClipEpsilon = 1e-6;
  at::NoGradGuard no_grad;
  double sum_sq = 0;
  for (const at::Tensor& p : params) {
    if (p.grad().defined())
      sum_sq += p.grad().to(at::kDouble).pow(2).sum().item<double>();
  }
  const double norm = std::sqrt(sum_sq);
  const double coef = max_norm / (norm + kClipEpsilon);
  if (coef >= 1.0) return norm;
  for (const at::Tensor& p : params) {
    if (p.grad().defined()) p.mutable_grad().mul_(coef);
  }
  return norm;
}

// ---- the single-process reference ------------------------------------------

absl::Status TrainReference(std::unique_ptr<Task> task,
                            const ReferenceOptions& o) {
  const TrainingOptions& t = o.training;
  HSDP_RETURN_IF_ERROR(ValidateTrainingOptions(t));
  SetThreads(o.process.threads);
  const c10::Device device(c10::kCPU);
  HSDP_RETURN_IF_ERROR(task->Build(BuildContext{device, t.seed}));
  std::vector<UnitSpec> units;
  HSDP_RETURN_IF_ERROR(BuildAllUnits(*task, device, &units));
  std::vector<std::string> unit_names;
  std::vector<std::shared_ptr<UnitBinding>> bindings;
  for (const UnitSpec& unit : units) {
    unit_names.push_back(unit.name);
    bindings.push_back(unit.binding);
  }
  HSDP_RETURN_IF_ERROR(
      CheckUnitGlob("--recompute-units", t.recompute_units, unit_names));
  DirectShardContext units_context(units);
  UnitBindings unit_bindings;
  unit_bindings.Bind(std::move(bindings), &units_context);
  task->SetShardContext(units_context);
  std::vector<at::Tensor> params;
  for (const auto& [name, p] : UniqueNamedParameters(*task->Model()))
    params.push_back(p);
  std::unique_ptr<torch::optim::Optimizer> opt =
      MakeOptimizer(*task, t, params);
  ReportFile report_file;
  HSDP_RETURN_IF_ERROR(report_file.Open(o.process.report_file));
  const int micro = std::max(1, o.microbatches);
  const double parts = static_cast<double>(o.world_size) * micro;
  // A sum over ranks (or over a divide factor) instead of their mean: what the
  // sharded run's gradient is, relative to the global batch's mean.
  const double grad_scale = ReferenceGradScale(t, o.world_size);
  report_file.SetSettings(
      RunSettings{o.world_size, micro, o.world_size * micro * t.microbatch_size,
                  ToProto(t, o.task_args, task->Name(), task->Version())});
  for (int64_t step = 0; step < t.steps; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    ApplyLearningRate(*opt, t, step);
    double loss = 0;
    // The first non-finite microbatch loss (global slot i: rank i / micro of
    // the sharded run, its microbatch i % micro) and how many.
    int64_t first_nonfinite = -1, nonfinite_count = 0;
    double first_nonfinite_loss = 0;
    for (int64_t i = 0; i < o.world_size * micro; ++i) {
      BatchRequest request{step, i * t.microbatch_size, t.microbatch_size,
                           t.seed};
      HSDP_ASSIGN_OR_RETURN(Batch batch,
                            MicrobatchBatch(*task, request, device));
      const bool check_task = step == 0 && i == 0;
      if (check_task) {
        HSDP_RETURN_IF_ERROR(CheckDeterministicBatch(*task, request, batch));
      }
      units_context.BeginForward();
      absl::StatusOr<at::Tensor> loss_or;
      try {
        loss_or = MicrobatchLoss(*task, batch);
      } catch (const std::exception&) {
        if (units_context.misuse().ok()) throw;
        return StepError(step, units_context.misuse());
      }
      HSDP_ASSIGN_OR_RETURN(at::Tensor l, std::move(loss_or));
      if (check_task) {
        const std::vector<GradLeaf> leaves = GradLeaves(l);
        HSDP_RETURN_IF_ERROR(CheckRegistered(leaves, *task->Model()));
        HSDP_RETURN_IF_ERROR(
            StepError(step, units_context.CheckEntered(leaves)));
      }
      l = l / parts;
      (grad_scale == 1.0 ? l : l * grad_scale).backward();
      const double value = l.item<double>();
      loss += value;
      if (!std::isfinite(value)) {
        if (first_nonfinite < 0) {
          first_nonfinite = i;
          first_nonfinite_loss = value;
        }
        ++nonfinite_count;
      }
    }
    std::optional<double> norm;
    if (t.clip_grad_norm > 0) norm = ClipGradNorm(params, t.clip_grad_norm);
    std::string nonfinite;
    if (first_nonfinite >= 0) {
      nonfinite = NonFiniteLossMessage(
          step, first_nonfinite_loss, static_cast<int>(first_nonfinite / micro),
          static_cast<int>(first_nonfinite % micro), nonfinite_count);
    } else if (norm.has_value() && !std::isfinite(*norm)) {
      nonfinite = NonFiniteNormMessage(step, *norm, t.clip_grad_norm);
    }
    if (!nonfinite.empty()) {
      nonfinite = WithNonFiniteAction(nonfinite, t.on_nonfinite);
      if (t.on_nonfinite == NonFiniteAction::kStop) {
        return absl::InternalError(nonfinite);
      }
      LOG(WARNING) << "reference: " << nonfinite;
    } else {
      opt->step();
    }
    opt->zero_grad();
    report_file.WriteReference(
        ReferenceLine{step, loss, SecondsSince(t0), nonfinite});
  }
  if (!o.process.final_params.empty()) {
    HSDP_RETURN_IF_ERROR(SaveParams(UniqueNamedParameters(*task->Model()),
                                    o.process.final_params));
  }
  return absl::OkStatus();
}

}  // namespace

void InitLogging(const char* argv0) {
  FLAGS_logtostderr = true;
  if (!google::IsGoogleLoggingInitialized()) google::InitGoogleLogging(argv0);
}

absl::Status RunTask(std::unique_ptr<Task> task, const WorkerOptions& options) {
  if (task == nullptr) return absl::InvalidArgumentError("RunTask: null task");
  return Guard("worker",
               [&] { return TrainSharded(std::move(task), options); });
}

absl::Status RunReference(std::unique_ptr<Task> task,
                          const ReferenceOptions& options) {
  if (task == nullptr) {
    return absl::InvalidArgumentError("RunReference: null task");
  }
  return Guard("reference",
               [&] { return TrainReference(std::move(task), options); });
}

}  // namespace hsdp::train
