// hsdp-ckpt on a checkpoint saved on 1x2: export to a torch.load archive and
// to safetensors, read back in Python (Debian python3-torch) and compared
// bitwise with the training state; inspect and verify through the binary,
// verify naming the file and tensor of a flipped byte.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "tests/worker/ckpt/ckpt_test_util.h"
#include "worker/ckpt/export.h"
#include "worker/ckpt/state.h"

namespace hsdp::ckpt::testing {
namespace {

namespace fs = std::filesystem;
using fsdp::testing::MakeInitialState;
using fsdp::testing::RankContext;
using fsdp::testing::RunConfig;
using fsdp::testing::RunOnMesh;
using ::testing::HasSubstr;

struct ShellResult {
  int status = -1;
  std::string output;
};

ShellResult Shell(const std::string& command) {
  ShellResult r;
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) r.output.append(buf, n);
  const int status = pclose(pipe);
  r.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

class ExportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = TempDir("export");
    const auto init = MakeInitialState(RunConfig().dims, 1);
    RankBarrier barrier(2);
    RunOnMesh({1, 2}, [&](RankContext& ctx) {
      Trainer t(ctx, init, RunConfig());
      for (int s = 0; s < 2; ++s) t.Step(s, 4);
      std::map<std::string, int64_t> steps;
      std::vector<LocalTensor> copies;
      for (const LocalTensor& l : t.State(&steps))
        copies.push_back(
            {l.name, l.tensor.clone(), l.global_shape, l.row_offset});
      state_.Add(copies);
      CheckpointSaver saver(SaverOptionsFor(ctx, root_, /*async=*/false, 0));
      absl::Status s = SaveOnRank(t, saver, 1, barrier);
      ASSERT_TRUE(s.ok()) << s;
    });
    dir_ = root_ + "/" + StepDirName(1);
  }
  std::string root_, dir_;
  GlobalState state_;
};

TEST_F(ExportTest, TorchLoadAndSafetensorsRoundTripInPython) {
  absl::StatusOr<Metadata> m = ReadMetadata(dir_);
  ASSERT_TRUE(m.ok()) << m.status();
  const std::string pt = root_ + "/model.pt", st = root_ + "/model.safetensors";
  absl::Status s = ExportTorch(dir_, *m, pt, /*with_optimizer=*/true);
  ASSERT_TRUE(s.ok()) << s;
  s = ExportSafetensors(dir_, *m, st, /*with_optimizer=*/true);
  ASSERT_TRUE(s.ok()) << s;
  const std::string expected = root_ + "/expected";
  fs::create_directories(expected);
  const auto tensors = state_.tensors();
  ASSERT_GT(tensors.size(), 10u);
  for (const auto& [name, t] : tensors) {
    std::ofstream out(
        absl::StrCat(expected, "/", absl::StrReplaceAll(name, {{"/", "__"}}),
                     ".raw"),
        std::ios::binary);
    out.write(static_cast<const char*>(t.data_ptr()), t.nbytes());
  }
  if (!fs::exists(HSDP_TORCH_PYTHON)) {
    GTEST_SKIP() << HSDP_TORCH_PYTHON << " (python3 with torch) not found";
  }
  const ShellResult r =
      Shell(absl::StrCat(HSDP_TORCH_PYTHON, " ", HSDP_EXPORT_CHECK, " ", pt,
                         " ", st, " ", expected));
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("tensors equal"));
}

TEST_F(ExportTest, ToolInspectsVerifiesAndNamesAFlippedByte) {
  ShellResult r = Shell(absl::StrCat(HSDP_CKPT_TOOL, " inspect ", root_));
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("step 1  complete"));
  EXPECT_THAT(r.output, HasSubstr("saved on 1x2"));
  EXPECT_THAT(r.output, HasSubstr("optimizer/exp_avg/embed.weight"));
  r = Shell(absl::StrCat(HSDP_CKPT_TOOL, " verify ", dir_));
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("OK"));
  // Flip a byte of the first tensor of shard 0.
  absl::StatusOr<Metadata> m = ReadMetadata(dir_);
  ASSERT_TRUE(m.ok()) << m.status();
  std::string first;
  for (const TensorEntry& t : m->tensors) {
    for (const Chunk& c : t.chunks) {
      if (c.file == "shard-00000-of-00002.bin" && c.offset == 0) first = t.name;
    }
  }
  ASSERT_FALSE(first.empty());
  const std::string file = dir_ + "/shard-00000-of-00002.bin";
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(5);
    f.put('\x7f');
  }
  r = Shell(absl::StrCat(HSDP_CKPT_TOOL, " verify ", dir_));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("checksum mismatch"));
  EXPECT_THAT(r.output, HasSubstr("shard-00000-of-00002.bin"));
  EXPECT_THAT(r.output, HasSubstr("tensor " + first + " "));
}

}  // namespace
}  // namespace hsdp::ckpt::testing
