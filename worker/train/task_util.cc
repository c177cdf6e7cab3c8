#include "hsdp/task_util.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/module.h>

#include <cmath>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace hsdp::train {
namespace {

uint64_t SplitMix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

uint64_t MixSeed(uint64_t seed, uint64_t value) {
  return SplitMix(SplitMix(seed) ^ value);
}

uint64_t MixSeed(uint64_t seed, absl::string_view name) {
  // FNV-1a over the bytes, then mixed with the seed.
  uint64_t h = 0xcbf29ce484222325ULL;
  for (char c : name) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001b3ULL;
  }
  return MixSeed(seed, h);
}

at::Generator NamedGenerator(uint64_t seed, absl::string_view name) {
  return at::make_generator<at::CPUGeneratorImpl>(MixSeed(seed, name));
}

at::Generator SampleGenerator(uint64_t seed, int64_t step, int64_t index) {
  return at::make_generator<at::CPUGeneratorImpl>(
      MixSeed(MixSeed(seed, static_cast<uint64_t>(step)),
              static_cast<uint64_t>(index)));
}

void InitParameters(torch::nn::Module& module, uint64_t seed,
                    const std::string& prefix) {
  torch::NoGradGuard no_grad;
  for (auto& item : module.named_parameters(/*recurse=*/true)) {
    const std::string name =
        prefix.empty() ? item.key() : absl::StrCat(prefix, ".", item.key());
    at::Tensor p = item.value();
    if (p.numel() == 0) continue;
    if (p.dim() >= 2) {
      const double bound =
          1.0 / std::sqrt(static_cast<double>(p.numel() / p.size(0)));
      // Drawn on the CPU, then copied: the same values on any device.
      p.copy_(at::empty(p.sizes(), at::TensorOptions().dtype(p.scalar_type()))
                  .uniform_(-bound, bound, NamedGenerator(seed, name)));
    } else if (absl::EndsWith(item.key(), "bias")) {
      p.zero_();
    } else {
      p.fill_(1.0);
    }
  }
}

}  // namespace hsdp::train
