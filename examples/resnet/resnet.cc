#include "resnet.h"

#include <torch/nn/functional/activation.h>

namespace resnet {
namespace {

torch::nn::Conv2d Conv3x3(int64_t in, int64_t out) {
  return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).padding(1));
}

torch::nn::GroupNorm Norm(int64_t groups, int64_t channels) {
  return torch::nn::GroupNorm(torch::nn::GroupNormOptions(groups, channels));
}

}  // namespace

ResidualBlockImpl::ResidualBlockImpl(int64_t channels, int64_t groups)
    : norm1_(register_module("norm1", Norm(groups, channels))),
      norm2_(register_module("norm2", Norm(groups, channels))),
      conv1_(register_module("conv1", Conv3x3(channels, channels))),
      conv2_(register_module("conv2", Conv3x3(channels, channels))) {}

at::Tensor ResidualBlockImpl::forward(const at::Tensor& x) {
  at::Tensor h = conv1_(torch::relu(norm1_(x)));
  return x + conv2_(torch::relu(norm2_(h)));
}

ResNetImpl::ResNetImpl(const ResNetConfig& config)
    : stem_(register_module("stem",
                            Conv3x3(config.in_channels, config.channels))),
      blocks_(register_module("blocks", std::make_shared<torch::nn::Module>())),
      head_norm_(
          register_module("head_norm", Norm(config.groups, config.channels))),
      classifier_(register_module(
          "classifier", torch::nn::Linear(config.channels, config.classes))) {}

at::Tensor ResNetImpl::Stem(const at::Tensor& images) { return stem_(images); }

at::Tensor ResNetImpl::Head(const at::Tensor& features) {
  return classifier_(torch::relu(head_norm_(features)).mean({2, 3}));
}

}  // namespace resnet
