#include "hsdp/models/gpt.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/functional/loss.h>

#include <cmath>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace hsdp::models {
namespace {

constexpr double kInitStd = 0.02;
constexpr char kCustomName[] = "gpt-custom";
constexpr char kLayersPrefix[] = "layers.";

GptConfig MakeConfig(const char* name, int64_t d, int64_t layers, int64_t heads,
                     int64_t seq) {
  GptConfig c;
  c.name = name;
  c.d_model = d;
  c.n_layers = layers;
  c.n_heads = heads;
  c.seq_len = seq;
  return c;
}

// Named sizes, smallest first. gpt-tiny is for tests (well under a second per
// step on one CPU core); gpt-1b is ~1.0e9 parameters for GPUs.
const std::vector<GptConfig>& NamedConfigs() {
  static const auto* configs = new std::vector<GptConfig>{
      MakeConfig("gpt-tiny", 64, 2, 4, 64),
      MakeConfig("gpt-small", 256, 4, 4, 128),
      MakeConfig("gpt-medium", 512, 8, 8, 256),
      MakeConfig("gpt-1b", 2048, 20, 16, 1024),
  };
  return *configs;
}

absl::Status ValidateConfig(const GptConfig& c) {
  if (c.d_model <= 0 || c.n_layers <= 0 || c.n_heads <= 0 || c.seq_len <= 0 ||
      c.vocab_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("model dims must be positive, got ", c.DimsString()));
  }
  if (c.d_model % c.n_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "d_model ", c.d_model, " is not divisible by n_heads ", c.n_heads));
  }
  return absl::OkStatus();
}

}  // namespace

std::string GptConfig::DimsString() const {
  return absl::StrCat(d_model, ",", n_layers, ",", n_heads, ",", seq_len);
}

std::vector<std::string> KnownModelNames() {
  std::vector<std::string> names;
  for (const GptConfig& c : NamedConfigs()) names.push_back(c.name);
  return names;
}

absl::StatusOr<GptConfig> GptConfigForName(absl::string_view name) {
  for (const GptConfig& c : NamedConfigs()) {
    if (c.name == name) return c;
  }
  return absl::NotFoundError(
      absl::StrCat("unknown model '", name,
                   "' (known: ", absl::StrJoin(KnownModelNames(), ", "),
                   "; or give --dims d_model,n_layers,n_heads,seq_len)"));
}

absl::StatusOr<GptConfig> GptConfigFromDims(absl::string_view dims) {
  std::vector<absl::string_view> parts = absl::StrSplit(dims, ',');
  constexpr size_t kDimCount = 4;
  if (parts.size() != kDimCount) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--dims wants d_model,n_layers,n_heads,seq_len, got '", dims, "'"));
  }
  int64_t v[kDimCount];
  for (size_t i = 0; i < kDimCount; ++i) {
    if (!absl::SimpleAtoi(parts[i], &v[i])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--dims: '", parts[i], "' is not an integer in '", dims, "'"));
    }
  }
  GptConfig c = MakeConfig(kCustomName, v[0], v[1], v[2], v[3]);
  if (absl::Status s = ValidateConfig(c); !s.ok()) return s;
  return c;
}

absl::StatusOr<GptConfig> ResolveGptConfig(absl::string_view model_name,
                                           absl::string_view dims) {
  if (dims.empty()) return GptConfigForName(model_name);
  absl::StatusOr<GptConfig> from_dims = GptConfigFromDims(dims);
  if (!from_dims.ok()) return from_dims.status();
  if (!model_name.empty() && model_name != kCustomName) {
    absl::StatusOr<GptConfig> named = GptConfigForName(model_name);
    if (!named.ok()) return named.status();
    from_dims->name = named->name;
    from_dims->vocab_size = named->vocab_size;
  }
  return from_dims;
}

int64_t GptParamCount(const GptConfig& c) {
  const int64_t d = c.d_model;
  const int64_t f = c.ffn_dim();
  const int64_t ln = 2 * d;
  const int64_t block =
      ln + (d * 3 * d + 3 * d) + (d * d + d) + ln + (d * f + f) + (f * d + d);
  const int64_t head = c.tie_embeddings ? 0 : c.vocab_size * d;
  return c.vocab_size * d + c.seq_len * d + c.n_layers * block + ln + head;
}

std::string UnitName(int index) {
  return index == 0 ? std::string(kRootUnitName)
                    : absl::StrCat(kLayersPrefix, index - 1);
}

