// A rank's training state for its shard index — the engine's parameter shards
// and the optimizer's state of those shards — as one list of byte buffers in
// a canonical order that every replica of the shard index shares, and the
// heal that copies it from the replicas that hold it onto those that do not
// (worker/agent/ELASTIC.md, "Enter generation", step 3).
//
// Thread-compatible: call on the training thread, between steps.
#ifndef HSDP_WORKER_TRAIN_SHARD_STATE_H_
#define HSDP_WORKER_TRAIN_SHARD_STATE_H_

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "hsdp/communicator.h"
#include "worker/comm/heal.h"

namespace hsdp::train {

// The state in canonical order: for each parameter shard (engine order), the
// shard, then its optimizer state tensors. Buffers alias the tensors.
std::vector<comm::Buffer> ShardStateBuffers(
    const std::vector<at::Tensor>& params, torch::optim::Optimizer& optimizer);

// CRC32C of the concatenated ShardStateBuffers plus the step counters: equal
// on two replicas exactly when their states are bitwise equal (up to CRC
// collisions). Copies device memory to the host.
uint32_t ShardStateCrc32c(const std::vector<at::Tensor>& params,
                          torch::optim::Optimizer& optimizer);

// Collective over `group` (the replicate group of one shard index): the
// targets' parameter shards and optimizer state become bitwise equal to the
// sources'. First the layout (which parameters have optimizer state, step
// counters), so a target creates exactly the sources' state, then the bytes,
// each source sending its part to every target (comm::HealState). A rank in
// neither list takes part without moving data. The communicator's error on
// failure (the targets' state is then undefined and must be healed again).
absl::Status HealShardState(comm::Communicator& group,
                            const comm::HealRoles& roles,
                            const std::vector<at::Tensor>& params,
                            torch::optim::Optimizer& optimizer);

}  // namespace hsdp::train

#endif  // HSDP_WORKER_TRAIN_SHARD_STATE_H_
