// Bad checkpoints are refused with one line naming the file and the tensor;
// incomplete ones are passed over; the pre-v1 per-rank format is refused; a
// writer that never finishes leaves no metadata; keep-K deletes only older
// complete checkpoints.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tests/worker/ckpt/ckpt_test_util.h"
#include "worker/ckpt/crc32c.h"
#include "worker/ckpt/state.h"

namespace hsdp::ckpt::testing {
namespace {

namespace fs = std::filesystem;
using fsdp::testing::MakeInitialState;
using fsdp::testing::RankContext;
using fsdp::testing::RunConfig;
using fsdp::testing::RunOnMesh;
using ::testing::HasSubstr;

constexpr int kGlobalBatch = 4;
const char kShard0[] = "shard-00000-of-00002.bin";
const char kShard1[] = "shard-00001-of-00002.bin";

// Saves steps 0..steps-1 (one checkpoint per step) on 1x2 into root.
void SaveOn1x2(const std::string& root, int steps, int keep = 0) {
  const auto init = MakeInitialState(RunConfig().dims, 1);
  RankBarrier barrier(2);
  RunOnMesh({1, 2}, [&](RankContext& ctx) {
    Trainer t(ctx, init, RunConfig());
    CheckpointSaver saver(SaverOptionsFor(ctx, root, /*async=*/true, keep));
    for (int s = 0; s < steps; ++s) {
      t.Step(s, kGlobalBatch);
      absl::Status st = SaveOnRank(t, saver, s, barrier);
      ASSERT_TRUE(st.ok()) << st;
    }
    absl::Status st = saver.Wait();
    ASSERT_TRUE(st.ok()) << st;
  });
}

// Loading at 1x1; the error (OK if it loaded).
absl::Status LoadAt1x1(const std::string& root,
                       const RunConfig& config = RunConfig()) {
  absl::Status result;
  RunOnMesh({1, 1}, [&](RankContext& ctx) {
    Trainer t(ctx, MakeInitialState(config.dims, 5), config);
    result = LoadOnRank(t, root);
  });
  return result;
}

class RefusalTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    pristine_ = new std::string(TempDir("pristine"));
    SaveOn1x2(*pristine_, 1);
  }
  static void TearDownTestSuite() {
    fs::remove_all(*pristine_);
    delete pristine_;
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(root_);
  }
  void SetUp() override {
    root_ = TempDir(
        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::copy(*pristine_, root_, fs::copy_options::recursive);
    dir_ = root_ + "/" + StepDirName(0);
  }
  nlohmann::json ReadJson() {
    std::ifstream in(dir_ + "/metadata.json");
    return nlohmann::json::parse(in);
  }
  void WriteJson(const nlohmann::json& j) {
    std::ofstream(dir_ + "/metadata.json") << j.dump(1);
  }
  // The tensor whose chunk in `file` covers byte `offset`.
  std::string TensorAt(const std::string& file, int64_t offset) {
    const nlohmann::json j = ReadJson();  // outlives the loop
    for (const auto& t : j["tensors"]) {
      for (const auto& c : t["chunks"]) {
        const int64_t o = c["offset"], n = c["bytes"];
        if (c["file"] == file && offset >= o && offset < o + n)
          return t["name"];
      }
    }
    return "";
  }
  bool HasChunkIn(const std::string& tensor, const std::string& file) {
    const nlohmann::json j = ReadJson();  // outlives the loop
    for (const auto& t : j["tensors"]) {
      if (t["name"] != tensor) continue;
      for (const auto& c : t["chunks"]) {
        if (c["file"] == file) return true;
      }
    }
    return false;
  }
  static std::string* pristine_;
  std::string root_, dir_;
};
std::string* RefusalTest::pristine_ = nullptr;

TEST_F(RefusalTest, GoodCheckpointLoadsAndVerifies) {
  absl::Status s = LoadAt1x1(root_);
  EXPECT_TRUE(s.ok()) << s;
  absl::StatusOr<Metadata> m = ReadMetadata(dir_);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->replicate, 1);
  EXPECT_EQ(m->shard, 2);
  EXPECT_EQ(m->files.size(), 2u);
  s = VerifyCheckpoint(dir_, *m);
  EXPECT_TRUE(s.ok()) << s;
}

