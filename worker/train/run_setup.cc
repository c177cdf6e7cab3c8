#include "worker/train/run_setup.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <torch/serialize/output-archive.h>

#include "absl/strings/str_cat.h"
#include "common/policy.h"
#include "common/status_util.h"
#include "worker/train/optimizer.h"

namespace hsdp::train {
namespace {

c10::ScalarType DtypeFromName(const std::string& name) {
  return name == "bf16" ? at::kBFloat16 : at::kFloat;
}

}  // namespace

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
      .count();
}

// OpenBLAS (the pthread build Debian's libtorch uses for CPU matmuls) keeps its
// own thread pool, one thread per core by default, which at::set_num_threads
// does not touch: with several single-threaded workers on one machine the extra
// BLAS threads contend for the cores and yield-spin while idle. Looked up at
// run time so other BLAS builds (no such symbol) are left alone. OpenBLAS
// splits a GEMM across threads by output rows and columns only, so every
// element sums in the same order and the results are bitwise the same.
void SetThreads(int threads) {
  if (threads <= 0) return;
  at::set_num_threads(threads);
  using SetNumThreadsFn = void (*)(int);
  if (auto* set_num_threads = reinterpret_cast<SetNumThreadsFn>(
          dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) {
    set_num_threads(threads);
  }
}

fsdp::EngineOptions EngineOptionsFor(const TrainingOptions& t,
                                     const c10::Device& device) {
  fsdp::EngineOptions eo;
  eo.device = device;
  if (t.param_dtype == "bf16") {
    eo.mixed_precision.param_dtype = at::kBFloat16;
    eo.mixed_precision.reduce_dtype =
        t.reduce_dtype.empty() ? at::kFloat : DtypeFromName(t.reduce_dtype);
  } else if (!t.reduce_dtype.empty()) {
    eo.mixed_precision.reduce_dtype = DtypeFromName(t.reduce_dtype);
  }
  if (!t.grad_accumulation_dtype.empty()) {
    eo.mixed_precision.grad_accumulation_dtype =
        DtypeFromName(t.grad_accumulation_dtype);
  }
  eo.offload.offload_params = t.cpu_offload;
  if (t.grad_reduce == "sum") eo.gradient_reduction.op = comm::ReduceOp::kSum;
  if (t.grad_divide_factor > 0)
    eo.gradient_reduction.divide_factor = t.grad_divide_factor;
  return eo;
}

// Per task unit: recompute on, from the --recompute-units glob.
std::vector<bool> RecomputeFlags(const std::string& glob,
                                 const std::vector<fsdp::UnitInfo>& units) {
  std::vector<bool> flags;
  for (size_t i = 1; i < units.size(); ++i)
    flags.push_back(!glob.empty() && GlobMatch(glob, units[i].name));
  return flags;
}

// The task's optimizer, else the job's.
std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(
    Task& task, const TrainingOptions& t,
    const std::vector<at::Tensor>& params) {
  std::unique_ptr<torch::optim::Optimizer> opt = task.MakeOptimizer(params);
  if (opt == nullptr) opt = MakeJobOptimizer(t.optimizer, params);
  return opt;
}

// Loss() of one microbatch, checked: a scalar that requires grad.
absl::StatusOr<at::Tensor> MicrobatchLoss(Task& task, const Batch& batch) {
  HSDP_ASSIGN_OR_RETURN(at::Tensor loss, task.Loss(batch));
  if (!loss.defined() || loss.numel() != 1 || !loss.requires_grad()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Task::Loss returned ",
        loss.defined()
            ? absl::StrCat(
                  "a tensor of shape ", c10::str(loss.sizes()),
                  loss.requires_grad() ? "" : " that does not require grad")
            : std::string("an undefined tensor"),
        "; it must return the microbatch's mean loss, a scalar that requires "
        "grad"));
  }
  return loss.reshape({});
}

absl::StatusOr<Batch> MicrobatchBatch(Task& task, const BatchRequest& request,
                                      const c10::Device& device) {
  HSDP_ASSIGN_OR_RETURN(Batch batch, task.GetBatch(request));
  if (!batch.input.defined()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Task::GetBatch(step ", request.step, ", samples ",
        request.first_sample, "..", request.first_sample + request.sample_count,
        ") returned no input"));
  }
  batch.input = batch.input.to(device);
  if (batch.target.defined()) batch.target = batch.target.to(device);
  return batch;
}

absl::Status SaveParams(
    const std::vector<std::pair<std::string, at::Tensor>>& params,
    const std::string& path) {
  torch::serialize::OutputArchive archive;
  for (const auto& [name, t] : params) archive.write(name, t.detach().cpu());
  archive.save_to(path);
  return absl::OkStatus();
}

std::string NonFiniteLossMessage(int64_t step, double loss, int rank,
                                 int microbatch, int64_t count) {
  std::string message =
      absl::StrCat("step ", step, ": the loss is ", loss, " on rank ", rank,
                   ", microbatch ", microbatch);
  if (count > 1) {
    absl::StrAppend(&message, " (", count,
                    " non-finite microbatches in the step)");
  }
  return message;
}

std::string NonFiniteNormMessage(int64_t step, double norm, double max_norm) {
  return absl::StrCat("step ", step, ": the global gradient norm is ", norm,
                      " (clipping to ", max_norm,
                      "; every microbatch's loss is finite)");
}

std::string WithNonFiniteAction(const std::string& message,
                                NonFiniteAction action) {
  return action == NonFiniteAction::kSkipStep
             ? absl::StrCat(message,
                            "; the step is skipped (--on-nonfinite skip-step)")
             : absl::StrCat(message,
                            "; stopping (--on-nonfinite skip-step would skip "
                            "the step instead)");
}

}  // namespace hsdp::train
