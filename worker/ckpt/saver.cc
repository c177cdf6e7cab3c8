#include "worker/ckpt/saver.h"

#include <ATen/ATen.h>
#include <glog/logging.h>

#include <filesystem>
#include <utility>

#include "absl/strings/str_cat.h"

namespace hsdp::ckpt {
namespace {

namespace fs = std::filesystem;

}  // namespace

CheckpointSaver::CheckpointSaver(SaverOptions options)
    : options_(std::move(options)) {}

CheckpointSaver::~CheckpointSaver() {
  cancelled_ = true;
  const absl::Status s = Wait();
  if (!s.ok()) LOG(ERROR) << s;
}

std::string CheckpointSaver::StepDir(int64_t step) const {
  return absl::StrCat(options_.root, "/", StepDirName(step));
}

absl::Status CheckpointSaver::Prepare(int64_t step) {
  if (!writes()) return absl::OkStatus();
  const std::string dir = StepDir(step);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) {
    return absl::PermissionDeniedError(absl::StrCat(
        "cannot create checkpoint directory ", dir, ": ", ec.message()));
  }
  if (publishes()) fs::remove(absl::StrCat(dir, "/", kMetadataFile), ec);
  fs::remove(absl::StrCat(dir, "/",
                          ShardIndexName(ShardFileName(options_.shard_rank,
                                                       options_.shard_size))),
             ec);
  return absl::OkStatus();
}

absl::Status CheckpointSaver::Save(
    int64_t step, const std::vector<LocalTensor>& tensors,
    std::map<std::string, int64_t> optimizer_steps, Metadata base) {
  absl::Status previous = Wait();
  if (!previous.ok()) return previous;
  if (!writes()) return absl::OkStatus();
  // The snapshot: training may change the originals as soon as we return.
  std::vector<LocalTensor> host;
  host.reserve(tensors.size());
  {
    at::NoGradGuard no_grad;
    for (const LocalTensor& t : tensors) {
      host.push_back(LocalTensor{t.name,
                                 t.tensor.detach()
                                     .to(at::kCPU, /*non_blocking=*/false,
                                         /*copy=*/true)
                                     .contiguous(),
                                 t.global_shape, t.row_offset, t.shard_dim});
    }
  }
  if (!options_.async) {
    return Write(step, host, optimizer_steps, std::move(base));
  }
  thread_ = std::thread([this, step, host = std::move(host),
                         optimizer_steps = std::move(optimizer_steps),
                         base = std::move(base)]() mutable {
    absl::Status s = Write(step, host, optimizer_steps, std::move(base));
    absl::MutexLock lock(&mu_);
    status_ = s;
  });
  return absl::OkStatus();
}

absl::Status CheckpointSaver::Wait() {
  if (thread_.joinable()) thread_.join();
  absl::MutexLock lock(&mu_);
  absl::Status s = status_;
  status_ = absl::OkStatus();
  return s;
}

absl::Status CheckpointSaver::Write(
    int64_t step, const std::vector<LocalTensor>& host,
    const std::map<std::string, int64_t>& optimizer_steps, Metadata base) {
  const std::string dir = StepDir(step);
  absl::StatusOr<ShardIndex> index = WriteShardFile(
      dir, ShardFileName(options_.shard_rank, options_.shard_size), host,
      optimizer_steps);
  if (!index.ok()) return index.status();
  if (!publishes()) return absl::OkStatus();
  base.step = step;
  base.replicate = options_.replicate_size;
  base.shard = options_.shard_size;
  absl::Status s = PublishMetadata(dir, std::move(base), options_.shard_size,
                                   options_.publish_timeout, &cancelled_);
  if (!s.ok()) return s;
  DeleteOld(step);
  return absl::OkStatus();
}

void CheckpointSaver::DeleteOld(int64_t newest) {
  std::error_code ec;
  std::vector<int64_t> complete = CompleteCheckpointSteps(options_.root);
  std::vector<int64_t> doomed;
  if (options_.keep > 0) {
    int kept = 0;
    for (auto it = complete.rbegin(); it != complete.rend(); ++it) {
      if (*it > newest) continue;
      if (kept < options_.keep) {
        ++kept;
      } else {
        doomed.push_back(*it);
      }
    }
  }
  for (int64_t step : doomed) {
    const std::string dir = StepDir(step);
    // Metadata first: a half-deleted directory must not look complete.
    fs::remove(absl::StrCat(dir, "/", kMetadataFile), ec);
    fs::remove_all(dir, ec);
    if (ec)
      LOG(WARNING) << "could not delete old checkpoint " << dir << ": "
                   << ec.message();
  }
}

}  // namespace hsdp::ckpt
