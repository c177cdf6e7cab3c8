// GPT-style decoder used by the worker, the tests and the benchmarks.
//
// token + position embedding -> N pre-norm blocks (causal self-attention, MLP)
// -> final LayerNorm -> linear head. Byte-level vocabulary (256) by default. No
// dropout: training must be deterministic so sharded runs can be compared
// bitwise against each other and against an unsharded reference.
//
// Sharding units (the contract between worker, coordinator and engine): index 0
// is "root" (embeddings, final norm, head: every parameter not under
// "layers."), then "layers.0", "layers.1", ... in forward order. The blocks are
// exposed as a list so the engine can shard each one as its own unit, and every
// block call goes through a replaceable BlockRunner so the engine can enter the
// unit around it (LibTorch modules have no forward hooks).
//
// Thread-safety: a Gpt instance is thread-compatible (one training thread);
// distinct instances may be used from distinct threads (init uses a private
// generator, never the global one).
#ifndef HSDP_MODELS_GPT_H_
#define HSDP_MODELS_GPT_H_

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace hsdp::models {

// Byte-level tokens.
inline constexpr int64_t kByteVocabSize = 256;
// Name of the root unit (everything outside "layers.").
inline constexpr char kRootUnitName[] = "root";

struct GptConfig {
  // "gpt-tiny", ..., or "gpt-custom" for explicit dims.
  std::string name;
  int64_t vocab_size = kByteVocabSize;
  int64_t d_model = 64;
  int64_t n_layers = 2;
  int64_t n_heads = 4;
  int64_t seq_len = 64;
  // MLP hidden size; 0 means 4 * d_model.
  int64_t d_ff = 0;
  // The output head reuses the token embedding's weight (one parameter used
  // by two modules, both in the root unit).
  bool tie_embeddings = false;

  int64_t ffn_dim() const { return d_ff > 0 ? d_ff : 4 * d_model; }
  // "d_model,n_layers,n_heads,seq_len" — the --dims spelling.
  std::string DimsString() const;
};

// Names accepted by GptConfigForName, smallest first.
std::vector<std::string> KnownModelNames();
// NOT_FOUND naming the known models when `name` is not one of them.
absl::StatusOr<GptConfig> GptConfigForName(absl::string_view name);
// Parses "d_model,n_layers,n_heads,seq_len" (INVALID_ARGUMENT on bad syntax or
// d_model % n_heads).
absl::StatusOr<GptConfig> GptConfigFromDims(absl::string_view dims);
// Model from --model and optional --dims (dims win, keeping the name
// "gpt-custom" unless a name was given, in which case the name's vocab is kept
// and dims override the rest).
absl::StatusOr<GptConfig> ResolveGptConfig(absl::string_view model_name,
                                           absl::string_view dims);

// Total parameter count of a model with this config (without building it).
int64_t GptParamCount(const GptConfig& config);

// One pre-norm transformer block: x + attn(ln1(x)); x + mlp(ln2(x)).
class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(int64_t d_model, int64_t n_heads, int64_t d_ff);
  // x: [batch, seq, d_model] -> same shape.
  at::Tensor forward(const at::Tensor& x);

 private:
  int64_t n_heads_;
  torch::nn::LayerNorm ln1_{nullptr};
  torch::nn::Linear qkv_{nullptr};
  torch::nn::Linear proj_{nullptr};
  torch::nn::LayerNorm ln2_{nullptr};
  torch::nn::Linear fc_{nullptr};
  torch::nn::Linear out_{nullptr};
};
TORCH_MODULE(Block);

// Runs block `index` on `x`. The default calls the block directly; the engine
// installs one that enters the block's unit (pre-forward all-gather,
// post-forward reshard) around the call.
using BlockRunner = std::function<at::Tensor(int index, const at::Tensor& x)>;

class GptImpl : public torch::nn::Module {
 public:
  // Parameters are initialised deterministically from `seed` (GPT-2 style: N(0,
  // 0.02), residual projections scaled by 1/sqrt(2 * n_layers), LayerNorm
  // weight 1, biases 0). Each block draws from its own generator, seeded from
  // (seed, block index), and the root modules from (seed, root): a block built
  // alone (BuildBlock) has the same values as in a model built whole. With
  // `build_blocks` false only the root modules exist until BuildBlock.
  GptImpl(const GptConfig& config, uint64_t seed, bool build_blocks = true);

  // Constructs block i, initialised, registered as "layers.i" (replacing an
  // earlier block i). Returns it.
  Block BuildBlock(int i);
  // Unregisters block i and drops this model's reference to it.
  void ReleaseBlock(int i);

  // tokens: int64 [batch, seq] with seq <= config.seq_len -> logits [batch,
  // seq, vocab].
  at::Tensor forward(const at::Tensor& tokens);
  // Mean next-token cross entropy of forward(tokens) against targets (int64
  // [batch, seq]).
  at::Tensor Loss(const at::Tensor& tokens, const at::Tensor& targets);

  const GptConfig& config() const { return config_; }
  int num_blocks() const { return static_cast<int>(blocks_.size()); }
  // The blocks in forward order; block i is unit "layers.i".
  const std::vector<Block>& blocks() const { return blocks_; }
  // Block i (a holder sharing the module; callable from const contexts). Null
  // until built.
  Block block(int i) const { return blocks_.at(i); }
  // Modules of the root unit (embeddings, final norm, head).
  std::vector<std::shared_ptr<torch::nn::Module>> RootModules() const;

  // Replaces how blocks are called (nullptr restores the direct call).
  void set_block_runner(BlockRunner runner);

  // "root", "layers.0", ... — the job's unit list.
  std::vector<std::string> UnitNames() const;
  // Parameters of unit `unit_index` (0 = root) in registration order.
  std::vector<at::Tensor> UnitParameters(int unit_index) const;

 private:
  GptConfig config_;
  uint64_t seed_;
  torch::nn::Embedding tok_emb_{nullptr};
  torch::nn::Embedding pos_emb_{nullptr};
  // Holds the blocks as "0", "1", ... so they are named "layers.i".
  std::shared_ptr<torch::nn::Module> layers_;
  std::vector<Block> blocks_;
  torch::nn::LayerNorm ln_f_{nullptr};
  // The output projection: a bias-free Linear, or (tie_embeddings) a module
  // whose "weight" is the token embedding's.
  std::shared_ptr<torch::nn::Module> head_;
  at::Tensor head_weight_;
  BlockRunner block_runner_;
};
TORCH_MODULE(Gpt);

// Name of unit `index` of a model with `num_blocks` blocks ("root",
// "layers.i").
std::string UnitName(int index);

}  // namespace hsdp::models

#endif  // HSDP_MODELS_GPT_H_
