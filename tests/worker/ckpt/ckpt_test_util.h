// Test support for checkpoints: a sharded trainer over the fsdp test model
// (parameters whose dim 0 divides neither 3 nor 4), saving and loading through
// worker/ckpt as the runner does, and the global state assembled from shards.
#ifndef HSDP_TESTS_WORKER_CKPT_CKPT_TEST_UTIL_H_
#define HSDP_TESTS_WORKER_CKPT_CKPT_TEST_UTIL_H_

#include <torch/optim/adamw.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "tests/worker/fsdp/fsdp_test_util.h"
#include "worker/ckpt/saver.h"
#include "worker/ckpt/shard_io.h"

namespace hsdp::ckpt::testing {

inline constexpr char kModelName[] = "tiny-transformer";

// One rank's model, engine and AdamW.
struct Trainer {
  Trainer(fsdp::testing::RankContext& ctx, const fsdp::testing::StateDict& init,
          const fsdp::testing::RunConfig& config);
  // One step on this rank's slice of the global batch `global_batch`.
  void Step(int step, int global_batch);
  // This rank's params and optimizer state, as a checkpoint sees them.
  std::vector<LocalTensor> Params() const;
  std::vector<LocalTensor> State(std::map<std::string, int64_t>* steps);

  fsdp::testing::RankContext* ctx;
  fsdp::testing::RunConfig config;
  fsdp::testing::TinyTransformer model{nullptr};
  std::unique_ptr<fsdp::Engine> engine;
  std::unique_ptr<torch::optim::AdamW> optimizer;
  hsdp::v1::StepSchedule schedule;
};

// A reusable barrier for rank threads (the runner uses a collective).
class RankBarrier {
 public:
  explicit RankBarrier(int ranks) : ranks_(ranks) {}
  void Wait();

 private:
  absl::Mutex mu_;
  const int ranks_;
  int waiting_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
};

// Saves `trainer` at `step` (all ranks call it; `barrier` is shared by the
// ranks).
absl::Status SaveOnRank(Trainer& trainer, CheckpointSaver& saver, int64_t step,
                        RankBarrier& barrier);
SaverOptions SaverOptionsFor(const fsdp::testing::RankContext& ctx,
                             const std::string& root, bool async, int keep);

// Finds the newest checkpoint under root and loads it into `trainer`.
absl::Status LoadOnRank(Trainer& trainer, const std::string& root,
                        ReadStats* stats = nullptr);

// Full tensors by name, filled row range by row range from the ranks.
class GlobalState {
 public:
  void Add(const std::vector<LocalTensor>& tensors);
  std::map<std::string, at::Tensor> tensors() const;

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, at::Tensor> tensors_ ABSL_GUARDED_BY(mu_);
};

// A fresh directory under the test temp dir, private to this process.
std::string TempDir(const std::string& name);

}  // namespace hsdp::ckpt::testing

#endif  // HSDP_TESTS_WORKER_CKPT_CKPT_TEST_UTIL_H_
