#include "worker/models/gpt_setup.h"

#include <utility>

namespace hsdp::models {

absl::StatusOr<std::unique_ptr<fsdp::Engine>> ShardGpt(
    Gpt& model, fsdp::MeshComms comms, fsdp::EngineOptions options) {
  absl::StatusOr<std::unique_ptr<fsdp::Engine>> engine =
      fsdp::Engine::Create(model.ptr(), comms, std::move(options));
  if (!engine.ok()) return engine.status();
  for (int i = 0; i < model->num_blocks(); ++i) {
    absl::StatusOr<int> unit =
        (*engine)->FullyShard({model->block(i).ptr()}, UnitName(i + 1));
    if (!unit.ok()) return unit.status();
  }
  if (absl::Status s = (*engine)->FullyShardRoot(); !s.ok()) return s;
  // Raw pointers: the runner is stored in the model itself, and the engine
  // stays where it is when its unique_ptr moves.
  fsdp::Engine* e = engine->get();
  GptImpl* gpt = model.get();
  model->set_block_runner([e, gpt](int i, const at::Tensor& x) {
    Block block = gpt->block(i);  // by value: recompute may rerun it
    return e->Unit(i + 1).Forward(
        x, [block](const at::Tensor& y) { return Block(block)->forward(y); });
  });
  return engine;
}

}  // namespace hsdp::models
