// Saving a checkpoint from every rank of an R x S mesh: the ranks of replica 0
// each write their shard file; global rank 0 waits for all S of them and
// publishes metadata.json last. With `async`, Save copies the tensors to host
// memory and returns; a background thread writes them while training goes on.
// A rank that dies mid-write leaves no metadata, so the directory never looks
// complete. With keep > 0, rank 0 deletes older checkpoints once a newer one is
// published.
//
// Thread-safety: Prepare/Save/Wait are called from one thread (the training
// thread); the background write shares only `status_`, under `mu_`.
#ifndef HSDP_WORKER_CKPT_SAVER_H_
#define HSDP_WORKER_CKPT_SAVER_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "worker/ckpt/format.h"
#include "worker/ckpt/shard_io.h"

namespace hsdp::ckpt {

struct SaverOptions {
  std::string root;
  int replicate_rank = 0;
  int replicate_size = 1;
  int shard_rank = 0;
  int shard_size = 1;
  bool async = true;
  // Checkpoints kept (the newest ones); 0 keeps all.
  int keep = 0;
  // How long rank 0 waits for the other writers before giving up on a step.
  absl::Duration publish_timeout = absl::Minutes(10);
};

class CheckpointSaver {
 public:
  explicit CheckpointSaver(SaverOptions options);
  // Waits for the write in flight, but rank 0 stops waiting for other
  // writers (that step stays unpublished): call Wait() first to publish it.
  ~CheckpointSaver();
  CheckpointSaver(const CheckpointSaver&) = delete;
  CheckpointSaver& operator=(const CheckpointSaver&) = delete;

  // Removes what an earlier run left of `step` (rank 0: metadata.json first;
  // each writer: its own index), so stale files are never published. Call on
  // every rank, then a barrier over all ranks, then Save.
  absl::Status Prepare(int64_t step);

  // Saves `tensors` (this rank's rows) and `optimizer_steps` for `step`;
  // `base` carries the run's fields of the metadata (used on rank 0 only).
  // Waits for the previous save first and returns its error, if any.
  absl::Status Save(int64_t step, const std::vector<LocalTensor>& tensors,
                    std::map<std::string, int64_t> optimizer_steps,
                    Metadata base);

  // Waits for the save in flight; its status.
  absl::Status Wait();

  bool writes() const { return options_.replicate_rank == 0; }
  bool publishes() const {
    return options_.replicate_rank == 0 && options_.shard_rank == 0;
  }
  std::string StepDir(int64_t step) const;

 private:
  absl::Status Write(int64_t step, const std::vector<LocalTensor>& host,
                     const std::map<std::string, int64_t>& optimizer_steps,
                     Metadata base);
  void DeleteOld(int64_t newest);

  const SaverOptions options_;
  std::thread thread_;
  std::atomic<bool> cancelled_{false};
  absl::Mutex mu_;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

}  // namespace hsdp::ckpt

#endif  // HSDP_WORKER_CKPT_SAVER_H_
