// Sharding the built-in GPT with the engine directly, for code that drives an
// fsdp::Engine itself (tests, benchmarks) rather than running models::GptTask
// under the runner.
#ifndef HSDP_WORKER_MODELS_GPT_SETUP_H_
#define HSDP_WORKER_MODELS_GPT_SETUP_H_

#include <memory>

#include "absl/status/statusor.h"
#include "hsdp/fully_shard.h"
#include "hsdp/models/gpt.h"

namespace hsdp::models {

// Creates an engine over `model` and shards it the way the GPT task is
// sharded: one unit per block ("layers.i" is unit i + 1, in forward order),
// then the root unit for every other parameter. Installs a block runner that
// enters block i's unit around each call, so `engine->Root().Forward(tokens,
// ...)` around model->Loss or model->forward runs a sharded step.
//
// The block runner refers to the returned engine: keep the engine alive while
// the model runs, or reset the runner first (model->set_block_runner(nullptr)).
absl::StatusOr<std::unique_ptr<fsdp::Engine>> ShardGpt(
    Gpt& model, fsdp::MeshComms comms, fsdp::EngineOptions options = {});

}  // namespace hsdp::models

#endif  // HSDP_WORKER_MODELS_GPT_SETUP_H_
