#include "hsdp/models/gpt_task.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_util.h"

namespace hsdp::models {
namespace {

constexpr char kTieEmbeddings[] = "tie_embeddings";

absl::StatusOr<bool> BoolOption(const train::TaskArgs& args, const char* key) {
  auto it = args.options.find(key);
  if (it == args.options.end()) return false;
  if (it->second == "true" || it->second == "1") return true;
  if (it->second == "false" || it->second == "0") return false;
  return absl::InvalidArgumentError(absl::StrCat(
      "--task-option ", key, "=", it->second, ": want true or false"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<GptTask>> GptTask::Create(
    const train::TaskArgs& args) {
  for (const auto& [key, value] : args.options) {
    if (key != kTieEmbeddings) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--task-option ", key, ": the GPT knows only ", kTieEmbeddings));
    }
  }
  HSDP_ASSIGN_OR_RETURN(GptConfig config,
                        ResolveGptConfig(args.model, args.dims));
  if (args.vocab_size < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--vocab-size: ", args.vocab_size, " is negative"));
  }
  if (args.vocab_size > 0) config.vocab_size = args.vocab_size;
  HSDP_ASSIGN_OR_RETURN(config.tie_embeddings,
                        BoolOption(args, kTieEmbeddings));
  HSDP_ASSIGN_OR_RETURN(
      TokenDataset data,
      TokenDataset::Open(args.data, config.vocab_size, config.seq_len));
  return std::unique_ptr<GptTask>(
      new GptTask(std::move(config), std::move(data)));
}

absl::Status GptTask::Build(const train::BuildContext& context) {
  model_ = Gpt(config_, context.seed, /*build_blocks=*/false);
  return absl::OkStatus();
}

absl::StatusOr<train::UnitSpec> GptTask::BuildUnit(int index) {
  Block block = model_->BuildBlock(index);
  return train::UnitSpec{UnitName(index + 1), {block.ptr()}};
}

void GptTask::ReleaseUnit(int index) { model_->ReleaseBlock(index); }

void GptTask::Shard(train::ShardContext& context) {
  train::ShardContext* units = &context;
  // A raw pointer: the runner is stored in the model itself.
  GptImpl* model = model_.get();
  model_->set_block_runner([units, model](int i, const at::Tensor& x) {
    Block block = model->block(i);  // by value: recompute may rerun it
    return units->Forward(i, x, [block](const at::Tensor& y) {
      return Block(block)->forward(y);
    });
  });
}

absl::StatusOr<train::Batch> GptTask::GetBatch(
    const train::BatchRequest& request) {
  TokenBatch batch =
      data_.GlobalSlice(request.seed, request.step, request.first_sample,
                        request.sample_count, config_.seq_len);
  return train::Batch{std::move(batch.tokens), std::move(batch.targets)};
}

absl::StatusOr<at::Tensor> GptTask::Loss(const train::Batch& batch) {
  return model_->Loss(batch.input, batch.target);
}

}  // namespace hsdp::models
