// The replicate x shard device mesh and dim-0 shard arithmetic, shared by the
// coordinator (Join answers) and the engine (which rows of a parameter a rank
// holds). Protobuf-free: the wire conversions are in common/mesh_proto.h.
//
// Conventions (contract): rank = replicate_index * shard + shard_index; written
// "RxS". A parameter is sharded on dim 0 across the S ranks of a shard group,
// padded so every rank holds ceil(dim0 / S) rows; trailing ranks may hold only
// padding.
#ifndef HSDP_MESH_H_
#define HSDP_MESH_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace hsdp {

// Largest replicate or shard degree accepted; guards against absurd inputs.
inline constexpr int kMaxMeshDim = 1 << 16;

// A value type; thread-compatible.
struct MeshShape {
  int replicate = 1;
  int shard = 1;

  int world_size() const { return replicate * shard; }
  bool operator==(const MeshShape& o) const {
    return replicate == o.replicate && shard == o.shard;
  }
  bool operator!=(const MeshShape& o) const { return !(*this == o); }
};

// A rank's place in the mesh.
struct MeshCoord {
  int replicate_index = 0;
  int shard_index = 0;
  bool operator==(const MeshCoord& o) const {
    return replicate_index == o.replicate_index && shard_index == o.shard_index;
  }
};

// Parses "RxS" (also "RXS"; surrounding spaces allowed), e.g. "2x4". Both
// factors must be integers in [1, kMaxMeshDim]. INVALID_ARGUMENT otherwise,
// quoting the text.
absl::StatusOr<MeshShape> ParseMesh(absl::string_view text);

// OK iff both dims are >= 1 and replicate * shard == world_size; else
// INVALID_ARGUMENT, e.g. "mesh 3x2 has 6 ranks but the world size is 4".
absl::Status ValidateMesh(const MeshShape& mesh, int world_size);

// Parses `text` and validates it against `world_size`; an empty `text` means
// 1xWORLD.
absl::StatusOr<MeshShape> ParseMeshForWorld(absl::string_view text,
                                            int world_size);

// "RxS".
std::string MeshToString(const MeshShape& mesh);

// Rank <-> coordinates. Preconditions: 0 <= rank < world_size, indices in
// range.
MeshCoord RankToCoord(const MeshShape& mesh, int rank);
int CoordToRank(const MeshShape& mesh, const MeshCoord& coord);

// Ranks of the shard group a rank belongs to (same replicate_index), ascending.
std::vector<int> ShardGroupRanks(const MeshShape& mesh, int rank);
// Ranks of the replicate group a rank belongs to (same shard_index), ascending.
std::vector<int> ReplicateGroupRanks(const MeshShape& mesh, int rank);

// ceil(dim0 / shard): rows every rank holds for a parameter with `dim0` rows
// (padded). Precondition: dim0 >= 0, shard >= 1.
int64_t PaddedShardRows(int64_t dim0, int shard);

// PaddedShardRows(dim0, shard) * shard: dim0 rounded up to a multiple of shard.
int64_t PaddedDim0(int64_t dim0, int shard);

// Rows [begin, end) of the unpadded parameter that `shard_index` holds; the
// rest of its PaddedShardRows() rows are padding. May be empty (begin == end)
// for trailing ranks.
struct RowRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
};
RowRange ShardRowRange(int64_t dim0, int shard, int shard_index);

// ceil(bytes / shard): per-rank share of `bytes` when sharded evenly (used for
// planning).
int64_t ShardedBytes(int64_t bytes, int shard);

// The host group size of ranks laid out on hosts (hierarchical reshard): the
// k with 1 < k < shard and shard % k == 0 such that every run of k
// consecutive ranks (from rank 0) lies on one known host and every shard
// group spans more than one host; 0 when there is none (shard groups inside
// hosts, an unknown (empty) host, runs of unequal sizes). `hosts_by_rank`
// holds whole shard groups. The coordinator applies it to a generation
// (hsdp.v1.Generation.host_group_size), each rank to its own shard group
// (DeviceMesh), with the same result where the coordinator finds one.
int HostGroupSize(int shard, const std::vector<std::string>& hosts_by_rank);

}  // namespace hsdp

#endif  // HSDP_MESH_H_
