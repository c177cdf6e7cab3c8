#include "coordinator/core/state_store.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "hsdp/v1/schedule.pb.h"
#include "tests/coordinator/core_test_util.h"

namespace hsdp::coordinator {
namespace {

namespace fs = std::filesystem;
using testing::FreshDir;

std::string StepBytes(int64_t step, int64_t generation = 0) {
  hsdp::v1::StepSchedule schedule;
  schedule.set_step(step);
  schedule.set_generation(generation);
  schedule.set_policy_version(1);
  schedule.add_units()->set_unit_name("root");
  return schedule.SerializeAsString();
}

void WriteRaw(const fs::path& path, const std::string& contents) {
  std::ofstream out(path, std::ios::binary);
  out << contents;
}

TEST(StateStoreTest, EmptyDirectoryStartsEmpty) {
  absl::StatusOr<std::unique_ptr<StateStore>> store =
      StateStore::Open(FreshDir("s"));
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_FALSE((*store)->state().has_job());
  EXPECT_TRUE((*store)->SealedSteps().empty());
}

// Regression: nothing locked the directory, so a second coordinator started on
// it and its start-up clean-up of *.tmp files could delete the first one's
// write in flight.
TEST(StateStoreTest, SecondOpenOfALockedDirectoryIsRefusedAndTouchesNothing) {
  const std::string dir = FreshDir("s");
  auto first = StateStore::Open(dir);
  ASSERT_TRUE(first.ok()) << first.status();
  // What the first store's write in flight looks like on disk.
  const fs::path in_flight = fs::path(dir) / "state.binpb.tmp";
  WriteRaw(in_flight, "partial");

  auto second = StateStore::Open(dir);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(second.status().message().find("in use by another coordinator"),
            std::string::npos)
      << second.status();
  EXPECT_NE(second.status().message().find(std::to_string(::getpid())),
            std::string::npos)
      << second.status();
  EXPECT_TRUE(fs::exists(in_flight)) << "the refused open removed a .tmp file";
  ASSERT_TRUE(
      (*first)->Update([](PersistedState* s) { s->set_generation(4); }).ok());

  // The lock goes with the store.
  first->reset();
  auto third = StateStore::Open(dir);
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_EQ((*third)->state().generation(), 4);
  EXPECT_FALSE(fs::exists(in_flight));
}

TEST(StateStoreTest, RoundTripsStateAndSealedSteps) {
  const std::string dir = FreshDir("s");
  {
    auto store = StateStore::Open(dir);
    ASSERT_TRUE(store.ok()) << store.status();
    ASSERT_TRUE((*store)
                    ->Update([](PersistedState* s) {
                      s->mutable_job()->set_job_id("job-1");
                      s->set_generation(3);
                      auto* p = s->add_policies();
                      p->set_version(2);
                      p->set_effective_step(5);
                      p->mutable_policy()->set_microbatches(4);
                      s->set_drain_step(9);
                    })
                    .ok());
    ASSERT_TRUE((*store)->SaveSealedStep(0, 0, StepBytes(0)).ok());
    ASSERT_TRUE((*store)->SaveSealedStep(1, 0, StepBytes(1)).ok());
  }
  auto store = StateStore::Open(dir);
  ASSERT_TRUE(store.ok()) << store.status();
  const PersistedState state = (*store)->state();
  EXPECT_EQ(state.job().job_id(), "job-1");
  EXPECT_EQ(state.generation(), 3);
  ASSERT_EQ(state.policies_size(), 1);
  EXPECT_EQ(state.policies(0).effective_step(), 5);
  EXPECT_EQ(state.policies(0).policy().microbatches(), 4);
  EXPECT_EQ(state.drain_step(), 9);
  const auto steps = (*store)->SealedSteps();
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_EQ(steps.at({0, 0}), StepBytes(0));
  EXPECT_EQ(steps.at({1, 0}), StepBytes(1));
}

// A step sealed again in a later generation is a second record in its own
// file; both come back, and a file whose name and contents disagree on the
// generation is DATA_LOSS.
TEST(StateStoreTest, OneRecordPerStepAndGeneration) {
  const std::string dir = FreshDir("s");
  {
    auto store = StateStore::Open(dir);
    ASSERT_TRUE(store.ok());
    ASSERT_TRUE((*store)->SaveSealedStep(7, 0, StepBytes(7, 0)).ok());
    ASSERT_TRUE((*store)->SaveSealedStep(7, 2, StepBytes(7, 2)).ok());
    EXPECT_EQ((*store)->SaveSealedStep(7, 2, StepBytes(8, 2)).code(),
              absl::StatusCode::kFailedPrecondition);
  }
  EXPECT_TRUE(fs::exists(fs::path(dir) / "steps" / "000000000007.binpb"));
  EXPECT_TRUE(fs::exists(fs::path(dir) / "steps" / "000000000007-g2.binpb"));
  auto store = StateStore::Open(dir);
  ASSERT_TRUE(store.ok()) << store.status();
  const auto steps = (*store)->SealedSteps();
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_EQ(steps.at({7, 0}), StepBytes(7, 0));
  EXPECT_EQ(steps.at({7, 2}), StepBytes(7, 2));
  store->reset();  // releases the directory's lock
  WriteRaw(fs::path(dir) / "steps" / "000000000009-g3.binpb", StepBytes(9, 4));
  EXPECT_EQ(StateStore::Open(dir).status().code(), absl::StatusCode::kDataLoss);
}

TEST(StateStoreTest, CommitPointRoundTrips) {
  const std::string dir = FreshDir("s");
  {
    auto store = StateStore::Open(dir);
    ASSERT_TRUE(store.ok());
    EXPECT_FALSE((*store)->commit_point().has_value());
    state::CommitPoint point;
    point.set_generation(3);
    point.set_step(41);
    point.set_committed_in_generation(5);
    ASSERT_TRUE((*store)->SaveCommitPoint(point).ok());
    point.set_step(42);
    point.set_committed_in_generation(6);
    ASSERT_TRUE((*store)->SaveCommitPoint(point).ok());
  }
  auto store = StateStore::Open(dir);
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE((*store)->commit_point().has_value());
  EXPECT_EQ((*store)->commit_point()->generation(), 3);
  EXPECT_EQ((*store)->commit_point()->step(), 42);
  EXPECT_EQ((*store)->commit_point()->committed_in_generation(), 6);
  store->reset();  // releases the directory's lock
  WriteRaw(fs::path(dir) / "commit.binpb", std::string("\x0a\x05"
                                                       "ab"));  // truncated
  EXPECT_EQ(StateStore::Open(dir).status().code(), absl::StatusCode::kDataLoss);
}

// A write that fails (here: its temp file's name is taken by a directory, as
// a full disk would fail it) keeps the previous commit point and says so on
// stderr once; the first write that succeeds after it says so too.
TEST(StateStoreTest, AFailedWriteKeepsThePreviousStateAndIsLoggedOnce) {
  const std::string dir = FreshDir("s");
  auto store = StateStore::Open(dir);
  ASSERT_TRUE(store.ok());
  state::CommitPoint point;
  point.set_step(1);
  ASSERT_TRUE((*store)->SaveCommitPoint(point).ok());
  const fs::path blocker = fs::path(dir) / "commit.binpb.tmp";
  fs::create_directory(blocker);
  ::testing::internal::CaptureStderr();
  point.set_step(2);
  EXPECT_FALSE((*store)->SaveCommitPoint(point).ok());
  point.set_step(3);
  EXPECT_FALSE((*store)->SaveCommitPoint(point).ok());
  const std::string failing = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ((*store)->commit_point()->step(), 1);
  EXPECT_EQ(std::count(failing.begin(), failing.end(), '\n'), 1) << failing;
  EXPECT_NE(failing.find("cannot write the state directory"), std::string::npos)
      << failing;
  fs::remove(blocker);
  ::testing::internal::CaptureStderr();
  ASSERT_TRUE((*store)->SaveCommitPoint(point).ok());
  ASSERT_TRUE((*store)->SaveCommitPoint(point).ok());
  const std::string recovered = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(std::count(recovered.begin(), recovered.end(), '\n'), 1)
      << recovered;
  EXPECT_NE(recovered.find("writable again"), std::string::npos) << recovered;
  EXPECT_EQ((*store)->commit_point()->step(), 3);
}

TEST(StateStoreTest, SealedStepsAreImmutable) {
  auto store = StateStore::Open(FreshDir("s"));
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE((*store)->SaveSealedStep(4, 0, StepBytes(4)).ok());
  EXPECT_TRUE((*store)->SaveSealedStep(4, 0, StepBytes(4)).ok());
  EXPECT_EQ((*store)->SaveSealedStep(4, 0, StepBytes(5)).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*store)->SealedSteps().at({4, 0}), StepBytes(4));
}

// A crash mid-write leaves "<file>.tmp" behind; the previous contents must win.
TEST(StateStoreTest, IgnoresHalfWrittenTempFilesAfterCrash) {
  const std::string dir = FreshDir("s");
  {
    auto store = StateStore::Open(dir);
    ASSERT_TRUE(store.ok());
    ASSERT_TRUE(
        (*store)->Update([](PersistedState* s) { s->set_generation(7); }).ok());
    ASSERT_TRUE((*store)->SaveSealedStep(0, 0, StepBytes(0)).ok());
  }
  const std::string half = StepBytes(1).substr(0, 3);
  WriteRaw(fs::path(dir) / "state.binpb.tmp", "\x10\x63garbage-half-written");
  WriteRaw(fs::path(dir) / "steps" / "000000000001.binpb.tmp", half);

  auto store = StateStore::Open(dir);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ((*store)->state().generation(), 7);
  EXPECT_EQ((*store)->SealedSteps().size(), 1u);
  EXPECT_FALSE(fs::exists(fs::path(dir) / "state.binpb.tmp"));
  EXPECT_FALSE(fs::exists(fs::path(dir) / "steps" / "000000000001.binpb.tmp"));
  // The store keeps working after the recovery.
  ASSERT_TRUE((*store)->SaveSealedStep(1, 0, StepBytes(1)).ok());
  EXPECT_EQ((*store)->SealedSteps().at({1, 0}), StepBytes(1));
}

TEST(StateStoreTest, CorruptFilesAreDataLoss) {
  const std::string dir = FreshDir("s");
  ASSERT_TRUE(StateStore::Open(dir).ok());
  WriteRaw(fs::path(dir) / "state.binpb", "\xff\xff\xff");
  EXPECT_EQ(StateStore::Open(dir).status().code(), absl::StatusCode::kDataLoss);

  const std::string dir2 = FreshDir("s2");
  ASSERT_TRUE(StateStore::Open(dir2).ok());
  // A step file whose contents claim another step.
  WriteRaw(fs::path(dir2) / "steps" / "000000000002.binpb", StepBytes(3));
  absl::Status s = StateStore::Open(dir2).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("000000000002.binpb"), std::string::npos) << s;
}

