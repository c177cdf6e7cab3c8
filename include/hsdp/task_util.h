// Helpers for what every task writes: initial values that are a function of
// the job's seed and the parameter's name alone (never torch's global
// generator, which the reference and each rank would consume differently),
// and samples that are a function of (seed, step, index) alone. Stateless
// functions; thread-safe.
#ifndef HSDP_TASK_UTIL_H_
#define HSDP_TASK_UTIL_H_

#include <ATen/core/Generator.h>

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace hsdp::train {

// A 64-bit mix of its inputs (splitmix64 steps): equal inputs, equal outputs,
// on every machine.
uint64_t MixSeed(uint64_t seed, uint64_t value);
uint64_t MixSeed(uint64_t seed, absl::string_view name);

// A CPU generator that depends only on (seed, name): one per parameter or
// per unit, so each draws the same values however the model is built.
at::Generator NamedGenerator(uint64_t seed, absl::string_view name);

// The generator of sample `index` of step `step`'s global batch: a task whose
// GetBatch draws sample r.first_sample + b from SampleGenerator(r.seed,
// r.step, r.first_sample + b) gives every mesh, microbatch split and the
// reference the same samples.
at::Generator SampleGenerator(uint64_t seed, int64_t step, int64_t index);

// Initialises every parameter of `module` from NamedGenerator(seed, prefix +
// its name), as PyTorch's Linear and Conv do by default: a tensor of two or
// more dims uniform in +-1/sqrt(fan_in) (fan_in: its elements per output
// row), a 1-dim "bias" zero, any other 1-dim tensor (a norm's scale) one.
// Call it on the whole model, or on a unit's module as BuildUnit(i) builds it
// with `prefix` its name under Task::Model() ("blocks_3"): the values are the
// same either way.
void InitParameters(torch::nn::Module& module, uint64_t seed,
                    const std::string& prefix = "");

}  // namespace hsdp::train

#endif  // HSDP_TASK_UTIL_H_
