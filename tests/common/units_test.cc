#include "common/units.h"

#include <gtest/gtest.h>

namespace hsdp {
namespace {

hsdp::v1::UnitInfo Unit(const std::string& name, int64_t params) {
  hsdp::v1::UnitInfo unit;
  unit.set_name(name);
  unit.set_param_count(params);
  unit.set_param_bytes(params * 4);
  return unit;
}

TEST(UnitsTest, ValidatesLists) {
  EXPECT_TRUE(ValidateUnitList({Unit("root", 10), Unit("layers.0", 5)}).ok());
  EXPECT_EQ(ValidateUnitList({}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateUnitList({Unit("", 1)}).code(),
            absl::StatusCode::kInvalidArgument);
  absl::Status dup = ValidateUnitList({Unit("root", 1), Unit("root", 1)});
  EXPECT_EQ(dup.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(dup.message(), "unit 1: duplicate name root");
  EXPECT_EQ(ValidateUnitList({Unit("root", -1)}).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(UnitsTest, CompareNamesFirstDifference) {
  const UnitList job = {Unit("root", 10), Unit("layers.0", 5),
                        Unit("layers.1", 5)};
  EXPECT_TRUE(CompareUnitLists(job, job).ok());
  UnitList other = job;
  other[1].set_param_count(6);
  absl::Status s = CompareUnitLists(other, job);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(
      s.message(),
      "unit 1 differs: got layers.0 (params 6, bytes 20), the job has layers.0 "
      "(params 5, bytes 20)");
  UnitList shorter(job.begin(), job.begin() + 2);
  s = CompareUnitLists(shorter, job);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("first missing: layers.1"), std::string::npos)
      << s;
  EXPECT_EQ(TotalParamBytes(job), 80);
  EXPECT_EQ(UnitNames(job)[2], "layers.1");
}

// A worker whose placement replicates other parameters than the job's holds
// other bytes per rank: a different model as far as the job is concerned.
TEST(UnitsTest, ReplicatedBytesAreChecked) {
  const UnitList job = {Unit("root", 10), Unit("layers.0", 5)};
  UnitList other = job;
  other[1].set_replicated_bytes(8);
  EXPECT_TRUE(ValidateUnitList(other).ok());
  absl::Status s = CompareUnitLists(other, job);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(),
            "unit 1 differs: got layers.0 (params 5, bytes 20, replicated "
            "bytes 8), the job has layers.0 (params 5, bytes 20)");
  other[1].set_replicated_bytes(21);
  s = ValidateUnitList(other);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("replicated_bytes"), std::string::npos) << s;
}

}  // namespace
}  // namespace hsdp