// Step files are written with a header (length, CRC-32C); files from before it
// (the bare message) still load.
TEST(StateStoreTest, StepFilesWithoutAHeaderStillLoad) {
  const std::string dir = FreshDir("s");
  {
    auto store = StateStore::Open(dir);
    ASSERT_TRUE(store.ok());
    ASSERT_TRUE((*store)->SaveSealedStep(0, 0, StepBytes(0)).ok());
    std::ifstream in((*store)->SealedStepPath(0, 0), std::ios::binary);
    const std::string written((std::istreambuf_iterator<char>(in)), {});
    EXPECT_EQ(written.size(), StepBytes(0).size() + 16);
    EXPECT_EQ(written.front(), '\0');
  }
  WriteRaw(fs::path(dir) / "steps" / "000000000001.binpb", StepBytes(1));
  auto store = StateStore::Open(dir);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ((*store)->SealedSteps().at({0, 0}), StepBytes(0));
  EXPECT_EQ((*store)->SealedSteps().at({1, 0}), StepBytes(1));
}

// The operator's truncation moves the later files aside (never deletes), and
// refuses to drop a committed step.
TEST(StateStoreTest, TruncateSealedStepsMovesLaterFilesAside) {
  const std::string dir = FreshDir("s");
  {
    auto store = StateStore::Open(dir);
    ASSERT_TRUE(store.ok());
    for (int64_t step = 0; step < 4; ++step) {
      ASSERT_TRUE((*store)->SaveSealedStep(step, 0, StepBytes(step)).ok());
    }
    ASSERT_TRUE((*store)->SaveSealedStep(3, 1, StepBytes(3, 1)).ok());
    state::CommitPoint point;
    point.set_step(1);
    ASSERT_TRUE((*store)->SaveCommitPoint(point).ok());
    EXPECT_EQ((*store)->TruncateSealedSteps(0).status().code(),
              absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ((*store)->SealedSteps().size(), 5u);
    absl::StatusOr<int> moved = (*store)->TruncateSealedSteps(1);
    ASSERT_TRUE(moved.ok()) << moved.status();
    EXPECT_EQ(*moved, 3);
    EXPECT_EQ((*store)->SealedSteps().size(), 2u);
    EXPECT_FALSE(fs::exists((*store)->SealedStepPath(2, 0)));
  }
  auto store = StateStore::Open(dir);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ((*store)->SealedSteps().size(), 2u);
  int aside = 0;
  for (const auto& entry : fs::recursive_directory_iterator(dir)) {
    const std::string path = entry.path().string();
    if (path.find("/truncated-") != std::string::npos &&
        entry.is_regular_file()) {
      ++aside;
    }
  }
  EXPECT_EQ(aside, 3);
}

TEST(StateStoreTest, FailedUpdateKeepsPreviousState) {
  const std::string dir = FreshDir("s");
  auto store = StateStore::Open(dir);
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE(
      (*store)->Update([](PersistedState* s) { s->set_generation(1); }).ok());
  // Make the directory unwritable: a directory where the temp file should go.
  fs::create_directory(fs::path(dir) / "state.binpb.tmp");
  fs::create_directory(fs::path(dir) / "state.binpb.tmp" / "x");
  EXPECT_FALSE(
      (*store)->Update([](PersistedState* s) { s->set_generation(2); }).ok());
  EXPECT_EQ((*store)->state().generation(), 1);
  fs::remove_all(fs::path(dir) / "state.binpb.tmp");
}

TEST(StateStoreTest, NoOpUpdateDoesNotWrite) {
  const std::string dir = FreshDir("s");
  auto store = StateStore::Open(dir);
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE(
      (*store)->Update([](PersistedState* s) { s->set_generation(4); }).ok());
  const fs::path state_file = fs::path(dir) / "state.binpb";
  fs::remove(state_file);
  ASSERT_TRUE(
      (*store)->Update([](PersistedState* s) { s->set_generation(4); }).ok());
  EXPECT_FALSE(fs::exists(state_file));
  ASSERT_TRUE(
      (*store)->Update([](PersistedState* s) { s->set_generation(5); }).ok());
  EXPECT_TRUE(fs::exists(state_file));
}

TEST(StateStoreTest, EmptyDirIsInvalid) {
  EXPECT_EQ(StateStore::Open("").status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace hsdp::coordinator