TEST_F(RefusalTest, TruncatedFileNamesFileAndTensor) {
  const std::string path = dir_ + "/" + kShard1;
  fs::resize_file(path, fs::file_size(path) - 3);
  absl::Status s = LoadAt1x1(root_);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(s.message()), HasSubstr(kShard1));
  EXPECT_THAT(std::string(s.message()), HasSubstr("truncated"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("tensor "));
}

TEST_F(RefusalTest, MissingRankFileNamesFileAndTensor) {
  fs::remove(dir_ + "/" + kShard0);
  absl::Status s = LoadAt1x1(root_);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(s.message()), HasSubstr(kShard0));
  EXPECT_THAT(std::string(s.message()), HasSubstr("missing"));
  // Names a tensor that has rows in that file.
  std::smatch named;
  const std::string message(s.message());
  ASSERT_TRUE(std::regex_search(message, named, std::regex("tensor (\\S+) ")))
      << message;
  EXPECT_TRUE(HasChunkIn(named[1], kShard0)) << message;
}

TEST_F(RefusalTest, OtherModelsMetadataRefused) {
  nlohmann::json j = ReadJson();
  j["model"]["name"] = "gpt";
  WriteJson(j);
  absl::Status s = LoadAt1x1(root_);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("metadata.json"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("\"gpt\""));
}

TEST_F(RefusalTest, OtherShapesOfTheSameModelNameTheTensor) {
  RunConfig wider;
  wider.dims.vocab = 13;
  absl::Status s = LoadAt1x1(root_, wider);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("metadata.json"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("embed"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("[11, 8]"));
}

TEST_F(RefusalTest, FlippedByteCaughtByVerifyAndLoadNamingFileAndTensor) {
  const std::string path = dir_ + "/" + kShard1;
  const int64_t offset = static_cast<int64_t>(fs::file_size(path)) / 2;
  const std::string tensor = TensorAt(kShard1, offset);
  ASSERT_FALSE(tensor.empty());
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(offset);
    char c = 0;
    f.get(c);
    f.seekp(offset);
    f.put(static_cast<char>(c ^ 0x10));
  }
  absl::StatusOr<Metadata> m = ReadMetadata(dir_);
  ASSERT_TRUE(m.ok()) << m.status();
  absl::Status v = VerifyCheckpoint(dir_, *m);
  EXPECT_EQ(v.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(v.message()), HasSubstr("checksum mismatch"));
  EXPECT_THAT(std::string(v.message()), HasSubstr(kShard1));
  EXPECT_THAT(std::string(v.message()), HasSubstr("tensor " + tensor + " "));
  absl::Status s = LoadAt1x1(root_);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(s.message()), HasSubstr(kShard1));
  EXPECT_THAT(std::string(s.message()), HasSubstr("tensor " + tensor + " "));
}

TEST_F(RefusalTest, UnknownFormatVersionRefused) {
  nlohmann::json j = ReadJson();
  j["format_version"] = kFormatVersion + 1;
  WriteJson(j);
  absl::Status s = LoadAt1x1(root_);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("metadata.json"));
  EXPECT_THAT(std::string(s.message()),
              HasSubstr(absl::StrCat("format_version ", kFormatVersion + 1)));
}

// A version-1 checkpoint cannot hold what version 2 added: a shard dim in
// one is damage, not a layout.
TEST_F(RefusalTest, ShardDimInVersionOneRefused) {
  nlohmann::json j = ReadJson();
  ASSERT_EQ(j["format_version"], 1);
  j["tensors"][0]["shard_dim"] = 1;
  WriteJson(j);
  absl::Status s = LoadAt1x1(root_);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(s.message()), HasSubstr("format_version 1"));
}

TEST_F(RefusalTest, NewestIncompleteIsSkippedAndNamed) {
  // An interrupted save of step 5: shard files, one index, no metadata.
  const std::string newer = root_ + "/" + StepDirName(5);
  fs::create_directories(newer);
  fs::copy(dir_ + "/" + kShard0, newer + "/" + kShard0);
  fs::copy(dir_ + "/" + ShardIndexName(kShard0),
           newer + "/" + ShardIndexName(kShard0));
  absl::StatusOr<FoundCheckpoint> found = FindLatestCheckpoint(root_);
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(found->step, 0);
  ASSERT_EQ(found->skipped.size(), 1u);
  EXPECT_THAT(found->skipped[0], HasSubstr(StepDirName(5)));
  EXPECT_THAT(found->skipped[0], HasSubstr("incomplete"));
  absl::Status s = LoadAt1x1(root_);
  EXPECT_TRUE(s.ok()) << s;
}

