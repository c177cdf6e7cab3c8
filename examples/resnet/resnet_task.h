// The ResNet (resnet.h) on synthetic images as an hsdp Task: the stem and the
// head are the root unit, each residual block is a unit ("blocks.0",
// "blocks.1", ...), constructed only in BuildUnit(i), so a rank holds one
// block's full parameters at a time.
//
// The data: class k is a fixed random 3x3 texture tiled over the image; a
// sample is its class's texture at a random offset plus noise, drawn from
// hsdp::train::SampleGenerator(seed, step, index) alone.
//
// Settings, as --task-option NAME=VALUE (Options() declares their types,
// defaults and ranges; resnet-worker --help lists them): channels (8), blocks
// (3), image_size (8), classes (4), groups (2, GroupNorm groups; must divide
// channels).
#ifndef HSDP_EXAMPLES_RESNET_RESNET_TASK_H_
#define HSDP_EXAMPLES_RESNET_RESNET_TASK_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "hsdp/task.h"
#include "hsdp/task_options.h"
#include "hsdp/unit.h"
#include "resnet.h"

namespace resnet {

inline constexpr char kModelName[] = "resnet";

// Thread-compatible (see hsdp::train::Task).
class ResNetTask : public hsdp::train::Task {
 public:
  static hsdp::train::TaskOptionSpec Options();
  // What resnet-worker runs (WorkerMain): the name, help, options and Create.
  static hsdp::train::TaskDefinition Definition();
  // INVALID_ARGUMENT naming the option when groups does not divide channels.
  static absl::StatusOr<std::unique_ptr<ResNetTask>> Create(
      const hsdp::train::TaskOptionValues& options);
  // Options() parses `options` first (in-process callers and tests).
  static absl::StatusOr<std::unique_ptr<ResNetTask>> Create(
      const std::map<std::string, std::string>& options);

  std::string Name() const override { return kModelName; }
  int Version() const override { return 2; }
  absl::Status Build(const hsdp::train::BuildContext& context) override;
  std::shared_ptr<torch::nn::Module> Model() override { return model_.ptr(); }
  int NumUnits() const override { return static_cast<int>(config_.blocks); }
  absl::StatusOr<hsdp::train::UnitSpec> BuildUnit(int index) override;
  void ReleaseUnit(int index) override;
  absl::StatusOr<hsdp::train::Batch> GetBatch(
      const hsdp::train::BatchRequest& request) override;
  absl::StatusOr<at::Tensor> Loss(const hsdp::train::Batch& batch) override;

 private:
  explicit ResNetTask(const ResNetConfig& config);

  const ResNetConfig config_;
  // classes x in_channels x 3 x 3: the same for every seed.
  const at::Tensor textures_;
  uint64_t seed_ = 0;
  ResNet model_{nullptr};
  // Calling a block enters its unit; empty while the block is released.
  std::vector<hsdp::train::Unit<ResidualBlockImpl>> blocks_;
};

}  // namespace resnet

#endif  // HSDP_EXAMPLES_RESNET_RESNET_TASK_H_
