#include "hsdp/mesh.h"

#include <gtest/gtest.h>

#include "common/mesh_proto.h"

namespace hsdp {
namespace {

TEST(MeshTest, ParsesRxS) {
  absl::StatusOr<MeshShape> mesh = ParseMesh("2x4");
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  EXPECT_EQ(mesh->replicate, 2);
  EXPECT_EQ(mesh->shard, 4);
  EXPECT_EQ(mesh->world_size(), 8);
  EXPECT_EQ(MeshToString(*mesh), "2x4");
  EXPECT_EQ(ParseMesh(" 1X3 ")->shard, 3);
}

TEST(MeshTest, RejectsMalformed) {
  for (const char* text : {"", "2", "2x", "x2", "0x4", "2x0", "-1x2", "2x4x1",
                           "axb", "2*4", "+2x4", "2x99999999999"}) {
    absl::StatusOr<MeshShape> mesh = ParseMesh(text);
    EXPECT_EQ(mesh.status().code(), absl::StatusCode::kInvalidArgument) << text;
  }
}

TEST(MeshTest, ValidatesAgainstWorld) {
  EXPECT_TRUE(ValidateMesh({2, 2}, 4).ok());
  absl::Status s = ValidateMesh({3, 2}, 4);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "mesh 3x2 has 6 ranks but the world size is 4");
  EXPECT_EQ(ValidateMesh({1, 1}, 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseMeshForWorld("3x3", 8).status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::StatusOr<MeshShape> def = ParseMeshForWorld("", 6);
  ASSERT_TRUE(def.ok());
  EXPECT_EQ(*def, (MeshShape{1, 6}));
}

TEST(MeshTest, RankCoordinatesRoundTrip) {
  const MeshShape mesh{3, 4};
  for (int rank = 0; rank < mesh.world_size(); ++rank) {
    const MeshCoord coord = RankToCoord(mesh, rank);
    EXPECT_EQ(coord.replicate_index, rank / 4);
    EXPECT_EQ(coord.shard_index, rank % 4);
    EXPECT_EQ(CoordToRank(mesh, coord), rank);
  }
  EXPECT_EQ(ShardGroupRanks(mesh, 6), (std::vector<int>{4, 5, 6, 7}));
  EXPECT_EQ(ReplicateGroupRanks(mesh, 6), (std::vector<int>{2, 6, 10}));
  EXPECT_EQ(MeshFromProto(MeshToProto(mesh)), mesh);
}

TEST(MeshTest, ShardArithmeticPadsDim0) {
  EXPECT_EQ(PaddedShardRows(10, 4), 3);
  EXPECT_EQ(PaddedDim0(10, 4), 12);
  EXPECT_EQ(PaddedShardRows(8, 4), 2);
  EXPECT_EQ(PaddedShardRows(0, 4), 0);
  // 10 rows over 4 ranks: [0,3) [3,6) [6,9) [9,10).
  EXPECT_EQ(ShardRowRange(10, 4, 0).begin, 0);
  EXPECT_EQ(ShardRowRange(10, 4, 2).end, 9);
  EXPECT_EQ(ShardRowRange(10, 4, 3).size(), 1);
  // 2 rows over 4 ranks: the last two ranks hold only padding.
  EXPECT_EQ(ShardRowRange(2, 4, 1).size(), 1);
  EXPECT_EQ(ShardRowRange(2, 4, 2).size(), 0);
  EXPECT_EQ(ShardRowRange(2, 4, 3).size(), 0);
  int64_t total = 0;
  for (int s = 0; s < 7; ++s) total += ShardRowRange(100, 7, s).size();
  EXPECT_EQ(total, 100);
  EXPECT_EQ(ShardedBytes(10, 3), 4);
}

// The host group: runs of equal hosts inside shard groups that span hosts.
TEST(MeshTest, HostGroupSizeIsTheRunOfOneHostInEveryShardGroup) {
  // 1x4 over two hosts of two ranks, 2x4 over four, 1x8 over two of four.
  EXPECT_EQ(HostGroupSize(4, {"a", "a", "b", "b"}), 2);
  EXPECT_EQ(HostGroupSize(4, {"a", "a", "b", "b", "c", "c", "d", "d"}), 2);
  EXPECT_EQ(HostGroupSize(8, {"a", "a", "a", "a", "b", "b", "b", "b"}), 4);
  // A host shared by the end of one shard group and the next group's start.
  EXPECT_EQ(HostGroupSize(4, {"a", "a", "b", "b", "b", "b", "c", "c"}), 2);
  // Shard groups inside one host: nothing to gather within.
  EXPECT_EQ(HostGroupSize(4, {"a", "a", "a", "a", "b", "b", "b", "b"}), 0);
  EXPECT_EQ(HostGroupSize(2, {"a", "b"}), 0);
  // One rank per host, runs of unequal sizes, interleaved or unknown hosts.
  EXPECT_EQ(HostGroupSize(4, {"a", "b", "c", "d"}), 0);
  EXPECT_EQ(HostGroupSize(6, {"a", "a", "a", "a", "b", "b"}), 0);
  EXPECT_EQ(HostGroupSize(4, {"a", "a", "b", "b", "c", "c", "c", "d"}), 0);
  EXPECT_EQ(HostGroupSize(4, {"a", "a", "a", "b"}), 0);
  EXPECT_EQ(HostGroupSize(4, {"a", "a", "", ""}), 0);
  EXPECT_EQ(HostGroupSize(4, {}), 0);
}

}  // namespace
}  // namespace hsdp