BlockImpl::BlockImpl(int64_t d_model, int64_t n_heads, int64_t d_ff)
    : n_heads_(n_heads) {
  ln1_ = register_module(
      "ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})));
  qkv_ = register_module("qkv", torch::nn::Linear(d_model, 3 * d_model));
  proj_ = register_module("proj", torch::nn::Linear(d_model, d_model));
  ln2_ = register_module(
      "ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})));
  fc_ = register_module("fc", torch::nn::Linear(d_model, d_ff));
  out_ = register_module("out", torch::nn::Linear(d_ff, d_model));
}

at::Tensor BlockImpl::forward(const at::Tensor& x) {
  const int64_t b = x.size(0), t = x.size(1), d = x.size(2);
  const int64_t hd = d / n_heads_;
  // [b, t, 3d] -> 3 x [b, heads, t, hd]
  std::vector<at::Tensor> qkv =
      qkv_->forward(ln1_->forward(x)).chunk(3, /*dim=*/-1);
  auto heads = [&](const at::Tensor& y) {
    return y.view({b, t, n_heads_, hd}).transpose(1, 2);
  };
  at::Tensor q = heads(qkv[0]), k = heads(qkv[1]), v = heads(qkv[2]);
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) *
                      (1.0 / std::sqrt(static_cast<double>(hd)));
  // Causal mask built per call (cheap at these sizes) rather than a buffer:
  // buffers are not parameters and would need their own sharding/device story
  // in the engine.
  at::Tensor mask = at::ones({t, t}, x.options().dtype(at::kBool)).triu(1);
  scores = scores.masked_fill(mask, -std::numeric_limits<float>::infinity());
  at::Tensor attn =
      at::matmul(at::softmax(scores, -1), v).transpose(1, 2).reshape({b, t, d});
  at::Tensor h = x + proj_->forward(attn);
  return h + out_->forward(at::gelu(fc_->forward(ln2_->forward(h))));
}

namespace {

// Generator of one init stream: the root's (index 0) or block i's (i + 1).
at::Generator InitGenerator(uint64_t seed, int64_t stream) {
  uint64_t x =
      seed ^ (0x9e3779b97f4a7c15ULL * static_cast<uint64_t>(stream + 1));
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return at::make_generator<at::CPUGeneratorImpl>(x ^ (x >> 31));
}

// GPT-2 style init of `module`'s parameters in registration order.
void InitParameters(torch::nn::Module& module, at::Generator gen,
                    int64_t n_layers) {
  const double residual_std =
      kInitStd / std::sqrt(2.0 * static_cast<double>(n_layers));
  torch::NoGradGuard no_grad;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    const std::string& name = item.key();
    at::Tensor p = item.value();
    const bool is_norm = absl::StrContains(name, "ln");
    if (absl::EndsWith(name, ".bias")) {
      p.zero_();
    } else if (is_norm) {
      p.fill_(1.0);
    } else if (absl::EndsWith(name, "proj.weight") ||
               absl::EndsWith(name, "out.weight")) {
      p.normal_(0.0, residual_std, gen);
    } else {
      p.normal_(0.0, kInitStd, gen);
    }
  }
}

// The tied head: a module whose one parameter, "weight", is another module's.
class TiedHeadImpl : public torch::nn::Module {
 public:
  explicit TiedHeadImpl(const at::Tensor& weight) {
    register_parameter("weight", weight);
  }
};

}  // namespace

GptImpl::GptImpl(const GptConfig& config, uint64_t seed, bool build_blocks)
    : config_(config), seed_(seed) {
  const int64_t d = config.d_model;
  tok_emb_ =
      register_module("tok_emb", torch::nn::Embedding(config.vocab_size, d));
  pos_emb_ =
      register_module("pos_emb", torch::nn::Embedding(config.seq_len, d));
  layers_ = register_module("layers", std::make_shared<torch::nn::Module>());
  blocks_.resize(static_cast<size_t>(config.n_layers), Block(nullptr));
  ln_f_ = register_module(
      "ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
  if (config.tie_embeddings) {
    head_ = register_module("head",
                            std::make_shared<TiedHeadImpl>(tok_emb_->weight));
    head_weight_ = tok_emb_->weight;
  } else {
    torch::nn::Linear head(
        torch::nn::LinearOptions(d, config.vocab_size).bias(false));
    head_ = register_module("head", head.ptr());
    head_weight_ = head->weight;
  }
  // Root parameters only: the blocks are not registered yet.
  InitParameters(*this, InitGenerator(seed, 0), config.n_layers);
  if (build_blocks) {
    for (int i = 0; i < config.n_layers; ++i) BuildBlock(i);
  }
}

Block GptImpl::BuildBlock(int i) {
  Block block(config_.d_model, config_.n_heads, config_.ffn_dim());
  InitParameters(*block, InitGenerator(seed_, i + 1), config_.n_layers);
  const std::string name = std::to_string(i);
  if (blocks_.at(i).is_empty()) {
    layers_->register_module(name, block);
  } else {
    layers_->replace_module(name, block);
  }
  blocks_.at(i) = block;
  return block;
}

void GptImpl::ReleaseBlock(int i) {
  if (blocks_.at(i).is_empty()) return;
  layers_->unregister_module(std::to_string(i));
  blocks_.at(i) = Block(nullptr);
}

at::Tensor GptImpl::forward(const at::Tensor& tokens) {
  const int64_t t = tokens.size(1);
  TORCH_CHECK(t <= config_.seq_len, "sequence length ", t,
              " exceeds model seq_len ", config_.seq_len);
  at::Tensor pos = at::arange(t, tokens.options().dtype(at::kLong));
  at::Tensor x =
      tok_emb_->forward(tokens) + pos_emb_->forward(pos).unsqueeze(0);
  for (int i = 0; i < num_blocks(); ++i) {
    x = block_runner_ ? block_runner_(i, x) : blocks_[i]->forward(x);
  }
  return at::linear(ln_f_->forward(x), head_weight_);
}

at::Tensor GptImpl::Loss(const at::Tensor& tokens, const at::Tensor& targets) {
  at::Tensor logits = forward(tokens);
  return torch::nn::functional::cross_entropy(
      logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
}

std::vector<std::shared_ptr<torch::nn::Module>> GptImpl::RootModules() const {
  return {tok_emb_.ptr(), pos_emb_.ptr(), ln_f_.ptr(), head_};
}

void GptImpl::set_block_runner(BlockRunner runner) {
  block_runner_ = std::move(runner);
}

std::vector<std::string> GptImpl::UnitNames() const {
  std::vector<std::string> names;
  for (int i = 0; i <= num_blocks(); ++i) names.push_back(UnitName(i));
  return names;
}

std::vector<at::Tensor> GptImpl::UnitParameters(int unit_index) const {
  if (unit_index > 0) return blocks_.at(unit_index - 1)->parameters();
  std::vector<at::Tensor> params;
  for (const auto& m : RootModules()) {
    for (const at::Tensor& p : m->parameters()) params.push_back(p);
  }
  return params;
}

}  // namespace hsdp::models
