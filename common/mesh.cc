#include "hsdp/mesh.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace hsdp {
namespace {

bool ParseDim(absl::string_view text, int* out) {
  // SimpleAtoi accepts a leading '+' and spaces; the mesh syntax is digits
  // only.
  if (text.empty() || text.size() > 9) return false;
  for (char c : text) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return false;
  }
  return absl::SimpleAtoi(text, out) && *out >= 1 && *out <= kMaxMeshDim;
}

}  // namespace

absl::StatusOr<MeshShape> ParseMesh(absl::string_view text) {
  const absl::string_view trimmed = absl::StripAsciiWhitespace(text);
  std::vector<absl::string_view> parts =
      absl::StrSplit(trimmed, absl::ByAnyChar("xX"));
  MeshShape mesh;
  if (parts.size() != 2 || !ParseDim(parts[0], &mesh.replicate) ||
      !ParseDim(parts[1], &mesh.shard)) {
    return absl::InvalidArgumentError(
        absl::StrCat("mesh \"", text, "\": expected RxS with integers in [1, ",
                     kMaxMeshDim, "], e.g. 2x4"));
  }
  return mesh;
}

absl::Status ValidateMesh(const MeshShape& mesh, int world_size) {
  if (mesh.replicate < 1 || mesh.shard < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "mesh ", MeshToString(mesh), ": both dimensions must be >= 1"));
  }
  if (world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("world size ", world_size, " must be >= 1"));
  }
  if (static_cast<int64_t>(mesh.replicate) * mesh.shard != world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("mesh ", MeshToString(mesh), " has ",
                     static_cast<int64_t>(mesh.replicate) * mesh.shard,
                     " ranks but the world size is ", world_size));
  }
  return absl::OkStatus();
}

absl::StatusOr<MeshShape> ParseMeshForWorld(absl::string_view text,
                                            int world_size) {
  MeshShape mesh{1, world_size};
  if (!absl::StripAsciiWhitespace(text).empty()) {
    absl::StatusOr<MeshShape> parsed = ParseMesh(text);
    if (!parsed.ok()) return parsed.status();
    mesh = *parsed;
  }
  absl::Status status = ValidateMesh(mesh, world_size);
  if (!status.ok()) return status;
  return mesh;
}

std::string MeshToString(const MeshShape& mesh) {
  return absl::StrCat(mesh.replicate, "x", mesh.shard);
}

MeshCoord RankToCoord(const MeshShape& mesh, int rank) {
  return MeshCoord{rank / mesh.shard, rank % mesh.shard};
}

int CoordToRank(const MeshShape& mesh, const MeshCoord& coord) {
  return coord.replicate_index * mesh.shard + coord.shard_index;
}

std::vector<int> ShardGroupRanks(const MeshShape& mesh, int rank) {
  const MeshCoord coord = RankToCoord(mesh, rank);
  std::vector<int> ranks;
  ranks.reserve(mesh.shard);
  for (int s = 0; s < mesh.shard; ++s) {
    ranks.push_back(CoordToRank(mesh, {coord.replicate_index, s}));
  }
  return ranks;
}

std::vector<int> ReplicateGroupRanks(const MeshShape& mesh, int rank) {
  const MeshCoord coord = RankToCoord(mesh, rank);
  std::vector<int> ranks;
  ranks.reserve(mesh.replicate);
  for (int r = 0; r < mesh.replicate; ++r) {
    ranks.push_back(CoordToRank(mesh, {r, coord.shard_index}));
  }
  return ranks;
}

int64_t PaddedShardRows(int64_t dim0, int shard) {
  return (dim0 + shard - 1) / shard;
}

int64_t PaddedDim0(int64_t dim0, int shard) {
  return PaddedShardRows(dim0, shard) * shard;
}

RowRange ShardRowRange(int64_t dim0, int shard, int shard_index) {
  const int64_t rows = PaddedShardRows(dim0, shard);
  RowRange range;
  range.begin = std::min(dim0, rows * shard_index);
  range.end = std::min(dim0, range.begin + rows);
  return range;
}

int64_t ShardedBytes(int64_t bytes, int shard) {
  return (bytes + shard - 1) / shard;
}

int HostGroupSize(int shard, const std::vector<std::string>& hosts_by_rank) {
  const int world = static_cast<int>(hosts_by_rank.size());
  if (shard < 4 || world == 0 || world % shard != 0) return 0;
  for (const std::string& host : hosts_by_rank) {
    if (host.empty()) return 0;
  }
  // The first shard group's first run sets the size; every run must match.
  int k = 1;
  while (k < shard && hosts_by_rank[k] == hosts_by_rank[0]) ++k;
  if (k == 1 || k == shard || shard % k != 0) return 0;
  for (int first = 0; first < world; first += k) {
    for (int r = first; r < first + k; ++r) {
      if (hosts_by_rank[r] != hosts_by_rank[first]) return 0;
    }
    // A run ends where its host does, unless a shard group ends there.
    if ((first + k) % shard != 0 &&
        hosts_by_rank[first + k] == hosts_by_rank[first])
      return 0;
  }
  return k;
}

}  // namespace hsdp
