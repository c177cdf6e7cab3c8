#include "resnet.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/functional/activation.h>
#include <torch/utils.h>

#include <cmath>
#include <string>

namespace resnet {
namespace {

// The last conv of each block starts small, so the blocks start close to the
// identity and the residual stream stays well scaled.
constexpr double kResidualInitScale = 0.1;

at::Generator InitGenerator(uint64_t seed, int64_t stream) {
  uint64_t x =
      seed ^ (0x9e3779b97f4a7c15ULL * static_cast<uint64_t>(stream + 1));
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return at::make_generator<at::CPUGeneratorImpl>(x ^ (x >> 31));
}

// He-normal weights (times kResidualInitScale for a block's conv2), zero
// biases, unit norm scales; in registration order, from `gen`.
void InitParameters(torch::nn::Module& module, at::Generator gen) {
  torch::NoGradGuard no_grad;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    const std::string& name = item.key();
    at::Tensor p = item.value();
    const bool is_norm = name.find("norm") != std::string::npos;
    if (name.size() >= 4 && name.compare(name.size() - 4, 4, "bias") == 0) {
      p.zero_();
    } else if (is_norm) {
      p.fill_(1.0);
    } else {
      const double fan_in = static_cast<double>(p[0].numel());
      double std = std::sqrt(2.0 / fan_in);
      if (name.find("conv2.weight") != std::string::npos) {
        std *= kResidualInitScale;
      }
      p.normal_(0.0, std, gen);
    }
  }
}

}  // namespace

ResidualBlockImpl::ResidualBlockImpl(int64_t channels, int64_t groups) {
  norm1_ = register_module(
      "norm1",
      torch::nn::GroupNorm(torch::nn::GroupNormOptions(groups, channels)));
  conv1_ = register_module(
      "conv1", torch::nn::Conv2d(
                   torch::nn::Conv2dOptions(channels, channels, 3).padding(1)));
  norm2_ = register_module(
      "norm2",
      torch::nn::GroupNorm(torch::nn::GroupNormOptions(groups, channels)));
  conv2_ = register_module(
      "conv2", torch::nn::Conv2d(
                   torch::nn::Conv2dOptions(channels, channels, 3).padding(1)));
}

at::Tensor ResidualBlockImpl::forward(const at::Tensor& x) {
  at::Tensor h = conv1_(torch::relu(norm1_(x)));
  h = conv2_(torch::relu(norm2_(h)));
  return x + h;
}

ResNetImpl::ResNetImpl(const ResNetConfig& config, uint64_t seed,
                       bool build_blocks)
    : config_(config), seed_(seed) {
  stem_ = register_module(
      "stem", torch::nn::Conv2d(torch::nn::Conv2dOptions(config.in_channels,
                                                         config.channels, 3)
                                    .padding(1)));
  blocks_module_ =
      register_module("blocks", std::make_shared<torch::nn::Module>());
  blocks_.resize(static_cast<size_t>(config.blocks), ResidualBlock(nullptr));
  head_norm_ = register_module("head_norm",
                               torch::nn::GroupNorm(torch::nn::GroupNormOptions(
                                   config.groups, config.channels)));
  classifier_ = register_module(
      "classifier", torch::nn::Linear(config.channels, config.classes));
  // Stem and head only: no block is registered yet.
  InitParameters(*this, InitGenerator(seed_, 0));
  if (build_blocks) {
    for (int i = 0; i < config.blocks; ++i) BuildBlock(i);
  }
}

ResidualBlock ResNetImpl::BuildBlock(int i) {
  ResidualBlock block(config_.channels, config_.groups);
  InitParameters(*block, InitGenerator(seed_, i + 1));
  const std::string name = std::to_string(i);
  if (blocks_.at(i).is_empty()) {
    blocks_module_->register_module(name, block);
  } else {
    blocks_module_->replace_module(name, block);
  }
  blocks_.at(i) = block;
  return block;
}

void ResNetImpl::ReleaseBlock(int i) {
  if (blocks_.at(i).is_empty()) return;
  blocks_module_->unregister_module(std::to_string(i));
  blocks_.at(i) = ResidualBlock(nullptr);
}

at::Tensor ResNetImpl::Stem(const at::Tensor& images) { return stem_(images); }

at::Tensor ResNetImpl::Head(const at::Tensor& features) {
  at::Tensor pooled = torch::relu(head_norm_(features)).mean({2, 3});
  return classifier_(pooled);
}

}  // namespace resnet
