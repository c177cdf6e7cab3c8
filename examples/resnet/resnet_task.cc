#include "resnet_task.h"

#include <torch/torch.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "hsdp/task_util.h"

namespace resnet {
namespace {

// Largest accepted value of each shape option: an example, not a benchmark.
constexpr int64_t kMaxOption = 4096;
constexpr int64_t kTile = 3;
constexpr double kResidualInitScale = 0.1;

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

ResNetTask::ResNetTask(const ResNetConfig& config)
    : config_(config),
      textures_(torch::empty({config.classes, config.in_channels, kTile, kTile})
                    .uniform_(-1, 1, hsdp::train::NamedGenerator(0, "tiles"))),
      blocks_(static_cast<size_t>(config.blocks)) {}

absl::Status ResNetTask::Build(const hsdp::train::BuildContext& context) {
  seed_ = context.seed;
  model_ = ResNet(config_);
  hsdp::train::InitParameters(*model_, seed_);  // the stem and the head
  return absl::OkStatus();
}

absl::StatusOr<hsdp::train::UnitSpec> ResNetTask::BuildUnit(int index) {
  ReleaseUnit(index);
  const std::string name = absl::StrCat("blocks.", index);
  blocks_.at(index) =
      hsdp::train::Unit<ResidualBlockImpl>(model_->blocks().register_module(
          std::to_string(index), std::make_shared<ResidualBlockImpl>(
                                     config_.channels, config_.groups)));
  // The values InitParameters(*model_, seed_) would give it in a whole model,
  // but the residual branch starts small: each block starts near the identity.
  hsdp::train::InitParameters(*blocks_[index], seed_, name);
  torch::NoGradGuard no_grad;
  blocks_[index]->named_parameters()["conv2.weight"].mul_(kResidualInitScale);
  return blocks_[index].Spec(name);
}

void ResNetTask::ReleaseUnit(int index) {
  if (blocks_.at(index).is_empty()) return;
  model_->blocks().unregister_module(std::to_string(index));
  blocks_[index] = hsdp::train::Unit<ResidualBlockImpl>();
}

absl::StatusOr<hsdp::train::Batch> ResNetTask::GetBatch(
    const hsdp::train::BatchRequest& r) {
  const int64_t size = config_.image_size;
  const int64_t tiles = size / kTile + 2;  // covers the image at any offset
  std::vector<at::Tensor> images;
  at::Tensor labels = torch::empty({r.sample_count}, torch::kLong);
  for (int64_t i = 0; i < r.sample_count; ++i) {
    at::Generator gen =
        hsdp::train::SampleGenerator(r.seed, r.step, r.first_sample + i);
    const int64_t label =
        torch::randint(config_.classes, {1}, gen, torch::kLong).item<int64_t>();
    const at::Tensor offset = torch::randint(kTile, {2}, gen, torch::kLong);
    at::Tensor texture = textures_[label]
                             .repeat({1, tiles, tiles})
                             .narrow(1, offset[0].item<int64_t>(), size)
                             .narrow(2, offset[1].item<int64_t>(), size);
    images.push_back(texture + torch::empty_like(texture).uniform_(-1, 1, gen));
    labels[i] = label;
  }
  return hsdp::train::Batch{torch::stack(images), labels};
}

absl::StatusOr<at::Tensor> ResNetTask::Loss(const hsdp::train::Batch& batch) {
  at::Tensor x = model_->Stem(batch.input);
  for (const auto& block : blocks_) x = block(x);  // enters the block's unit
  return torch::nn::functional::cross_entropy(model_->Head(x), batch.target);
}

}  // namespace resnet
