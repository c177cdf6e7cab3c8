#include "moe_task.h"

#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/torch.h>

#include <map>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "hsdp/task_util.h"

namespace moe {
namespace {

// Largest accepted value of each shape option: an example, not a benchmark.
constexpr int64_t kMaxOption = 4096;
// A sample repeats one of kPatterns patterns of kPatternLength tokens (fixed
// by the seed), so the next token is mostly a function of the current one.
constexpr int64_t kPatterns = 8;
constexpr int64_t kPatternLength = 3;

absl::Status ReadOption(const std::string& key, const std::string& text,
                        int64_t* value) {
  if (!absl::SimpleAtoi(text, value) || *value <= 0 || *value > kMaxOption) {
    return absl::InvalidArgumentError(
        absl::StrCat("--task-option ", key, "=", text,
                     ": want an integer in [1, ", kMaxOption, "]"));
  }
  return absl::OkStatus();
}

}  // namespace

int64_t ExpertOf(int64_t token, int64_t experts) {
  return static_cast<int64_t>(
      hsdp::train::MixSeed(0, static_cast<uint64_t>(token)) %
      static_cast<uint64_t>(experts));
}

MoeLayerImpl::MoeLayerImpl(const MoeConfig& config) {
  router_ = register_module("router", torch::nn::Linear(config.dim, 1));
  experts_ = register_module("experts", torch::nn::ModuleList());
  for (int64_t e = 0; e < config.experts; ++e) {
    torch::nn::Sequential expert(torch::nn::Linear(config.dim, config.hidden),
                                 torch::nn::GELU(),
                                 torch::nn::Linear(config.hidden, config.dim));
    experts_->push_back(expert);
    expert_list_.push_back(expert);
  }
}

at::Tensor MoeLayerImpl::forward(const at::Tensor& x, const at::Tensor& route) {
  const at::Tensor gate = torch::sigmoid(router_->forward(x));
  at::Tensor y = torch::zeros_like(x);
  for (size_t e = 0; e < expert_list_.size(); ++e) {
    const at::Tensor idx =
        (route == static_cast<int64_t>(e)).nonzero().reshape({-1});
    if (idx.numel() == 0) continue;  // an empty expert: no gradient here
    y = y.index_add(0, idx, expert_list_[e]->forward(x.index_select(0, idx)));
  }
  return x + gate * y;
}

absl::StatusOr<std::unique_ptr<MoeTask>> MoeTask::Create(
    const hsdp::train::TaskArgs& args) {
  if (!args.model.empty() && args.model != kModelName) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--model ", args.model, ": this worker trains only ", kModelName));
  }
  if (!args.data.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--data ", args.data, ": the moe example trains on synthetic tokens"));
  }
  if (!args.dims.empty()) {
    return absl::InvalidArgumentError(
        "--dims: the moe example takes its shape from --task-option");
  }
  MoeConfig config;
  const std::map<std::string, int64_t*> known = {
      {"vocab", &config.vocab},     {"dim", &config.dim},
      {"hidden", &config.hidden},   {"layers", &config.layers},
      {"experts", &config.experts}, {"seq_len", &config.seq_len}};
  for (const auto& [key, text] : args.options) {
    auto it = known.find(key);
    if (it == known.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--task-option ", key,
                       ": the moe example knows vocab, dim, hidden, layers, "
                       "experts and seq_len"));
    }
    if (absl::Status s = ReadOption(key, text, it->second); !s.ok()) return s;
  }
  return std::unique_ptr<MoeTask>(new MoeTask(config));
}

absl::Status MoeTask::Build(const hsdp::train::BuildContext& context) {
  model_ = std::make_shared<torch::nn::Module>("Moe");
  embed_ = model_->register_module(
      "embed", torch::nn::Embedding(config_.vocab, config_.dim));
  for (int64_t l = 0; l < config_.layers; ++l) {
    layers_.emplace_back(model_->register_module(
        absl::StrCat("layers_", l), std::make_shared<MoeLayerImpl>(config_)));
  }
  head_ = model_->register_module(
      "head", torch::nn::Linear(config_.dim, config_.vocab));
  hsdp::train::InitParameters(*model_, context.seed);
  return absl::OkStatus();
}

std::optional<hsdp::fsdp::ParamPlacement> MoeTask::Placement(
    const std::string& fqn, const at::Tensor& /*param*/) const {
  hsdp::fsdp::ParamPlacement placement;
  if (absl::EndsWith(fqn, ".bias")) {
    placement.replicated = true;
    return placement;
  }
  if (absl::EndsWith(fqn, "router.weight")) {
    placement.shard_dim = 1;
    return placement;
  }
  return std::nullopt;
}

absl::StatusOr<hsdp::train::UnitSpec> MoeTask::BuildUnit(int index) {
  return layers_.at(index).Spec(absl::StrCat("layers.", index));
}

absl::StatusOr<hsdp::train::Batch> MoeTask::GetBatch(
    const hsdp::train::BatchRequest& request) {
  at::Tensor tokens =
      torch::empty({request.sample_count, config_.seq_len + 1}, torch::kLong);
  auto acc = tokens.accessor<int64_t, 2>();
  const at::Tensor patterns = torch::randint(
      config_.vocab, {kPatterns, kPatternLength},
      hsdp::train::NamedGenerator(request.seed, "patterns"), torch::kLong);
  const auto p = patterns.accessor<int64_t, 2>();
  for (int64_t b = 0; b < request.sample_count; ++b) {
    const int64_t k =
        torch::randint(kPatterns, {1},
                       hsdp::train::SampleGenerator(request.seed, request.step,
                                                    request.first_sample + b),
                       torch::kLong)
            .item<int64_t>();
    for (int64_t i = 0; i <= config_.seq_len; ++i)
      acc[b][i] = p[k][i % kPatternLength];
  }
  return hsdp::train::Batch{tokens.narrow(1, 0, config_.seq_len).contiguous(),
                            tokens.narrow(1, 1, config_.seq_len).contiguous()};
}

absl::StatusOr<at::Tensor> MoeTask::Loss(const hsdp::train::Batch& batch) {
  const at::Tensor tokens = batch.input.reshape({-1});
  at::Tensor route = tokens.clone();
  {
    auto acc = route.accessor<int64_t, 1>();
    for (int64_t i = 0; i < route.numel(); ++i)
      acc[i] = ExpertOf(acc[i], config_.experts);
  }
  at::Tensor x = embed_->forward(tokens);
  for (const auto& layer : layers_) x = layer(x, route);
  return torch::nn::functional::cross_entropy(head_->forward(x),
                                              batch.target.reshape({-1}));
}

}  // namespace moe
