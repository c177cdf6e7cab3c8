// The built-in GPT (gpt.h) as a Task: byte-level text or token files, one unit
// per block ("layers.i"), sharded initialisation (each block is constructed
// only when the runner shards it).
//
// Task options (--task-option KEY=VALUE): tie_embeddings=true makes the output
// head reuse the token embedding's weight.
#ifndef HSDP_MODELS_GPT_TASK_H_
#define HSDP_MODELS_GPT_TASK_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "hsdp/models/gpt.h"
#include "hsdp/models/token_dataset.h"
#include "hsdp/task.h"

namespace hsdp::models {

// Bumped whenever the GPT's numbers change (init, data order, loss).
inline constexpr int kGptTaskVersion = 2;

// Thread-compatible (see train::Task).
class GptTask : public train::Task {
 public:
  // Resolves the model from --model/--dims/--vocab-size and opens the data
  // (INVALID_ARGUMENT / NOT_FOUND naming the flag or the file).
  static absl::StatusOr<std::unique_ptr<GptTask>> Create(
      const train::TaskArgs& args);

  std::string Name() const override { return config_.name; }
  int Version() const override { return kGptTaskVersion; }
  absl::Status Build(const train::BuildContext& context) override;
  std::shared_ptr<torch::nn::Module> Model() override { return model_.ptr(); }
  int NumUnits() const override { return static_cast<int>(config_.n_layers); }
  absl::StatusOr<train::UnitSpec> BuildUnit(int index) override;
  void ReleaseUnit(int index) override;
  void Shard(train::ShardContext& context) override;
  absl::StatusOr<train::Batch> GetBatch(
      const train::BatchRequest& request) override;
  absl::StatusOr<at::Tensor> Loss(const train::Batch& batch) override;
  int64_t TokensPerSample() const override { return config_.seq_len; }

  const GptConfig& config() const { return config_; }
  Gpt& model() { return model_; }

 private:
  GptTask(GptConfig config, TokenDataset data)
      : config_(std::move(config)), data_(std::move(data)) {}

  GptConfig config_;
  TokenDataset data_;
  Gpt model_{nullptr};
};

}  // namespace hsdp::models

#endif  // HSDP_MODELS_GPT_TASK_H_
