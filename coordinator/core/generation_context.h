// The generation a schedule read belongs to: what sealing a step needs of it.
#ifndef HSDP_COORDINATOR_CORE_GENERATION_CONTEXT_H_
#define HSDP_COORDINATOR_CORE_GENERATION_CONTEXT_H_

#include <cstdint>

namespace hsdp::coordinator {

// A value; copy freely.
struct GenerationContext {
  int64_t generation = 0;
  // Ranks of the generation (replicas x shard).
  int world_size = 1;
  // Its first step (the last committed step + 1).
  int64_t start_step = 0;
};

}  // namespace hsdp::coordinator

#endif  // HSDP_COORDINATOR_CORE_GENERATION_CONTEXT_H_
