// Fuzzes checkpoint format v1's metadata (worker/ckpt/format.h): the parsers of
// metadata.json and of a shard's .index.json, and ValidateMetadata, which
// `hsdp-ckpt inspect|verify` and the loader run before they trust any offset.
// The format is torch-free, so this target builds without the worker.
//
// Invariants: a parse error is one Status (never an exception or a crash);
// whatever parses survives a round trip through its JSON form unchanged, and
// validation gives the same answer on the round-tripped metadata.
#include <cstddef>
#include <cstdint>
#include <string>

#include "tests/fuzz/fuzz_check.h"
#include "worker/ckpt/format.h"

namespace {

constexpr char kPath[] = "fuzz/metadata.json";

void FuzzMetadata(const std::string& text) {
  absl::StatusOr<hsdp::ckpt::Metadata> m =
      hsdp::ckpt::MetadataFromJson(text, kPath);
  if (!m.ok()) {
    FUZZ_CHECK(m.status().code() == absl::StatusCode::kInvalidArgument ||
               m.status().code() == absl::StatusCode::kDataLoss ||
               m.status().code() == absl::StatusCode::kFailedPrecondition);
    return;
  }
  const absl::Status valid = hsdp::ckpt::ValidateMetadata(*m, kPath);
  FUZZ_CHECK(valid.ok() || valid.code() == absl::StatusCode::kDataLoss);
  const std::string json = hsdp::ckpt::MetadataToJson(*m);
  absl::StatusOr<hsdp::ckpt::Metadata> again =
      hsdp::ckpt::MetadataFromJson(json, kPath);
  FUZZ_CHECK(again.ok());
  FUZZ_CHECK(hsdp::ckpt::MetadataToJson(*again) == json);
  FUZZ_CHECK(hsdp::ckpt::ValidateMetadata(*again, kPath).ok() == valid.ok());
}

void FuzzShardIndex(const std::string& text) {
  absl::StatusOr<hsdp::ckpt::ShardIndex> index =
      hsdp::ckpt::ShardIndexFromJson(text, "fuzz/shard.bin.index.json");
  if (!index.ok()) {
    FUZZ_CHECK(index.status().code() == absl::StatusCode::kInvalidArgument ||
               index.status().code() == absl::StatusCode::kDataLoss);
    return;
  }
  const std::string json = hsdp::ckpt::ShardIndexToJson(*index);
  absl::StatusOr<hsdp::ckpt::ShardIndex> again =
      hsdp::ckpt::ShardIndexFromJson(json, "fuzz/shard.bin.index.json");
  FUZZ_CHECK(again.ok());
  FUZZ_CHECK(hsdp::ckpt::ShardIndexToJson(*again) == json);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  FuzzMetadata(text);
  FuzzShardIndex(text);
  int64_t step = 0;
  (void)hsdp::ckpt::ParseStepDirName(text, &step);
  return 0;
}
