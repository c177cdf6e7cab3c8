#include "resnet_task.h"

#include <torch/nn/functional/loss.h>

#include <map>
#include <utility>

#include "absl/strings/str_cat.h"

namespace resnet {
namespace {

// Largest accepted value of each shape option: an example, not a benchmark.
constexpr int64_t kMaxOption = 4096;

}  // namespace

hsdp::train::TaskOptionSpec ResNetTask::Options() {
  const ResNetConfig d;
  hsdp::train::TaskOptionSpec spec;
  spec.Int("channels", d.channels, "width of every block", 1, kMaxOption)
      .Int("blocks", d.blocks, "residual blocks (units)", 1, kMaxOption)
      .Int("image_size", d.image_size, "image height and width", 1, kMaxOption)
      .Int("classes", d.classes, "classes of the synthetic labels", 1,
           kMaxOption)
      .Int("groups", d.groups, "GroupNorm groups (must divide channels)", 1,
           kMaxOption);
  return spec;
}

hsdp::train::TaskDefinition ResNetTask::Definition() {
  return {kModelName, "A small ResNet on synthetic images.", Options(),
          [](const hsdp::train::TaskOptionValues& options)
              -> absl::StatusOr<std::unique_ptr<hsdp::train::Task>> {
            absl::StatusOr<std::unique_ptr<ResNetTask>> task = Create(options);
            if (!task.ok()) return task.status();
            return std::unique_ptr<hsdp::train::Task>(std::move(*task));
          }};
}

absl::StatusOr<std::unique_ptr<ResNetTask>> ResNetTask::Create(
    const hsdp::train::TaskOptionValues& options) {
  ResNetConfig config;
  config.channels = options.GetInt("channels");
  config.blocks = options.GetInt("blocks");
  config.image_size = options.GetInt("image_size");
  config.classes = options.GetInt("classes");
  config.groups = options.GetInt("groups");
  if (config.channels % config.groups != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--task-option groups=", config.groups,
                     ": must divide channels=", config.channels));
  }
  return std::unique_ptr<ResNetTask>(new ResNetTask(config));
}

absl::StatusOr<std::unique_ptr<ResNetTask>> ResNetTask::Create(
    const std::map<std::string, std::string>& options) {
  absl::StatusOr<hsdp::train::TaskOptionValues> values =
      Options().Parse(options);
  if (!values.ok()) return values.status();
  return Create(*values);
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
  ImageBatch batch = data_.Slice(request.seed, request.step,
                                 request.first_sample, request.sample_count);
  return hsdp::train::Batch{std::move(batch.images), std::move(batch.labels)};
}

absl::StatusOr<at::Tensor> ResNetTask::Loss(const hsdp::train::Batch& batch) {
  at::Tensor x = model_->Stem(batch.input);
  for (const auto& block : blocks_) x = block(x);
  return torch::nn::functional::cross_entropy(model_->Head(x), batch.target);
}

}  // namespace resnet
