// Autograd plumbing of the engine (LibTorch has no module hooks):
//  - pre-backward: an identity Function on a unit's outputs; its backward
//    unshards the unit and starts backward prefetches before the unit's own
//    backward runs;
//  - post-backward: an identity Function on a unit's inputs; its backward runs
//    once the unit's weight grads are accumulated and issues the
//    reduce-scatter;
//  - end of backward: a callback queued on the autograd engine for units whose
//    post-backward did not fire (their inputs need no grad) and to wait for
//    outstanding reductions;
//  - recompute: a Function that runs its body without grad and reruns it in
//    backward.
// Only tensors that require grad pass through the identity Functions; others
// are returned as is. Thread-compatible (see fully_shard.h).
#ifndef HSDP_WORKER_FSDP_HOOKS_H_
#define HSDP_WORKER_FSDP_HOOKS_H_

#include <ATen/core/Tensor.h>

#include <vector>

#include "hsdp/fully_shard.h"

namespace hsdp::fsdp {

class UnitGroup;
class EngineCore;

std::vector<at::Tensor> AttachPreBackward(UnitGroup* unit,
                                          std::vector<at::Tensor> outputs);
std::vector<at::Tensor> AttachPostBackward(UnitGroup* unit,
                                           std::vector<at::Tensor> inputs);
// Must be called while the autograd engine runs a backward (from a hook).
void QueueEndOfBackwardCallback(EngineCore* core);
// fsdp::Recompute: `fn` (which may enter units) without saved activations,
// rerun in backward.
at::Tensor RecomputeApply(EngineCore* core, const TensorFn& fn,
                          const at::Tensor& input);

}  // namespace hsdp::fsdp

#endif  // HSDP_WORKER_FSDP_HOOKS_H_
