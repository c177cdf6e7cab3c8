// Checkpoints load on any mesh: saved on 2x2, loaded on 1x1, 1x2, 1x3, 2x1,
// 1x4 and 2x4, every parameter and optimizer moment is bitwise the saved one;
// training continued at 1x3 from a 2x2 checkpoint matches a reference run on
// the same global batch. Ranks are threads over loopback Gloo.
#include <gtest/gtest.h>

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "tests/worker/ckpt/ckpt_test_util.h"
#include "worker/ckpt/state.h"

namespace hsdp::ckpt::testing {
namespace {

using fsdp::testing::MakeInitialState;
using fsdp::testing::RankContext;
using fsdp::testing::RunConfig;
using fsdp::testing::RunOnMesh;
using fsdp::testing::StateDict;

constexpr int kGlobalBatch = 12;  // divides 1, 2, 3, 4 ranks

struct Saved {
  std::map<std::string, at::Tensor> state;  // params and moments, full
  std::map<std::string, int64_t> steps;
};

// Trains `steps` steps on 2x2 and saves asynchronously after the last; then
// trains one more step while the write is in flight (the checkpoint must hold
// the state at the save).
Saved SaveOn2x2(const std::string& root, int steps) {
  const StateDict init = MakeInitialState(RunConfig().dims, 1);
  GlobalState global;
  Saved saved;
  absl::Mutex mu;
  RankBarrier barrier(4);
  RunOnMesh({2, 2}, [&](RankContext& ctx) {
    Trainer t(ctx, init, RunConfig());
    for (int s = 0; s < steps; ++s) t.Step(s, kGlobalBatch);
    std::map<std::string, int64_t> step_counts;
    std::vector<LocalTensor> state = t.State(&step_counts);
    std::vector<LocalTensor> copies;
    for (const LocalTensor& l : state)
      copies.push_back(
          {l.name, l.tensor.clone(), l.global_shape, l.row_offset});
    global.Add(copies);
    {
      absl::MutexLock lock(&mu);
      saved.steps = step_counts;
    }
    CheckpointSaver saver(SaverOptionsFor(ctx, root, /*async=*/true, 0));
    absl::Status s = SaveOnRank(t, saver, steps - 1, barrier);
    ASSERT_TRUE(s.ok()) << s;
    t.Step(steps, kGlobalBatch);  // changes every shard during the write
    s = saver.Wait();
    ASSERT_TRUE(s.ok()) << s;
  });
  saved.state = global.tensors();
  return saved;
}

class ReshardTest : public ::testing::TestWithParam<std::tuple<int, int>> {
 protected:
  static void SetUpTestSuite() {
    root_ = new std::string(TempDir("reshard"));
    saved_ = new Saved(SaveOn2x2(*root_, 2));
  }
  static void TearDownTestSuite() {
    std::filesystem::remove_all(*root_);
    delete saved_;
    delete root_;
  }
  static std::string* root_;
  static Saved* saved_;
};
std::string* ReshardTest::root_ = nullptr;
Saved* ReshardTest::saved_ = nullptr;

TEST_P(ReshardTest, FullStateBitwiseEqualAfterLoad) {
  const auto [replicate, shard] = GetParam();
  ASSERT_FALSE(saved_->state.empty());
  // A different init: everything must come from the checkpoint.
  const StateDict other = MakeInitialState(RunConfig().dims, 99);
  std::atomic<int64_t> read{0}, needed{0};
  RunOnMesh({replicate, shard}, [&](RankContext& ctx) {
    Trainer t(ctx, other, RunConfig());
    ReadStats stats;
    absl::Status s = LoadOnRank(t, *root_, &stats);
    ASSERT_TRUE(s.ok()) << s;
    read += stats.bytes_read;
    needed += stats.bytes_needed;
    std::map<std::string, int64_t> steps;
    const std::vector<LocalTensor> state = t.State(&steps);
    // Parameters and exp_avg / exp_avg_sq of every parameter.
    EXPECT_EQ(state.size(), saved_->state.size());
    for (const LocalTensor& l : state) {
      auto it = saved_->state.find(l.name);
      ASSERT_NE(it, saved_->state.end()) << l.name;
      const at::Tensor want =
          it->second.narrow(0, l.row_offset, l.tensor.size(0));
      EXPECT_TRUE(at::equal(l.tensor, want))
          << l.name << " rows from " << l.row_offset << " on rank " << ctx.rank;
    }
    for (const auto& [name, step] : steps) {
      EXPECT_EQ(step, saved_->steps.at(name)) << name;
    }
  });
  // Whole 1 MiB blocks at most at each end of each chunk: here every tensor is
  // one block, so a rank reads at most what overlapping chunks hold.
  EXPECT_GE(read.load(), needed.load());
  RecordProperty("bytes_read", std::to_string(read.load()));
  RecordProperty("bytes_needed", std::to_string(needed.load()));
}

INSTANTIATE_TEST_SUITE_P(
    Meshes, ReshardTest,
    ::testing::Values(std::make_tuple(1, 1), std::make_tuple(1, 2),
                      std::make_tuple(1, 3), std::make_tuple(2, 1),
                      std::make_tuple(1, 4), std::make_tuple(2, 2),
                      std::make_tuple(2, 4)),
    [](const auto& info) {
      return absl::StrCat(std::get<0>(info.param), "x",
                          std::get<1>(info.param));
    });

TEST(ReshardContinueTest, ContinuingAt1x3From2x2MatchesReference) {
  constexpr int kSteps = 4;
  constexpr int kSaveAfter = 2;
  const std::string root = TempDir("continue");
  const StateDict init = MakeInitialState(RunConfig().dims, 1);
  RankBarrier barrier(4);
  RunOnMesh({2, 2}, [&](RankContext& ctx) {
    Trainer t(ctx, init, RunConfig());
    for (int s = 0; s < kSaveAfter; ++s) t.Step(s, kGlobalBatch);
    CheckpointSaver saver(SaverOptionsFor(ctx, root, /*async=*/false, 0));
    absl::Status st = SaveOnRank(t, saver, kSaveAfter - 1, barrier);
    ASSERT_TRUE(st.ok()) << st;
  });
  StateDict resumed;
  RunOnMesh({1, 3}, [&](RankContext& ctx) {
    Trainer t(ctx, MakeInitialState(RunConfig().dims, 7), RunConfig());
    absl::Status st = LoadOnRank(t, root);
    ASSERT_TRUE(st.ok()) << st;
    // The data position: the step after the checkpoint, same global batch.
    for (int s = kSaveAfter; s < kSteps; ++s) t.Step(s, kGlobalBatch);
    absl::StatusOr<StateDict> full = fsdp::FullStateDict(*t.engine);
    ASSERT_TRUE(full.ok()) << full.status();
    if (ctx.rank == 0) resumed = *full;
  });
  RunConfig config;
  config.steps = kSteps;
  config.global_batch = kGlobalBatch;
  const fsdp::testing::RunResult reference =
      fsdp::testing::TrainReference(init, config);
  ASSERT_FALSE(resumed.empty());
  // The tolerance of the engine's own parity tests: sums in another order.
  EXPECT_LE(fsdp::testing::MaxAbsDiff(resumed, reference.params), 1e-5);
  // And it moved: the reference after kSteps differs from init.
  EXPECT_GT(fsdp::testing::MaxAbsDiff(reference.params, init), 1e-3);
}

}  // namespace
}  // namespace hsdp::ckpt::testing
