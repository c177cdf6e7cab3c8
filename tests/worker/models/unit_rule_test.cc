// Unit rules: globs within one name component, the model's order, and the
// refusals (no match, overlap, empty glob).
#include "worker/models/unit_rule.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace hsdp::models {
namespace {

const std::vector<std::string> kModules = {
    "tok_emb",     "layers",    "layers.0", "layers.0.fc", "layers.1",
    "layers.1.fc", "layers.10", "ln_f",     "head"};

TEST(UnitRuleTest, StarMatchesWithinOneComponent) {
  EXPECT_TRUE(GlobMatchesModuleName("layers.*", "layers.0"));
  EXPECT_TRUE(GlobMatchesModuleName("layers.*", "layers.10"));
  EXPECT_FALSE(GlobMatchesModuleName("layers.*", "layers.0.fc"));
  EXPECT_FALSE(GlobMatchesModuleName("layers.*", "layers"));
  EXPECT_TRUE(GlobMatchesModuleName("layers.*.fc", "layers.1.fc"));
  EXPECT_TRUE(GlobMatchesModuleName("l*s.1*", "layers.10"));
  EXPECT_FALSE(GlobMatchesModuleName("*", "layers.0"));
  EXPECT_TRUE(GlobMatchesModuleName("head", "head"));
  EXPECT_FALSE(GlobMatchesModuleName("head", "heads"));
}

TEST(UnitRuleTest, SelectsInModelOrder) {
  auto units = MatchUnitRule("ln_f, layers.*", kModules);
  ASSERT_TRUE(units.ok()) << units.status();
  EXPECT_EQ(*units, (std::vector<std::string>{"layers.0", "layers.1",
                                              "layers.10", "ln_f"}));
  units = MatchUnitRule("layers.*.fc", kModules);
  ASSERT_TRUE(units.ok()) << units.status();
  EXPECT_EQ(*units, (std::vector<std::string>{"layers.0.fc", "layers.1.fc"}));
}

TEST(UnitRuleTest, RefusesNoMatchOverlapAndEmptyGlobs) {
  auto none = MatchUnitRule("layers.*,blocks.*", kModules);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().message(),
            "--units 'layers.*,blocks.*': 'blocks.*' matches no submodule");
  auto overlap = MatchUnitRule("layers.*,layers.*.fc", kModules);
  ASSERT_FALSE(overlap.ok());
  EXPECT_EQ(overlap.status().message(),
            "--units 'layers.*,layers.*.fc': units overlap: 'layers.0.fc' "
            "(from 'layers.*.fc') is inside 'layers.0' (from 'layers.*')");
  auto parent = MatchUnitRule("layers,layers.1", kModules);
  ASSERT_FALSE(parent.ok());
  EXPECT_NE(parent.status().message().find("units overlap"), std::string::npos);
  EXPECT_FALSE(MatchUnitRule("layers.*,", kModules).ok());
  EXPECT_FALSE(MatchUnitRule("", kModules).ok());
}

}  // namespace
}  // namespace hsdp::models