TEST(FormatTest, PreV1PerRankFilesRefusedClearly) {
  const std::string root = TempDir("old_format");
  fs::create_directories(root + "/" + StepDirName(10));
  std::ofstream(root + "/" + StepDirName(10) + "/rank-0-of-2.pt") << "x";
  absl::StatusOr<FoundCheckpoint> found = FindLatestCheckpoint(root);
  EXPECT_EQ(found.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(found.status().message()), HasSubstr("pre-v1"));
  EXPECT_THAT(std::string(found.status().message()),
              HasSubstr(StepDirName(10)));
}

TEST(FormatTest, WriterThatNeverFinishesLeavesNoMetadata) {
  const std::string root = TempDir("unfinished");
  SaveOn1x2(root, 1);
  const std::string dir = root + "/" + StepDirName(0);
  // As if shard 1's writer died mid-write: its data is there under the
  // temporary name, its index never appeared.
  fs::rename(dir + "/" + kShard1, dir + "/" + kShard1 + ".tmp");
  fs::remove(dir + "/" + ShardIndexName(kShard1));
  fs::remove(dir + "/" + std::string(kMetadataFile));
  Metadata base;
  base.model_name = kModelName;
  absl::Status s = PublishMetadata(dir, base, 2, absl::Milliseconds(200));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(s.message()), HasSubstr(kShard1));
  EXPECT_FALSE(fs::exists(dir + "/" + std::string(kMetadataFile)));
  absl::StatusOr<FoundCheckpoint> found = FindLatestCheckpoint(root);
  ASSERT_TRUE(found.ok());
  EXPECT_EQ(found->step, -1);
}

TEST(FormatTest, KeepDeletesOnlyOlderCompleteCheckpoints) {
  const std::string root = TempDir("keep");
  SaveOn1x2(root, 4, /*keep=*/2);
  EXPECT_EQ(CompleteCheckpointSteps(root), (std::vector<int64_t>{2, 3}));
  EXPECT_FALSE(fs::exists(root + "/" + StepDirName(0)));
  EXPECT_FALSE(fs::exists(root + "/" + StepDirName(1)));
}

TEST(FormatTest, Crc32cIsTheCastagnoliCrc) {
  // The standard check value of CRC-32C (iSCSI), what other readers compute.
  EXPECT_EQ(Crc32c("123456789", 9), 0xE3069283u);
  // Two parts extended equal one pass (the 8-byte and byte-wise paths agree).
  const std::string data(1000, '\x5a');
  EXPECT_EQ(Crc32cExtend(Crc32c(data.data(), 13), data.data() + 13, 987),
            Crc32c(data.data(), 1000));
}

TEST(FormatTest, MetadataRoundTripsThroughJson) {
  Metadata m;
  m.step = 7;
  m.next_step = 8;
  m.samples_consumed = 96;
  m.global_batch_samples = 12;
  m.seed = 3;
  m.model_name = "gpt";
  m.policy_version = 4;
  m.replicate = 2;
  m.shard = 2;
  m.optimizer = "adamw";
  m.optimizer_steps = {{"w", 8}};
  m.job = {{"lr", "0.001"}};
  m.files = {{"shard-00000-of-00001.bin", 24}};
  m.tensors = {{"w",
                "float32",
                {3, 2},
                {{"shard-00000-of-00001.bin", 0, 3, 0, 24, 3, {123}}}}};
  absl::StatusOr<Metadata> back = MetadataFromJson(MetadataToJson(m), "x");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(MetadataToJson(*back), MetadataToJson(m));
  EXPECT_TRUE(ValidateMetadata(*back, "x").ok());
  EXPECT_EQ(back->tensors[0].chunks[0].crc32c[0], 123u);
}

}  // namespace
}  // namespace hsdp::ckpt::testing
