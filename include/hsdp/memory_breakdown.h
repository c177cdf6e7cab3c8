// A rank's bytes at one moment, by category: what the memory model predicts
// (memory_model.h) and what the engine accounts (fsdp::EngineStats). A plain
// struct of its own so that the engine's public header does not pull in the
// model or the wire API. Thread-compatible.
#ifndef HSDP_MEMORY_BREAKDOWN_H_
#define HSDP_MEMORY_BREAKDOWN_H_

#include <cstdint>
#include <string>

namespace hsdp {

struct MemoryBreakdown {
  // Local parameter shards (the master copy the optimizer updates).
  int64_t shards = 0;
  int64_t optimizer_state = 0;
  // Reduced, sharded gradients (accumulated across microbatches).
  int64_t sharded_grads = 0;
  // All-gathered parameters alive (in-flight gathers included).
  int64_t unsharded_params = 0;
  // Gradients of the unsharded parameters not reduced yet.
  int64_t unsharded_grads = 0;
  // Staging and scratch buffers of the collectives.
  int64_t comm_buffers = 0;
  // Tensors autograd saved for backward.
  int64_t activations = 0;
  // A measurement's bytes beyond the categories above (temporaries, inputs);
  // never predicted.
  int64_t other = 0;

  int64_t Total() const;
  // "total 12.3 MiB = shards 1.0 + optimizer 2.0 + ..." (MiB).
  std::string ToString() const;
};

}  // namespace hsdp

#endif  // HSDP_MEMORY_BREAKDOWN_H_
