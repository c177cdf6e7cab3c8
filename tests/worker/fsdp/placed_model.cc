#include "tests/worker/fsdp/placed_model.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace hsdp::fsdp::testing {

PlacedBlockImpl::PlacedBlockImpl() {
  up = register_module("up", torch::nn::Linear(kPlacedIn, kPlacedHidden));
  norm = register_module(
      "norm",
      torch::nn::LayerNorm(torch::nn::LayerNormOptions({kPlacedHidden})));
  gain = register_parameter("gain", torch::ones({}));
  down = register_module("down", torch::nn::Linear(kPlacedHidden, kPlacedIn));
  rare_bias = register_parameter("rare_bias", torch::zeros({kPlacedIn}));
  rare_mix =
      register_parameter("rare_mix", torch::zeros({kPlacedIn, kPlacedIn}));
}

at::Tensor PlacedBlockImpl::forward(const at::Tensor& x) {
  at::Tensor h = torch::gelu(norm(up(x)) * gain);
  at::Tensor out = x + down(h);
  // The last input column marks the samples of the rare branch; a rank whose
  // samples have none never uses its parameters.
  const at::Tensor rare = x.select(1, kPlacedIn - 1).unsqueeze(1);
  if (rare.sum().item<double>() > 0) {
    out = out + rare * (rare_bias + torch::matmul(x, rare_mix.t()));
  }
  // Keep the marker column as it came, for the next block.
  return torch::cat({out.narrow(1, 0, kPlacedIn - 1), rare}, 1);
}

PlacedModelImpl::PlacedModelImpl() {
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int i = 0; i < kPlacedBlocks; ++i) blocks->push_back(PlacedBlock());
  head = register_module("head", torch::nn::Linear(kPlacedIn, kPlacedClasses));
}

at::Tensor PlacedModelImpl::forward(
    const at::Tensor& x,
    const std::function<at::Tensor(int, const at::Tensor&, const TensorFn&)>&
        run) {
  at::Tensor h = x;
  for (int i = 0; i < kPlacedBlocks; ++i) {
    std::shared_ptr<PlacedBlockImpl> block = blocks->ptr<PlacedBlockImpl>(i);
    h = run(i, h, [block](const at::Tensor& in) { return block->forward(in); });
  }
  return head(h);
}

PlacementFn TestPlacement() {
  return [](const std::string& fqn,
            const at::Tensor&) -> std::optional<ParamPlacement> {
    ParamPlacement p;
    if (absl::StrContains(fqn, ".norm.") || absl::EndsWith(fqn, ".gain") ||
        absl::EndsWith(fqn, ".rare_bias")) {
      p.replicated = true;
      return p;
    }
    if (absl::EndsWith(fqn, "up.weight") || absl::EndsWith(fqn, "rare_mix") ||
        fqn == "head.weight") {
      p.shard_dim = 1;
      return p;
    }
    if (absl::EndsWith(fqn, "down.weight")) {
      p.shard_dim = -1;
      return p;
    }
    return std::nullopt;
  };
}

PlacementFn DimZeroPlacement() {
  return [](const std::string& /*fqn*/,
            const at::Tensor& t) -> std::optional<ParamPlacement> {
    ParamPlacement p;
    p.replicated = t.dim() == 0;  // a 0-dim parameter cannot be sharded
    return p;
  };
}

std::map<std::string, at::Tensor> PlacedInit() {
  torch::manual_seed(23);
  PlacedModel model;
  std::map<std::string, at::Tensor> init;
  torch::NoGradGuard no_grad;
  for (const auto& item : model->named_parameters()) {
    at::Tensor v = item.value().detach().clone();
    // Non-trivial norm, gain and rare parameters, so every one shows.
    if (v.dim() <= 1 || absl::StrContains(item.key(), "rare"))
      v.add_(torch::randn(v.sizes()) * 0.3);
    init[item.key()] = v;
  }
  return init;
}

PlacedModel MakePlacedModel(const std::map<std::string, at::Tensor>& init) {
  PlacedModel model;
  torch::NoGradGuard no_grad;
  for (auto& item : model->named_parameters())
    item.value().copy_(init.at(item.key()));
  return model;
}

bool IsRareSample(int step, int64_t sample) {
  const int64_t first = (5 * step) % kPlacedRareEvery;
  const int64_t at = sample % kPlacedRareEvery;
  return at == first || at == (first + 1) % kPlacedRareEvery;
}

std::pair<at::Tensor, at::Tensor> PlacedBatch(int step, int begin, int count) {
  at::Tensor x = torch::empty({count, kPlacedIn});
  at::Tensor y = torch::empty({count}, torch::kLong);
  for (int b = 0; b < count; ++b) {
    const int64_t sample = begin + b;
    at::Generator gen = at::detail::createCPUGenerator(
        static_cast<uint64_t>(1000 * step + sample + 1));
    x[b].normal_(0, 1, gen);
    x[b][kPlacedIn - 1] = IsRareSample(step, sample) ? 1.0 : 0.0;
    y[b] = (sample * 7 + step) % kPlacedClasses;
  }
  return {x, y};
}

at::Tensor PlacedLoss(const at::Tensor& logits, const at::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits, targets);
}

std::unique_ptr<Engine> ShardPlacedModel(PlacedModel& model, MeshComms comms,
                                         const PlacementFn& placement,
                                         const EngineOptions& options) {
  absl::StatusOr<std::unique_ptr<Engine>> engine =
      Engine::Create(model.ptr(), comms, options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  UnitOptions unit;
  unit.placement = placement;
  for (int i = 0; i < kPlacedBlocks; ++i) {
    const absl::StatusOr<int> index = (*engine)->FullyShard(
        {model->blocks[i]}, absl::StrCat("blocks.", i), unit);
    EXPECT_TRUE(index.ok()) << index.status();
  }
  const absl::Status root = (*engine)->FullyShardRoot(unit);
  EXPECT_TRUE(root.ok()) << root;
  return std::move(*engine);
}

}  // namespace hsdp::fsdp::testing
