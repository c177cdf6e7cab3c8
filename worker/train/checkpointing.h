// The runner's side of checkpoints (worker/ckpt, format v1): deciding where a
// run starts — resumed from the newest complete checkpoint in --checkpoint-dir
// on whatever mesh saved it, or fresh, said in one log line either way — and
// saving on the steps the schedule asks for, in the background unless
// --sync-checkpoint.
//
// Thread-compatible: owned by the training thread; the saver's background
// thread is internal to it.
#ifndef HSDP_WORKER_TRAIN_CHECKPOINTING_H_
#define HSDP_WORKER_TRAIN_CHECKPOINTING_H_

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "hsdp/device_mesh.h"
#include "hsdp/fully_shard.h"
#include "worker/ckpt/saver.h"

namespace hsdp::train {

// What a checkpoint's parameter tensors are taken for.
enum class CheckpointUse { kSave, kLoad };

// The engine's parameter shards (fsdp::ShardLayouts: the optimizer's own
// leaves, no copy) as checkpoint tensors. To save, a replicated parameter is
// taken from the first rank of the shard group only, so the checkpoint holds
// each row once; to load, every rank reads it whole.
std::vector<ckpt::LocalTensor> ParamTensors(const fsdp::Engine& engine,
                                            CheckpointUse use);

struct CheckpointingOptions {
  std::string root;  // empty: no checkpoints
  bool async = true;
  int keep = 0;  // newest checkpoints kept; 0: all
  std::string model_name;
  std::string model_version;
  uint64_t seed = 0;
  // The job's settings, recorded in the metadata for people.
  std::map<std::string, std::string> job;
};

class Checkpointing {
 public:
  Checkpointing(CheckpointingOptions options, comm::DeviceMesh& mesh,
                const c10::Device& device);
  Checkpointing(const Checkpointing&) = delete;
  Checkpointing& operator=(const Checkpointing&) = delete;

  // The first step to run: after loading the newest complete checkpoint into
  // the shards and the optimizer (any saved mesh), or 0. Logs "resumed from
  // step N (resharded from RxS to R'xS')" or "started fresh: <why>". A
  // collective: every rank calls it and they agree on the step; a bad
  // checkpoint is an error on every rank, never skipped in silence.
  absl::StatusOr<int64_t> Resume(fsdp::Engine& engine,
                                 torch::optim::Optimizer& optimizer);

  // Saves `step` (a collective: every rank calls it). Returns once the shards
  // are copied to host memory when async; an earlier background save's error
  // surfaces here.
  absl::Status Save(int64_t step, fsdp::Engine& engine,
                    torch::optim::Optimizer& optimizer, int64_t policy_version,
                    int64_t global_batch_samples);

  // Waits for the save in flight; its error.
  absl::Status Finish();

  bool enabled() const { return !options_.root.empty(); }
  // What the last Resume read on this rank.
  const ckpt::ReadStats& read_stats() const { return read_stats_; }

 private:
  CheckpointingOptions options_;
  comm::DeviceMesh& mesh_;
  c10::Device device_;
  std::unique_ptr<ckpt::CheckpointSaver> saver_;
  ckpt::ReadStats read_stats_;
};

// A LibTorch archive of named tensors (on the CPU): --final-params, the
// full parameters at the end of a run (not a checkpoint).
absl::Status SaveParams(
    const std::vector<std::pair<std::string, at::Tensor>>& params,
    const std::string& path);

}  // namespace hsdp::train

#endif  // HSDP_WORKER_TRAIN_CHECKPOINTING_H_
