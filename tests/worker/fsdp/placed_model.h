// A tiny model whose parameters take every placement (fsdp placement.h), for
// the placement tests of the engine and of checkpoints: weights sharded on dim
// 1 (with sizes no shard group divides), norm parameters and a 0-dim gain
// replicated, and parameters that get a gradient on some ranks only (a
// replicated one and one sharded on dim 1).
//
// Input: [batch, kIn] floats whose last column is 1 for the samples that take
// the rare branch (two neighbours in every kPlacedRareEvery, moving with the
// step: most ranks of a job have none), 0 otherwise. Blocks map kIn → kIn; the
// root's head maps kIn → kClasses.
#ifndef HSDP_TESTS_WORKER_FSDP_PLACED_MODEL_H_
#define HSDP_TESTS_WORKER_FSDP_PLACED_MODEL_H_

#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>
#include <utility>

#include "hsdp/fully_shard.h"

namespace hsdp::fsdp::testing {

inline constexpr int64_t kPlacedIn = 5;
inline constexpr int64_t kPlacedHidden = 7;
inline constexpr int64_t kPlacedClasses = 3;
inline constexpr int kPlacedBlocks = 2;
inline constexpr int64_t kPlacedRareEvery = 24;

class PlacedBlockImpl : public torch::nn::Module {
 public:
  PlacedBlockImpl();
  at::Tensor forward(const at::Tensor& x);

  torch::nn::Linear up{nullptr};       // weight [7, 5]: dim 1
  torch::nn::LayerNorm norm{nullptr};  // replicated
  at::Tensor gain;                     // 0-dim, replicated
  torch::nn::Linear down{nullptr};     // weight [5, 7]: dim -1
  at::Tensor rare_bias;                // [5], replicated, rare branch only
  at::Tensor rare_mix;                 // [5, 5]: dim 1, rare branch only
};
TORCH_MODULE(PlacedBlock);

class PlacedModelImpl : public torch::nn::Module {
 public:
  PlacedModelImpl();
  // `run(i, x, fn)` runs block i's forward fn on x (directly, or inside its
  // unit).
  at::Tensor forward(const at::Tensor& x,
                     const std::function<at::Tensor(int, const at::Tensor&,
                                                    const TensorFn&)>& run);

  torch::nn::ModuleList blocks{nullptr};
  torch::nn::Linear head{nullptr};  // weight [3, 5]: dim 1
};
TORCH_MODULE(PlacedModel);

// The placement the tests use: see the member comments above.
PlacementFn TestPlacement();
// Every parameter on dim 0 (the default), for loading a checkpoint saved with
// TestPlacement() into another layout.
PlacementFn DimZeroPlacement();

// Initial values drawn once from a fixed seed.
std::map<std::string, at::Tensor> PlacedInit();
PlacedModel MakePlacedModel(const std::map<std::string, at::Tensor>& init);

// Whether sample `sample` of step `step` takes the rare branch.
bool IsRareSample(int step, int64_t sample);
// Samples [begin, begin + count) of step `step`: inputs and class targets.
std::pair<at::Tensor, at::Tensor> PlacedBatch(int step, int begin, int count);
at::Tensor PlacedLoss(const at::Tensor& logits, const at::Tensor& targets);

// Shards `model` (a unit per block, then the root) with `placement`.
std::unique_ptr<Engine> ShardPlacedModel(PlacedModel& model, MeshComms comms,
                                         const PlacementFn& placement,
                                         const EngineOptions& options = {});

}  // namespace hsdp::fsdp::testing

#endif  // HSDP_TESTS_WORKER_FSDP_PLACED_MODEL_H_
