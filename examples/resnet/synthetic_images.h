// A synthetic, deterministic image classification set: class k has a fixed
// random texture (a small tile repeated over the image); a sample is its
// class's texture at a random offset plus noise. Sample `index`
// of step `step`'s global batch is a pure function of (seed, step, index), so
// every mesh and the single-process reference train on the same global batch
// however it is split between ranks and microbatches.
//
// Thread-safe (stateless after construction).
#ifndef HSDP_EXAMPLES_RESNET_SYNTHETIC_IMAGES_H_
#define HSDP_EXAMPLES_RESNET_SYNTHETIC_IMAGES_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace resnet {

struct ImageBatch {
  // [count, channels, size, size] float.
  at::Tensor images;
  // [count] int64 class ids.
  at::Tensor labels;
};

class SyntheticImages {
 public:
  // The class patterns depend on the shape alone, not on the seed: the seed
  // picks the samples, the task stays the same.
  SyntheticImages(int64_t channels, int64_t size, int64_t classes);

  // Samples [first, first + count) of step `step`'s global batch.
  ImageBatch Slice(uint64_t seed, int64_t step, int64_t first,
                   int64_t count) const;

 private:
  int64_t channels_, size_, classes_;
  // classes x channels x tile x tile.
  std::vector<float> patterns_;
};

}  // namespace resnet

#endif  // HSDP_EXAMPLES_RESNET_SYNTHETIC_IMAGES_H_
