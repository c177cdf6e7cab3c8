// FileStore: values cross process boundaries through the directory, writes are
// atomic, missing keys time out naming them.
#include "worker/comm/store/file_store.h"

#include <fcntl.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <thread>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace hsdp::comm {
namespace {

std::string MakeTempDir() {
  std::string pattern = ::testing::TempDir() + "file_store_XXXXXX";
  EXPECT_NE(::mkdtemp(pattern.data()), nullptr);
  return pattern;
}

TEST(FileStoreTest, SetThenGetIsBinarySafeAndKeysMayHoldAnyByte) {
  absl::StatusOr<FileStore> store = FileStore::Open(MakeTempDir());
  ASSERT_TRUE(store.ok()) << store.status();
  const std::string key("job/shard/0/../3 x\0y", 20);
  ASSERT_TRUE(store->Set(key, std::string("v\0w", 3)).ok());
  ASSERT_TRUE(store->Set("job/shard/0/3", "other").ok());
  absl::StatusOr<std::string> value = store->Get(key, absl::ZeroDuration());
  ASSERT_TRUE(value.ok()) << value.status();
  EXPECT_EQ(*value, std::string("v\0w", 3));
  // Setting again replaces the whole value (the rename is atomic).
  ASSERT_TRUE(store->Set(key, "second").ok());
  EXPECT_EQ(*store->Get(key, absl::ZeroDuration()), "second");
  EXPECT_EQ(*store->Get("job/shard/0/3", absl::ZeroDuration()), "other");
}

TEST(FileStoreTest, GetBlocksUntilAnotherProcessSets) {
  const std::string dir = MakeTempDir();
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // The child opens its own store on the same directory, as a peer would.
    absl::SleepFor(absl::Milliseconds(100));
    absl::StatusOr<FileStore> peer = FileStore::Open(dir);
    const bool ok = peer.ok() && peer->Set("rank/1", "addr-1").ok();
    ::_exit(ok ? 0 : 1);
  }
  absl::StatusOr<FileStore> store = FileStore::Open(dir);
  ASSERT_TRUE(store.ok()) << store.status();
  const absl::Time start = absl::Now();
  absl::StatusOr<std::string> value = store->Get("rank/1", absl::Seconds(20));
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  ASSERT_TRUE(value.ok()) << value.status();
  EXPECT_EQ(*value, "addr-1");
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(50));  // it really waited
}

TEST(FileStoreTest, WaitTimesOutNamingOnlyTheMissingKeys) {
  absl::StatusOr<FileStore> store = FileStore::Open(MakeTempDir());
  ASSERT_TRUE(store.ok()) << store.status();
  ASSERT_TRUE(store->Set("present", "1").ok());
  const absl::Time start = absl::Now();
  absl::Status status =
      store->Wait({"present", "missing/7"}, absl::Milliseconds(100));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(100));
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(status.message().find("missing/7"), std::string::npos) << status;
  EXPECT_EQ(status.message().find("present"), std::string::npos) << status;
  EXPECT_EQ(store->Get("nope", absl::Milliseconds(10)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
}

TEST(FileStoreTest, OpenRefusesAFile) {
  const std::string dir = MakeTempDir();
  const std::string file = dir + "/plain";
  absl::StatusOr<FileStore> store = FileStore::Open(dir);
  ASSERT_TRUE(store.ok());
  ASSERT_TRUE(::close(::creat(file.c_str(), 0600)) == 0);
  EXPECT_EQ(FileStore::Open(file).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(FileStore::Open(dir + "/no/such/parent").ok());
}

}  // namespace
}  // namespace hsdp::comm
