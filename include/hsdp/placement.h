// Where one parameter's elements live across a unit's shard group: sharded on
// a dim (FSDP2's Shard(dim), from its shard_placement_fn) or replicated whole
// on every rank (hyper_parallel's replicate_params). Part of the public
// engine API (fully_shard.h) and of the Task API (task.h).
//
// Plain values; thread-safe.
#ifndef HSDP_PLACEMENT_H_
#define HSDP_PLACEMENT_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

namespace hsdp::fsdp {

struct ParamPlacement {
  // The dim the parameter is sharded on; negative counts from the last dim.
  // Each rank holds ceil(size(dim) / S) slices along it, the last ranks'
  // zero-padded (the padding is never visible), as on dim 0. Use it for a
  // weight whose dim 0 is small or uneven (a [4, 4096] projection on 8
  // ranks: dim 1 splits evenly, dim 0 would leave half the ranks with
  // padding only). The gradients are the same numbers on any dim.
  int64_t shard_dim = 0;
  // Kept whole on every rank and never gathered; its gradient is all-reduced
  // over the whole mesh (DDP-style) instead of reduce-scattered. For small
  // parameters (norm scales, biases, 0-dim scalars) whose padding and
  // per-collective cost outweigh the memory sharding saves. Costs its whole
  // size (and its optimizer state) on every rank. shard_dim is then ignored.
  bool replicated = false;
};

// Chooses a parameter's placement from its fully qualified name (under the
// engine's root module) and the parameter itself; std::nullopt means the
// default, sharded on dim 0. Called once per parameter when its unit is
// sharded (and when units are described before sharding), so it must give
// the same answer on every rank.
using PlacementFn = std::function<std::optional<ParamPlacement>(
    const std::string& fqn, const at::Tensor& param)>;

}  // namespace hsdp::fsdp

#endif  // HSDP_PLACEMENT_H_
