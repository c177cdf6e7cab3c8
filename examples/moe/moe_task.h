// A small mixture-of-experts language model as an hsdp Task.
//
// Each layer is a unit ("layers.0", "layers.1", ...) holding `experts` small
// feed-forward experts and a router. Routing is top-1 by hashing the token
// id (hash layers): a token always goes to the same expert, so the choice
// cannot flip with rounding between a sharded run and its reference, and the
// router's learned gate scales each token's expert output. With a few tokens
// per microbatch, some experts get no token on some ranks in a step and
// tokens on others: their parameters get a gradient on some ranks only, the
// case hsdp reduces with zeros standing in (every rank runs the same
// collectives; see task.h, "Parameters without a gradient").
//
// Placement (Task::Placement): a router's weight is [1, dim], so sharded on
// dim 0 every rank but one would hold padding only; it is sharded on dim 1.
// Biases, a few floats each, are kept whole on every rank and their gradients
// all-reduced; an empty expert's biases are parameters without a gradient on
// that rank too.
//
// The data is synthetic: sample `index` of step `step` is a pure function of
// (seed, step, index), a token sequence that repeats one of a few patterns
// fixed by the seed, so the model can learn it.
//
// --model moe (or empty). --task-option KEY=VALUE (every rank the same):
// vocab (32), dim (16), hidden (32), layers (2), experts (8), seq_len (8).
#ifndef HSDP_EXAMPLES_MOE_MOE_TASK_H_
#define HSDP_EXAMPLES_MOE_MOE_TASK_H_

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "hsdp/task.h"
#include "hsdp/unit.h"

namespace moe {

inline constexpr char kModelName[] = "moe";

struct MoeConfig {
  int64_t vocab = 32;
  int64_t dim = 16;
  int64_t hidden = 32;
  int64_t layers = 2;
  int64_t experts = 8;
  int64_t seq_len = 8;
};

// The expert a token goes to: a fixed hash of its id.
int64_t ExpertOf(int64_t token, int64_t experts);

// One layer: x + gate(x) * expert_e(x) for each token's expert e.
class MoeLayerImpl : public torch::nn::Module {
 public:
  explicit MoeLayerImpl(const MoeConfig& config);
  // x [tokens, dim], route [tokens] (expert ids).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& route);

 private:
  torch::nn::Linear router_{nullptr};
  torch::nn::ModuleList experts_;
  std::vector<torch::nn::Sequential> expert_list_;
};

// Thread-compatible (see hsdp::train::Task).
class MoeTask : public hsdp::train::Task {
 public:
  // INVALID_ARGUMENT naming the flag or option on bad arguments.
  static absl::StatusOr<std::unique_ptr<MoeTask>> Create(
      const hsdp::train::TaskArgs& args);

  std::string Name() const override { return kModelName; }
  // 2: the placement above (the reductions' order, so the last bits).
  int Version() const override { return 2; }
  absl::Status Build(const hsdp::train::BuildContext& context) override;
  std::shared_ptr<torch::nn::Module> Model() override { return model_; }
  int NumUnits() const override { return static_cast<int>(config_.layers); }
  absl::StatusOr<hsdp::train::UnitSpec> BuildUnit(int index) override;
  absl::StatusOr<hsdp::train::Batch> GetBatch(
      const hsdp::train::BatchRequest& request) override;
  absl::StatusOr<at::Tensor> Loss(const hsdp::train::Batch& batch) override;
  int64_t TokensPerSample() const override { return config_.seq_len; }
  std::optional<hsdp::fsdp::ParamPlacement> Placement(
      const std::string& fqn, const at::Tensor& param) const override;

  const MoeConfig& config() const { return config_; }

 private:
  explicit MoeTask(const MoeConfig& config) : config_(config) {}

  MoeConfig config_;
  std::shared_ptr<torch::nn::Module> model_;
  torch::nn::Embedding embed_{nullptr};
  // Calling a layer enters its unit.
  std::vector<hsdp::train::Unit<MoeLayerImpl>> layers_;
  torch::nn::Linear head_{nullptr};
};

}  // namespace moe

#endif  // HSDP_EXAMPLES_MOE_MOE_TASK_H_
