// Heal transfer: copies one shard's state onto the replicas that lack it (a
// worker that joined, or one that stood by while the others trained), reading
// from several holders at once.
//
// The state is a list of buffers — a shard's parameters and optimizer state —
// laid out alike on every replica of that shard index (same buffers, same
// sizes, same order) and identical on the holders. It is cut into one
// contiguous byte range per source (HealPart); source i sends range i to every
// target, so a target receives from all sources at once and each source sends
// 1/num_sources of the state per target. The bytes are copied as they are:
// the targets end bitwise equal to the sources.
//
// The group is normally the new generation's replicate communicator of that
// shard index (its ranks are the replicate indices): every rank of it calls
// HealState with the same roles. Backends with point-to-point transfers
// (Communicator::SupportsSendRecv: Gloo, shared memory over Gloo) move every
// part at once; others (NCCL for now) broadcast the parts from their sources
// one after the other, the same bytes with less overlap.
#ifndef HSDP_WORKER_COMM_HEAL_H_
#define HSDP_WORKER_COMM_HEAL_H_

#include <cstddef>
#include <vector>

#include "absl/status/status.h"
#include "hsdp/communicator.h"

namespace hsdp::comm {

// Who holds the state and who receives it, as ranks of the group.
struct HealRoles {
  // Holders, in part order (source i sends part i).
  std::vector<int> sources;
  std::vector<int> targets;
};

// Parts are cut on multiples of this many bytes (cache lines), except the
// last one's end.
inline constexpr size_t kHealPartAlign = 64;

// Bytes [begin, end) of the concatenated state that source `index` of
// `num_sources` sends. The parts cover [0, total_bytes) without overlap and
// differ in size by at most kHealPartAlign bytes.
struct ByteRange {
  size_t begin = 0;
  size_t end = 0;
  size_t size() const { return end - begin; }
};
ByteRange HealPart(size_t total_bytes, int num_sources, int index);

// Collective over `group`: when it returns OK, every target's `state` holds
// the sources' bytes. A rank in neither list takes part without moving data.
// INVALID_ARGUMENT for roles that do not make sense (a rank both source and
// target, out of range or repeated; targets without sources); the
// communicator's error (e.g. ABORTED after Abort(), UNAVAILABLE when a source
// died) otherwise — the targets' state is then undefined.
absl::Status HealState(Communicator& group, const HealRoles& roles,
                       const std::vector<Buffer>& state);

}  // namespace hsdp::comm

#endif  // HSDP_WORKER_COMM_HEAL_H_
