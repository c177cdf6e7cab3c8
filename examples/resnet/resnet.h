// A small pre-activation ResNet for images: a 3x3 convolution stem, residual
// blocks (norm, ReLU, 3x3 conv, twice, plus the identity), then norm, ReLU,
// global average pooling and a linear classifier. GroupNorm rather than
// BatchNorm: its statistics are per sample, so a rank's microbatch computes
// exactly what the same samples compute in the single-process reference.
//
// Plain LibTorch modules: the task (resnet_task.h) registers the blocks and
// initialises every parameter. Thread-compatible.
#ifndef HSDP_EXAMPLES_RESNET_RESNET_H_
#define HSDP_EXAMPLES_RESNET_RESNET_H_

#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <cstdint>
#include <memory>

namespace resnet {

struct ResNetConfig {
  int64_t in_channels = 3;
  int64_t channels = 8;
  int64_t blocks = 3;
  int64_t image_size = 8;
  int64_t classes = 4;
  // GroupNorm groups (must divide channels).
  int64_t groups = 2;
};

class ResidualBlockImpl : public torch::nn::Module {
 public:
  ResidualBlockImpl(int64_t channels, int64_t groups);
  at::Tensor forward(const at::Tensor& x);

 private:
  torch::nn::GroupNorm norm1_{nullptr}, norm2_{nullptr};
  torch::nn::Conv2d conv1_{nullptr}, conv2_{nullptr};
};

// The stem and the head; the blocks are registered under blocks() as "0",
// "1", ... (parameters "blocks.0.conv1.weight", ...).
class ResNetImpl : public torch::nn::Module {
 public:
  explicit ResNetImpl(const ResNetConfig& config);

  torch::nn::Module& blocks() { return *blocks_; }
  // [n, in_channels, H, W] -> [n, channels, H, W].
  at::Tensor Stem(const at::Tensor& images);
  // [n, channels, H, W] -> logits [n, classes].
  at::Tensor Head(const at::Tensor& features);

 private:
  torch::nn::Conv2d stem_{nullptr};
  std::shared_ptr<torch::nn::Module> blocks_;
  torch::nn::GroupNorm head_norm_{nullptr};
  torch::nn::Linear classifier_{nullptr};
};
TORCH_MODULE(ResNet);

}  // namespace resnet

#endif  // HSDP_EXAMPLES_RESNET_RESNET_H_
