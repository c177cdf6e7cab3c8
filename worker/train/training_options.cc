#include "worker/train/training_options.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace hsdp::train {
namespace {

constexpr double kAdamWDefaultWeightDecay = 0.01;  // LibTorch's AdamW default
constexpr double kPi = 3.14159265358979323846;

bool IsDtype(const std::string& dtype) {
  return dtype == "fp32" || dtype == "bf16";
}

}  // namespace

const char* NonFiniteActionName(NonFiniteAction action) {
  return action == NonFiniteAction::kSkipStep ? "skip-step" : "stop";
}

absl::StatusOr<NonFiniteAction> ParseNonFiniteAction(absl::string_view name) {
  if (name == "stop") return NonFiniteAction::kStop;
  if (name == "skip-step") return NonFiniteAction::kSkipStep;
  return absl::InvalidArgumentError(
      absl::StrCat("--on-nonfinite: '", name, "' is not stop or skip-step"));
}

double OptimizerOptions::EffectiveWeightDecay() const {
  if (weight_decay.has_value()) return *weight_decay;
  return kind == OptimizerKind::kAdamW ? kAdamWDefaultWeightDecay : 0.0;
}

double LrScheduleOptions::LearningRate(double peak_lr, int64_t step,
                                       int64_t steps) const {
  if (step < warmup_steps) {
    return peak_lr * static_cast<double>(step + 1) /
           static_cast<double>(warmup_steps);
  }
  if (!cosine) return peak_lr;
  const int64_t decay_steps = steps - warmup_steps - 1;
  if (decay_steps <= 0) return peak_lr;
  const double progress = static_cast<double>(step - warmup_steps) /
                          static_cast<double>(decay_steps);
  return min_lr + (peak_lr - min_lr) * 0.5 * (1.0 + std::cos(kPi * progress));
}

absl::Status ValidateTrainingOptions(const TrainingOptions& o) {
  if (o.steps < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--steps: ", o.steps, " is negative"));
  }
  if (o.microbatch_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--microbatch-size: ", o.microbatch_size, " is not positive"));
  }
  if (!(o.optimizer.lr > 0) || !std::isfinite(o.optimizer.lr)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--lr: ", o.optimizer.lr, " is not a positive number"));
  }
  if (o.optimizer.EffectiveWeightDecay() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--weight-decay: ", o.optimizer.EffectiveWeightDecay(),
                     " is negative"));
  }
  if (o.optimizer.momentum < 0 || o.optimizer.momentum >= 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--momentum: ", o.optimizer.momentum, " is not in [0, 1)"));
  }
  if (o.optimizer.kind != OptimizerKind::kSgd && o.optimizer.momentum != 0) {
    return absl::InvalidArgumentError(
        "--momentum: only --optimizer sgd takes a momentum");
  }
  if (o.lr_schedule.warmup_steps < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--warmup-steps: ", o.lr_schedule.warmup_steps, " is negative"));
  }
  if (o.lr_schedule.min_lr < 0 || o.lr_schedule.min_lr > o.optimizer.lr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--min-lr: ", o.lr_schedule.min_lr, " is not in [0, --lr]"));
  }
  if (!IsDtype(o.param_dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--param-dtype: '", o.param_dtype, "' is not fp32 or bf16"));
  }
  if (!o.reduce_dtype.empty() && !IsDtype(o.reduce_dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--reduce-dtype: '", o.reduce_dtype, "' is not fp32 or bf16"));
  }
  if (!o.grad_accumulation_dtype.empty() &&
      !IsDtype(o.grad_accumulation_dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--grad-accumulation-dtype: '", o.grad_accumulation_dtype,
                     "' is not fp32 or bf16"));
  }
  if (o.grad_reduce != "avg" && o.grad_reduce != "sum") {
    return absl::InvalidArgumentError(
        absl::StrCat("--grad-reduce: '", o.grad_reduce, "' is not avg or sum"));
  }
  if (o.grad_divide_factor < 0 || !std::isfinite(o.grad_divide_factor)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--grad-divide-factor: ", o.grad_divide_factor,
                     " is not a positive number (0: none)"));
  }
  if (o.clip_grad_norm < 0 || !std::isfinite(o.clip_grad_norm)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--clip-grad-norm: ", o.clip_grad_norm, " is not >= 0"));
  }
  return absl::OkStatus();
}

hsdp::v1::TrainingSpec ToProto(const TrainingOptions& o,
                               const TaskArgs& task_args,
                               const std::string& task_name, int task_version) {
  hsdp::v1::TrainingSpec spec;
  spec.set_task(task_name);
  spec.set_task_version(task_version);
  spec.set_dims(task_args.dims);
  spec.set_vocab_size(task_args.vocab_size);
  for (const auto& [key, value] : task_args.options)
    (*spec.mutable_task_options())[key] = value;
  spec.set_seed(o.seed);
  spec.set_steps(o.steps);
  spec.set_microbatch_size(o.microbatch_size);
  hsdp::v1::OptimizerSpec* opt = spec.mutable_optimizer();
  opt->set_kind(o.optimizer.kind == OptimizerKind::kSgd
                    ? hsdp::v1::OPTIMIZER_KIND_SGD
                    : hsdp::v1::OPTIMIZER_KIND_ADAMW);
  opt->set_lr(o.optimizer.lr);
  opt->set_weight_decay(o.optimizer.EffectiveWeightDecay());
  if (o.optimizer.kind == OptimizerKind::kSgd) {
    opt->set_momentum(o.optimizer.momentum);
  } else {
    opt->set_beta1(o.optimizer.beta1);
    opt->set_beta2(o.optimizer.beta2);
    opt->set_eps(o.optimizer.eps);
  }
  hsdp::v1::LrScheduleSpec* lr = spec.mutable_lr_schedule();
  lr->set_warmup_steps(o.lr_schedule.warmup_steps);
  lr->set_cosine(o.lr_schedule.cosine);
  lr->set_min_lr(o.lr_schedule.min_lr);
  spec.set_param_dtype(o.param_dtype);
  spec.set_reduce_dtype(o.reduce_dtype.empty()
                            ? (o.param_dtype == "bf16" ? "fp32" : o.param_dtype)
                            : o.reduce_dtype);
  spec.set_grad_accumulation_dtype(o.grad_accumulation_dtype.empty()
                                       ? o.param_dtype
                                       : o.grad_accumulation_dtype);
  spec.set_cpu_offload(o.cpu_offload);
  spec.set_recompute_units(o.recompute_units);
  spec.set_clip_grad_norm(o.clip_grad_norm);
  spec.set_grad_reduce(o.grad_reduce);
  spec.set_grad_divide_factor(o.grad_divide_factor);
  spec.set_on_nonfinite(NonFiniteActionName(o.on_nonfinite));
  return spec;
}

double ReferenceGradScale(const TrainingOptions& o, int64_t world_size) {
  const double world = static_cast<double>(world_size);
  if (o.grad_divide_factor > 0) return world / o.grad_divide_factor;
  return o.grad_reduce == "sum" ? world : 1.0;
}

}  // namespace hsdp::train
