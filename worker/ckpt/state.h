// What of a training rank goes into a checkpoint: the engine's parameter
// shards (the optimizer's leaves: this rank's valid rows of each parameter,
// as LocalTensors that train::ParamTensors makes from the engine's layout) and
// the optimizer's per-parameter state, which has the same rows.
// Loading creates the optimizer state a fresh optimizer lacks, then fills
// parameters and state from any mesh's files.
//
// Thread-compatible: call on the training thread, between steps.
#ifndef HSDP_WORKER_CKPT_STATE_H_
#define HSDP_WORKER_CKPT_STATE_H_

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/ckpt/format.h"
#include "worker/ckpt/shard_io.h"

namespace hsdp::ckpt {

// "adamw", "adam", "sgd", or "none" for others (their state is not saved).
std::string OptimizerType(const torch::optim::Optimizer& optimizer);

// The optimizer's state tensors for `params` (those that have state yet), and
// each such parameter's step counter in `steps`.
absl::StatusOr<std::vector<LocalTensor>> OptimizerShards(
    torch::optim::Optimizer& optimizer, const std::vector<LocalTensor>& params,
    std::map<std::string, int64_t>* steps);

// Every parameter's name matches one in the checkpoint with the same global
// shape and dtype, and the model is the same: else one line naming the
// metadata file and the tensor.
absl::Status CheckModel(const Metadata& metadata, const std::string& step_dir,
                        const std::string& model_name,
                        const std::vector<LocalTensor>& params,
                        const torch::optim::Optimizer& optimizer);

// Creates the state the checkpoint has for `params` where the optimizer has
// none, sets step counters, and reads parameters and state from `step_dir`
// (only the rows of this rank's shards).
absl::Status LoadShards(const std::string& step_dir, const Metadata& metadata,
                        const std::vector<LocalTensor>& params,
                        torch::optim::Optimizer& optimizer,
                        ReadStats* stats = nullptr);

// One parameter's optimizer state: whether it has any yet, its step counter
// (Adam/AdamW; 0 otherwise), whether it keeps max_exp_avg_sq, and its state
// tensors (the optimizer's own, in a fixed order per optimizer type).
struct ParamState {
  bool present = false;
  int64_t step = 0;
  bool amsgrad = false;
  std::vector<at::Tensor> tensors;
};

// The state of each of `params`, in order.
std::vector<ParamState> ParamStates(torch::optim::Optimizer& optimizer,
                                    const std::vector<at::Tensor>& params);

// Replaces `param`'s state by a fresh one shaped like `like` (zeros, its step
// counter and amsgrad flag; none when `like` has none), so that ParamStates
// then lists the same tensors as on the rank `like` came from.
void SetParamState(torch::optim::Optimizer& optimizer, const at::Tensor& param,
                   const ParamState& like);

}  // namespace hsdp::ckpt

#endif  // HSDP_WORKER_CKPT_STATE_H_
