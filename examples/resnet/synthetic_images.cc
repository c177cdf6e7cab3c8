#include "synthetic_images.h"

#include <ATen/ops/empty.h>

#include <utility>

namespace resnet {
namespace {

// How strongly noise hides the pattern (noise and pattern are uniform in
// [-1, 1]).
constexpr float kNoiseScale = 1.0f;
// A class's pattern is a random kTile x kTile texture tiled over the image at
// a per-sample offset: local and translation invariant, what convolutions and
// global pooling pick up.
constexpr int64_t kTile = 3;
// Stream of the class patterns (a sample's streams come from its own hash).
constexpr uint64_t kPatternStream = 0x5eed5eed5eedULL;

uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// splitmix64: a small generator whose output depends only on its start.
class Stream {
 public:
  explicit Stream(uint64_t state) : state_(state) {}
  uint64_t Next() {
    state_ += 0x9e3779b97f4a7c15ULL;
    return Mix(state_);
  }
  // Uniform in [-1, 1).
  float Symmetric() {
    return static_cast<float>(Next() >> 40) * (2.0f / 16777216.0f) - 1.0f;
  }

 private:
  uint64_t state_;
};

}  // namespace

SyntheticImages::SyntheticImages(int64_t channels, int64_t size,
                                 int64_t classes)
    : channels_(channels), size_(size), classes_(classes) {
  Stream stream(Mix(kPatternStream));
  patterns_.resize(static_cast<size_t>(classes * channels * kTile * kTile));
  for (float& v : patterns_) v = stream.Symmetric();
}

ImageBatch SyntheticImages::Slice(uint64_t seed, int64_t step, int64_t first,
                                  int64_t count) const {
  const int64_t pixels = channels_ * size_ * size_;
  at::Tensor images = at::empty({count, channels_, size_, size_}, at::kFloat);
  at::Tensor labels = at::empty({count}, at::kLong);
  float* img = images.data_ptr<float>();
  int64_t* lab = labels.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    const uint64_t h = Mix(seed ^ Mix(static_cast<uint64_t>(step) ^
                                      Mix(static_cast<uint64_t>(first + i))));
    const int64_t label =
        static_cast<int64_t>(h % static_cast<uint64_t>(classes_));
    lab[i] = label;
    Stream noise(h);
    const int64_t dy = static_cast<int64_t>(noise.Next() % kTile);
    const int64_t dx = static_cast<int64_t>(noise.Next() % kTile);
    const float* tile = patterns_.data() + label * channels_ * kTile * kTile;
    float* out = img + i * pixels;
    for (int64_t c = 0; c < channels_; ++c) {
      for (int64_t y = 0; y < size_; ++y) {
        for (int64_t x = 0; x < size_; ++x) {
          const float pattern =
              tile[(c * kTile + (y + dy) % kTile) * kTile + (x + dx) % kTile];
          *out++ = pattern + kNoiseScale * noise.Symmetric();
        }
      }
    }
  }
  return ImageBatch{std::move(images), std::move(labels)};
}

}  // namespace resnet
