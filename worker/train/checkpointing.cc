#include "worker/train/checkpointing.h"

#include <glog/logging.h>
#include <torch/serialize/output-archive.h>

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_util.h"
#include "worker/ckpt/shard_io.h"
#include "worker/ckpt/state.h"
#include "worker/train/worker_mesh.h"

namespace hsdp::train {

std::vector<ckpt::LocalTensor> ParamTensors(const fsdp::Engine& engine,
                                            CheckpointUse use) {
  std::vector<ckpt::LocalTensor> out;
  for (auto& [name, layout] : fsdp::ShardLayouts(engine)) {
    if (layout.replicated && use == CheckpointUse::kSave &&
        layout.shard_rank != 0)
      continue;
    out.push_back(ckpt::LocalTensor{name, layout.local, layout.global_shape,
                                    layout.row_offset, layout.shard_dim});
  }
  return out;
}
namespace {

std::string MeshName(int replicate, int shard) {
  return absl::StrCat(replicate, "x", shard);
}

}  // namespace

Checkpointing::Checkpointing(CheckpointingOptions options,
                             comm::DeviceMesh& mesh, const c10::Device& device)
    : options_(std::move(options)), mesh_(mesh), device_(device) {
  if (!enabled()) return;
  ckpt::SaverOptions so;
  so.root = options_.root;
  so.replicate_rank = mesh_.replicate().rank();
  so.replicate_size = mesh_.replicate().size();
  so.shard_rank = mesh_.shard().rank();
  so.shard_size = mesh_.shard().size();
  so.async = options_.async;
  so.keep = options_.keep;
  saver_ = std::make_unique<ckpt::CheckpointSaver>(so);
}

absl::StatusOr<int64_t> Checkpointing::Resume(
    fsdp::Engine& engine, torch::optim::Optimizer& optimizer) {
  const int rank = mesh_.rank();
  if (!enabled()) {
    LOG(INFO) << "rank " << rank << " started fresh: --checkpoint-dir not set";
    return 0;
  }
  HSDP_ASSIGN_OR_RETURN(const ckpt::FoundCheckpoint found,
                        ckpt::FindLatestCheckpoint(options_.root));
  for (const std::string& why : found.skipped) {
    LOG(WARNING) << "rank " << rank << " passed over checkpoint " << why;
  }
  HSDP_RETURN_IF_ERROR(CheckSameOnAllRanks(
      mesh_, static_cast<double>(found.step), device_,
      absl::StrCat("the checkpoint to resume from in ", options_.root,
                   "; do all ranks see the same --checkpoint-dir?")));
  if (found.step < 0) {
    LOG(INFO) << "rank " << rank << " started fresh: "
              << (found.skipped.empty()
                      ? absl::StrCat("no checkpoint in ", options_.root)
                      : absl::StrCat("no complete checkpoint in ",
                                     options_.root, " (", found.skipped.size(),
                                     " incomplete passed over)"));
    return 0;
  }
  // Loading is local: agree on the outcome so a rank that failed does not
  // leave the others waiting in the first collective of training.
  absl::StatusOr<ckpt::Metadata> metadata = ckpt::ReadMetadata(found.dir);
  ckpt::ReadStats stats;
  absl::Status loaded = metadata.status();
  if (loaded.ok()) {
    const std::vector<ckpt::LocalTensor> params =
        ParamTensors(engine, CheckpointUse::kLoad);
    loaded = ckpt::CheckModel(*metadata, found.dir, options_.model_name, params,
                              optimizer);
    if (loaded.ok()) {
      loaded =
          ckpt::LoadShards(found.dir, *metadata, params, optimizer, &stats);
    }
  }
  const absl::Status agreed =
      CheckSameOnAllRanks(mesh_, loaded.ok() ? 1.0 : 0.0, device_,
                          absl::StrCat("loading ", found.dir));
  if (!loaded.ok()) {
    return absl::Status(
        loaded.code(), absl::StrCat("refusing checkpoint: ", loaded.message()));
  }
  if (!agreed.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("another rank could not load checkpoint ", found.dir,
                     " (see its log)"));
  }
  const std::string saved = MeshName(metadata->replicate, metadata->shard);
  const std::string now =
      MeshName(mesh_.replicate().size(), mesh_.shard().size());
  read_stats_ = stats;
  LOG(INFO) << "rank " << rank << " resumed from step " << metadata->step
            << (saved == now ? absl::StrCat(" (same mesh ", now, ")")
                             : absl::StrCat(" (resharded from ", saved, " to ",
                                            now, ")"))
            << " of " << found.dir << "; next step " << metadata->next_step
            << ", samples consumed " << metadata->samples_consumed << "; read "
            << stats.bytes_read << " bytes for " << stats.bytes_needed
            << " needed";
  return metadata->next_step;
}

absl::Status Checkpointing::Save(int64_t step, fsdp::Engine& engine,
                                 torch::optim::Optimizer& optimizer,
                                 int64_t policy_version,
                                 int64_t global_batch_samples) {
  HSDP_RETURN_IF_ERROR(saver_->Prepare(step));
  // Also the barrier Prepare needs: no rank writes before every rank cleared
  // what an earlier run left of this step.
  HSDP_RETURN_IF_ERROR(CheckSameOnAllRanks(mesh_, static_cast<double>(step),
                                           device_, "the checkpoint step"));
  std::vector<ckpt::LocalTensor> tensors =
      ParamTensors(engine, CheckpointUse::kSave);
  std::map<std::string, int64_t> steps;
  HSDP_ASSIGN_OR_RETURN(std::vector<ckpt::LocalTensor> state,
                        ckpt::OptimizerShards(optimizer, tensors, &steps));
  tensors.insert(tensors.end(), state.begin(), state.end());
  ckpt::Metadata base;
  base.next_step = step + 1;
  base.global_batch_samples = global_batch_samples;
  // The runner's data stream is indexed by (step, sample): every step so far
  // consumed one global batch.
  base.samples_consumed = (step + 1) * global_batch_samples;
  base.seed = options_.seed;
  base.model_name = options_.model_name;
  base.model_version = options_.model_version;
  base.policy_version = policy_version;
  base.optimizer = ckpt::OptimizerType(optimizer);
  base.job = options_.job;
  return saver_->Save(step, tensors, std::move(steps), std::move(base));
}

absl::Status Checkpointing::Finish() {
  return saver_ == nullptr ? absl::OkStatus() : saver_->Wait();
}

absl::Status SaveParams(
    const std::vector<std::pair<std::string, at::Tensor>>& params,
    const std::string& path) {
  torch::serialize::OutputArchive archive;
  for (const auto& [name, t] : params) archive.write(name, t.detach().cpu());
  archive.save_to(path);
  return absl::OkStatus();
}

}  // namespace hsdp::train
