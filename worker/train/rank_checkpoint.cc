#include "worker/train/rank_checkpoint.h"

#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>
#include <torch/utils.h>

#include <cstring>
#include <filesystem>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace hsdp::train {
namespace {

namespace fs = std::filesystem;

constexpr char kStepDirPrefix[] = "step-";

std::string StepDir(const std::string& root, int64_t step) {
  return absl::StrFormat("%s/%s%08d", root, kStepDirPrefix, step);
}

}  // namespace

std::string RankCheckpointFile(const std::string& root, int64_t step, int rank,
                               int world) {
  return absl::StrFormat("%s/rank-%d-of-%d.pt", StepDir(root, step), rank,
                         world);
}

int64_t LatestCompleteRankCheckpoint(const std::string& root, int world) {
  std::error_code ec;
  if (root.empty() || !fs::is_directory(root, ec)) return -1;
  int64_t best = -1;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const std::string name = entry.path().filename().string();
    int64_t step;
    if (!absl::StartsWith(name, kStepDirPrefix) ||
        !absl::SimpleAtoi(name.substr(std::strlen(kStepDirPrefix)), &step) ||
        step <= best) {
      continue;
    }
    bool complete = true;
    for (int r = 0; r < world && complete; ++r) {
      complete = fs::exists(RankCheckpointFile(root, step, r, world), ec);
    }
    if (complete) best = step;
  }
  return best;
}

absl::Status SaveRankCheckpoint(const std::string& root, int64_t step, int rank,
                                int world,
                                const std::vector<at::Tensor>& shards,
                                torch::optim::Optimizer& optimizer) {
  std::error_code ec;
  fs::create_directories(StepDir(root, step), ec);
  if (ec) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot create checkpoint dir ", StepDir(root, step), ": ",
                     ec.message()));
  }
  torch::serialize::OutputArchive archive;
  archive.write("step", c10::IValue(step));
  archive.write("world_size", c10::IValue(static_cast<int64_t>(world)));
  for (size_t i = 0; i < shards.size(); ++i) {
    archive.write(absl::StrCat("shard.", i), shards[i].detach());
  }
  torch::serialize::OutputArchive optim;
  optimizer.save(optim);
  archive.write("optimizer", optim);
  const std::string final_path = RankCheckpointFile(root, step, rank, world);
  const std::string tmp_path = final_path + ".tmp";
  archive.save_to(tmp_path);
  // Rename is atomic: a file with the final name is always complete.
  fs::rename(tmp_path, final_path, ec);
  if (ec) {
    return absl::InternalError(
        absl::StrCat("rename ", tmp_path, ": ", ec.message()));
  }
  return absl::OkStatus();
}

absl::Status LoadRankCheckpoint(const std::string& root, int64_t step, int rank,
                                int world,
                                const std::vector<at::Tensor>& shards,
                                torch::optim::Optimizer& optimizer) {
  const std::string path = RankCheckpointFile(root, step, rank, world);
  torch::serialize::InputArchive archive;
  archive.load_from(path);
  c10::IValue saved_world;
  archive.read("world_size", saved_world);
  if (saved_world.toInt() != world) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint ", path, " is for world size ",
                     saved_world.toInt(), ", this job has ", world));
  }
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < shards.size(); ++i) {
    at::Tensor saved;
    archive.read(absl::StrCat("shard.", i), saved);
    if (!saved.sizes().equals(shards[i].sizes())) {
      return absl::FailedPreconditionError(
          absl::StrCat("checkpoint ", path, " shard ", i, " has shape ",
                       c10::str(saved.sizes()), ", the model's is ",
                       c10::str(shards[i].sizes())));
    }
    shards[i].copy_(saved);
  }
  torch::serialize::InputArchive optim;
  archive.read("optimizer", optim);
  optimizer.load(optim);
  return absl::OkStatus();
}

}  // namespace hsdp::train
