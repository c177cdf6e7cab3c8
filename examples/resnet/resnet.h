// A small pre-activation ResNet for images: a 3x3 convolution stem, `blocks`
// residual blocks (norm, ReLU, 3x3 conv, twice, plus the identity), then norm,
// ReLU, global average pooling and a linear classifier. GroupNorm rather than
// BatchNorm: its statistics are per sample, so a rank's microbatch computes
// exactly what the same samples compute in the single-process reference.
//
// Parameters are initialised from the seed alone, with one generator for the
// stem and head and one per block, so a block can be built on its own
// (BuildBlock) with the same values on every rank and in the reference.
//
// Thread-compatible.
#ifndef HSDP_EXAMPLES_RESNET_RESNET_H_
#define HSDP_EXAMPLES_RESNET_RESNET_H_

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <cstdint>
#include <vector>

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
TORCH_MODULE(ResidualBlock);

class ResNetImpl : public torch::nn::Module {
 public:
  // Builds the stem and the head; the blocks only when build_blocks.
  ResNetImpl(const ResNetConfig& config, uint64_t seed, bool build_blocks);

  // Constructs block i from its own init stream and registers it as
  // "blocks.<i>" (replacing an earlier one).
  ResidualBlock BuildBlock(int i);
  // Unregisters block i and drops the model's reference to it.
  void ReleaseBlock(int i);
  ResidualBlock block(int i) const { return blocks_.at(i); }
  int num_blocks() const { return static_cast<int>(blocks_.size()); }

  // [n, in_channels, H, W] -> [n, channels, H, W].
  at::Tensor Stem(const at::Tensor& images);
  // [n, channels, H, W] -> logits [n, classes].
  at::Tensor Head(const at::Tensor& features);

 private:
  ResNetConfig config_;
  uint64_t seed_;
  torch::nn::Conv2d stem_{nullptr};
  std::shared_ptr<torch::nn::Module> blocks_module_;
  std::vector<ResidualBlock> blocks_;
  torch::nn::GroupNorm head_norm_{nullptr};
  torch::nn::Linear classifier_{nullptr};
};
TORCH_MODULE(ResNet);

}  // namespace resnet

#endif  // HSDP_EXAMPLES_RESNET_RESNET_H_
