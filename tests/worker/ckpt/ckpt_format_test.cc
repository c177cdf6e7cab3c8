// metadata.json and .index.json parsing and validation (worker/ckpt/format.h)
// on hostile values: numbers that are not integers in range, negative or
// overflowing shapes, offsets past int64. Each is refused with one line naming
// the file, the field or tensor, never cast to garbage or overflowed (these
// were undefined behaviour before; tests/fuzz/crashes/checkpoint_metadata_fuzz
// holds the fuzzer's inputs).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "absl/strings/str_replace.h"
#include "worker/ckpt/format.h"

namespace hsdp::ckpt {
namespace {

using ::testing::HasSubstr;

constexpr char kPath[] = "ckpt/step-00000001/metadata.json";

// A valid metadata.json with one float32 tensor of shape [3, 2] in one
// chunk; the $ placeholders are what tests override.
constexpr char kTemplate[] = R"({
 "format": "hsdp-checkpoint", "format_version": 1, "step": $STEP,
 "data": {"next_step": 2, "samples_consumed": 8, "global_batch_samples": 4},
 "seed": $SEED, "model": {"name": "gpt", "version": "1"}, "policy_version": -1,
 "mesh": {"replicate": 1, "shard": $SHARD},
 "optimizer": {"type": "none", "steps": {}}, "job": {},
 "files": [{"name": "f.bin", "bytes": $FSIZE}],
 "tensors": [{"name": "w", "dtype": "float32", "shape": [$NROWS, $NCOLS],
   "chunks": [{"file": "f.bin", "rows": [0, $NROWS], "offset": $OFF,
               "bytes": $CBYTES, "block_rows": $BLK, "crc32c": [$CRC]}]}]
})";

std::string Metadata(
    std::initializer_list<std::pair<absl::string_view, absl::string_view>>
        overrides = {}) {
  std::string text = absl::StrReplaceAll(kTemplate, overrides);
  return absl::StrReplaceAll(text, {{"$STEP", "1"},
                                    {"$SEED", "7"},
                                    {"$SHARD", "1"},
                                    {"$FSIZE", "24"},
                                    {"$NROWS", "3"},
                                    {"$NCOLS", "2"},
                                    {"$OFF", "0"},
                                    {"$CBYTES", "24"},
                                    {"$BLK", "8192"},
                                    {"$CRC", "1"}});
}

absl::Status ParseAndValidate(const std::string& text) {
  absl::StatusOr<ckpt::Metadata> m = MetadataFromJson(text, kPath);
  if (!m.ok()) return m.status();
  return ValidateMetadata(*m, kPath);
}

TEST(CkptFormatTest, TemplateIsValid) {
  absl::Status s = ParseAndValidate(Metadata());
  EXPECT_TRUE(s.ok()) << s;
}

TEST(CkptFormatTest, NonIntegerOrOutOfRangeNumbersAreRefusedNamingTheField) {
  struct Case {
    absl::string_view placeholder, value, field;
  };
  for (const Case& c :
       {Case{"$STEP", "1e300", "step"}, Case{"$STEP", "1.5", "step"},
        Case{"$STEP", "18446744073709551615", "step"},
        Case{"$SEED", "-1", "seed"}, Case{"$SHARD", "4294967297", "shard"},
        Case{"$SHARD", "-1e10", "shard"}, Case{"$NROWS", "1e19", "shape"},
        Case{"$CRC", "4294967296", "crc32c"}, Case{"$CRC", "-1", "crc32c"}}) {
    absl::StatusOr<ckpt::Metadata> m =
        MetadataFromJson(Metadata({{c.placeholder, c.value}}), kPath);
    ASSERT_FALSE(m.ok()) << c.placeholder << "=" << c.value;
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(m.status().message(), HasSubstr(kPath));
    EXPECT_THAT(m.status().message(),
                HasSubstr(absl::StrCat("\"", c.field, "\"")));
    EXPECT_THAT(m.status().message(), HasSubstr("not an integer in range"));
  }
}

TEST(CkptFormatTest, IndexRefusesFloatsToo) {
  absl::StatusOr<ShardIndex> index = ShardIndexFromJson(
      R"({"file": {"name": "f.bin", "bytes": 1e30}, "optimizer_steps": {},
          "tensors": []})",
      "f.bin.index.json");
  ASSERT_FALSE(index.ok());
  EXPECT_THAT(index.status().message(), HasSubstr("f.bin.index.json: file: "));
  EXPECT_THAT(index.status().message(), HasSubstr("\"bytes\""));
}

TEST(CkptFormatTest, NegativeDimIsRefused) {
  absl::Status s =
      ParseAndValidate(Metadata({{"$NCOLS", "-2"}, {"$CBYTES", "-24"}}));
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("tensor w: dim 1 is negative (-2)"));
}

TEST(CkptFormatTest, RowBytesOverflowIsRefused) {
  // 2^62 columns of 4 bytes: the row's byte count overflows int64.
  absl::Status s =
      ParseAndValidate(Metadata({{"$NCOLS", "4611686018427387904"}}));
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("tensor w: its shape is too large"));
}

TEST(CkptFormatTest, ChunkBytesOverflowIsRefused) {
  // Rows x row bytes overflows (2^62 rows of 8 bytes).
  absl::Status s =
      ParseAndValidate(Metadata({{"$NROWS", "4611686018427387904"}}));
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("does not fit"));
}

TEST(CkptFormatTest, OffsetPastInt64IsRefused) {
  // offset + bytes would overflow int64.
  absl::Status s = ParseAndValidate(Metadata(
      {{"$OFF", "9223372036854775800"}, {"$FSIZE", "9223372036854775807"}}));
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("at offset 9223372036854775800"));
}

TEST(CkptFormatTest, NegativeFileSizeIsRefused) {
  absl::Status s =
      ParseAndValidate(Metadata({{"$FSIZE", "-9223372036854775807"}}));
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("does not fit"));
}

TEST(CkptFormatTest, HugeBlockRowsCountsOneBlock) {
  // (rows + block_rows - 1) used to overflow for block_rows near INT64_MAX.
  absl::Status s =
      ParseAndValidate(Metadata({{"$BLK", "9223372036854775807"}}));
  EXPECT_TRUE(s.ok()) << s;
}

}  // namespace
}  // namespace hsdp::ckpt
