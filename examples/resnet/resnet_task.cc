#include "resnet_task.h"

#include <torch/nn/functional/loss.h>

#include <map>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace resnet {
namespace {

// Largest accepted value of each shape option: an example, not a benchmark.
constexpr int64_t kMaxOption = 4096;

absl::Status ReadOption(const std::map<std::string, std::string>& options,
                        const std::string& key, int64_t* value) {
  auto it = options.find(key);
  if (it == options.end()) return absl::OkStatus();
  if (!absl::SimpleAtoi(it->second, value) || *value <= 0 ||
      *value > kMaxOption) {
    return absl::InvalidArgumentError(
        absl::StrCat("--task-option ", key, "=", it->second,
                     ": want an integer in [1, ", kMaxOption, "]"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<ResNetTask>> ResNetTask::Create(
    const hsdp::train::TaskArgs& args) {
  if (!args.model.empty() && args.model != kModelName) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--model ", args.model, ": this worker trains only ", kModelName));
  }
  if (!args.data.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--data ", args.data,
                     ": the resnet example trains on synthetic images"));
  }
  if (!args.dims.empty()) {
    return absl::InvalidArgumentError(
        "--dims: the resnet example takes its shape from --task-option");
  }
  ResNetConfig config;
  const std::map<std::string, int64_t*> known = {
      {"channels", &config.channels},
      {"blocks", &config.blocks},
      {"image_size", &config.image_size},
      {"classes", &config.classes},
      {"groups", &config.groups}};
  for (const auto& [key, value] : args.options) {
    auto it = known.find(key);
    if (it == known.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--task-option ", key,
                       ": the resnet example knows channels, blocks, "
                       "image_size, classes and groups"));
    }
    if (absl::Status s = ReadOption(args.options, key, it->second); !s.ok()) {
      return s;
    }
  }
  if (config.channels % config.groups != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--task-option groups=", config.groups,
                     ": must divide channels=", config.channels));
  }
  return std::unique_ptr<ResNetTask>(new ResNetTask(config));
}

absl::Status ResNetTask::Build(const hsdp::train::BuildContext& context) {
  model_ = ResNet(config_, context.seed, /*build_blocks=*/false);
  return absl::OkStatus();
}

absl::StatusOr<hsdp::train::UnitSpec> ResNetTask::BuildUnit(int index) {
  blocks_.at(index) =
      hsdp::train::Unit<ResidualBlockImpl>(model_->BuildBlock(index).ptr());
  return blocks_[index].Spec(absl::StrCat("blocks.", index));
}

void ResNetTask::ReleaseUnit(int index) {
  model_->ReleaseBlock(index);
  blocks_.at(index) = hsdp::train::Unit<ResidualBlockImpl>();
}

absl::StatusOr<hsdp::train::Batch> ResNetTask::GetBatch(
    const hsdp::train::BatchRequest& request) {
  ImageBatch batch =
      data_.Slice(request.seed, request.step, request.first, request.count);
  return hsdp::train::Batch{std::move(batch.images), std::move(batch.labels)};
}

absl::StatusOr<at::Tensor> ResNetTask::Loss(const hsdp::train::Batch& batch) {
  at::Tensor x = model_->Stem(batch.input);
  for (const auto& block : blocks_) x = block(x);
  return torch::nn::functional::cross_entropy(model_->Head(x), batch.target);
}

}  // namespace resnet
