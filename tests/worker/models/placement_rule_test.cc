// Placement rules: dims and "replicated" by glob over parameter names, and the
// refusals (not GLOB=WHERE, a bad WHERE, no match, placed twice).
#include "worker/models/placement_rule.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace hsdp::models {
namespace {

const std::vector<std::string> kParams = {
    "emb.weight",          "layers.0.ln1.weight", "layers.0.ln1.bias",
    "layers.0.qkv.weight", "layers.1.ln1.weight", "layers.1.ln1.bias",
    "layers.1.qkv.weight", "head.weight"};

TEST(PlacementRuleTest, PlacesByGlob) {
  auto placed = MatchPlacementRule(
      "layers.*.ln1.*=replicated, layers.*.qkv.weight=1,head.weight=-1",
      kParams);
  ASSERT_TRUE(placed.ok()) << placed.status();
  EXPECT_EQ(placed->size(), 7u);
  EXPECT_FALSE(placed->count("emb.weight"));
  EXPECT_TRUE(placed->at("layers.1.ln1.bias").replicated);
  EXPECT_FALSE(placed->at("layers.0.qkv.weight").replicated);
  EXPECT_EQ(placed->at("layers.0.qkv.weight").shard_dim, 1);
  EXPECT_EQ(placed->at("head.weight").shard_dim, -1);
}

TEST(PlacementRuleTest, RefusesNamingTheEntry) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"layers.*.qkv.weight", "is not GLOB=DIM or GLOB=replicated"},
      {"=1", "is not GLOB=DIM or GLOB=replicated"},
      {"head.weight=two", "neither on a dim nor replicated"},
      {"decoder.*.weight=1", "'decoder.*.weight=1' matches no parameter"},
      {"layers.*.ln1.*=replicated,layers.0.ln1.bias=0",
       "places layers.0.ln1.bias, which 'layers.*.ln1.*=replicated' placed"}};
  for (const auto& [rule, needle] : cases) {
    auto placed = MatchPlacementRule(rule, kParams);
    ASSERT_FALSE(placed.ok()) << rule;
    EXPECT_EQ(placed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(placed.status().message().find(needle), std::string::npos)
        << placed.status();
  }
}

}  // namespace
}  // namespace hsdp::models
