#include "worker/train/run_setup.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>

#include "common/policy.h"

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
                                 const std::vector<fsdp::UnitLayout>& units) {
  std::vector<bool> flags;
  for (size_t i = 1; i < units.size(); ++i)
    flags.push_back(!glob.empty() && GlobMatch(glob, units[i].name));
  return flags;
}

}  // namespace hsdp::train
