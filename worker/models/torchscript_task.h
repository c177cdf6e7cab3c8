// A model written in Python, scripted (torch.jit.script) and saved
// (torch.jit.save), trained as a Task: `--model torchscript:PATH`.
//
// The convention (examples/torchscript/README.md has the full text). The root
// scripted module has
//   vocab_size: int, seq_len: int       attributes: the data's shape
//   embed(tokens: Tensor) -> Tensor     int64 [b, t] -> activations
//   head_loss(x: Tensor, targets: Tensor) -> Tensor    mean loss, a scalar
//   forward(tokens: Tensor, targets: Tensor) -> Tensor the same loss
// and every submodule the unit rule (--units, default "layers.*") selects has
//   forward(x: Tensor) -> Tensor
// The worker computes a microbatch's loss as
//   x = embed(tokens); for each unit u in model order: x = u(x);
//   loss = head_loss(x, targets)
// entering each unit through ShardContext::Forward around that unit's forward
// alone, so its parameters are gathered just before it, freed after it (as the
// schedule says) and prefetched like a C++ module's. Parameters no unit
// contains (embeddings, final norm, head) are the root unit's. The worker never
// calls the root forward in training; at start it checks on one sample that
// forward's loss equals the chained one, which refuses a rule that leaves out
// a stage (that stage would silently never run) or selects modules the model
// does not run one after another.
//
// Parameters. A scripted module keeps its parameters as tensor attributes
// (IValue slots of the module object). The task builds a torch::nn::Module tree
// that mirrors the scripted one (same child names, so the same dotted parameter
// names) and registers the very same tensors in it: one TensorImpl shared by
// the scripted module's slot and the mirror's parameter. The engine shards the
// mirror exactly like a C++ model: ShardedParam::Create calls set_data on that
// TensorImpl and later frees and refills its storage in place, which the
// scripted code sees through prim::GetAttr, and autograd accumulates the
// gradients of the scripted ops on that same TensorImpl, where the engine
// reduces them into the shards. Buffers are mirrored the same way (so they move
// with the model); other tensor attributes do not move and must stay on the
// CPU.
//
// Numerics. The scripted methods run with the graph executor's optimisations
// off (per call, per thread): the interpreter runs the ops as written, with
// eager autograd, so results do not depend on how many times a method ran
// (profiling, fusion) and match between sharded runs, the reference and an
// eager Python run of the same module.
//
// Refusals (INVALID_ARGUMENT, one line naming the file and what is wrong): not
// a TorchScript archive, a missing method or attribute, a method with the wrong
// signature, a unit rule matching nothing, overlapping units, units whose
// chain differs from forward. NOT_FOUND for a missing file.
//
// The initial values are the saved ones (--seed only orders the data). Name()
// is "torchscript:" plus the scripted class; Version() is a hash of the
// archive's bytes, so every worker of a job must load the same file contents.
#ifndef HSDP_WORKER_MODELS_TORCHSCRIPT_TASK_H_
#define HSDP_WORKER_MODELS_TORCHSCRIPT_TASK_H_

#include <torch/csrc/jit/api/module.h>
#include <torch/nn/module.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "hsdp/models/token_dataset.h"
#include "hsdp/task.h"

namespace hsdp::models {

// --model torchscript:PATH
inline constexpr char kTorchScriptModelPrefix[] = "torchscript:";
// --units (--task-option units=RULE) when none is given.
inline constexpr char kDefaultUnitRule[] = "layers.*";
// The task-option key --units sets.
inline constexpr char kUnitsOption[] = "units";
// --task-option placement=RULE: parameters sharded on another dim or
// replicated, by name (placement_rule.h); none when unset.
inline constexpr char kPlacementOption[] = "placement";

// Thread-compatible (see train::Task).
class TorchScriptTask : public train::Task {
 public:
  // Loads and checks the archive named by args.model ("torchscript:PATH"),
  // resolves the units and opens the data.
  static absl::StatusOr<std::unique_ptr<TorchScriptTask>> Create(
      const train::TaskArgs& args);

  std::string Name() const override { return name_; }
  int Version() const override { return version_; }
  absl::Status Build(const train::BuildContext& context) override;
  std::shared_ptr<torch::nn::Module> Model() override { return mirror_; }
  int NumUnits() const override { return static_cast<int>(unit_names_.size()); }
  absl::StatusOr<train::UnitSpec> BuildUnit(int index) override;
  void SetShardContext(train::ShardContext& context) override {
    units_ = &context;
  }
  absl::StatusOr<train::Batch> GetBatch(
      const train::BatchRequest& request) override;
  absl::StatusOr<at::Tensor> Loss(const train::Batch& batch) override;
  int64_t TokensPerSample() const override { return seq_len_; }
  std::optional<fsdp::ParamPlacement> Placement(
      const std::string& fqn, const at::Tensor& param) const override;

  // The units' module names in forward order ("layers.0", ...).
  const std::vector<std::string>& unit_names() const { return unit_names_; }
  torch::jit::Module& scripted() { return module_; }

 private:
  TorchScriptTask(torch::jit::Module module, TokenDataset data)
      : module_(std::move(module)), data_(std::move(data)) {}

  torch::jit::Module module_;
  TokenDataset data_;
  std::string path_;
  std::string name_;
  int version_ = 1;
  int64_t seq_len_ = 0;
  std::vector<std::string> unit_names_;
  // From the placement option, by parameter name.
  std::map<std::string, fsdp::ParamPlacement> placements_;
  // The units' scripted modules (handles sharing module_'s objects).
  std::vector<torch::jit::Module> unit_modules_;
  std::shared_ptr<torch::nn::Module> mirror_;
  // mirror_'s modules of the units.
  std::vector<std::shared_ptr<torch::nn::Module>> unit_mirrors_;
  train::ShardContext* units_ = nullptr;
};

}  // namespace hsdp::models

#endif  // HSDP_WORKER_MODELS_TORCHSCRIPT_TASK_H_
