// Per-rank checkpoint files: DIR/step-NNNNNNNN/rank-R-of-W.pt, one LibTorch
// archive per rank holding its padded parameter shards and its optimizer state,
// written to a temporary name and renamed (a file with the final name is
// complete). They load only on the same mesh.
#ifndef HSDP_WORKER_TRAIN_RANK_CHECKPOINT_H_
#define HSDP_WORKER_TRAIN_RANK_CHECKPOINT_H_

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace hsdp::train {

std::string RankCheckpointFile(const std::string& root, int64_t step, int rank,
                               int world);

// Newest step under `root` for which every rank of `world` wrote its file; -1
// when none.
int64_t LatestCompleteRankCheckpoint(const std::string& root, int world);

absl::Status SaveRankCheckpoint(const std::string& root, int64_t step, int rank,
                                int world,
                                const std::vector<at::Tensor>& shards,
                                torch::optim::Optimizer& optimizer);

// Copies the saved shards into `shards` (never replacing them: the engine
// keeps views) and loads the optimizer state. FAILED_PRECONDITION on another
// world size or shard shape.
absl::Status LoadRankCheckpoint(const std::string& root, int64_t step, int rank,
                                int world,
                                const std::vector<at::Tensor>& shards,
                                torch::optim::Optimizer& optimizer);

}  // namespace hsdp::train

#endif  // HSDP_WORKER_TRAIN_RANK_CHECKPOINT_H_
