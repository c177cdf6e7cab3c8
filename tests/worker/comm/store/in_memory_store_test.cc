// InMemoryStore: blocking gets across threads, waits that name the missing
// keys.
#include "worker/comm/store/in_memory_store.h"

#include <string>
#include <thread>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace hsdp::comm {
namespace {

TEST(InMemoryStoreTest, GetBlocksUntilSetFromAnotherThread) {
  InMemoryStore store;
  std::thread setter([&] {
    absl::SleepFor(absl::Milliseconds(50));
    ASSERT_TRUE(store.Set("a/b", std::string("v\0w", 3)).ok());
  });
  absl::StatusOr<std::string> value = store.Get("a/b", absl::Seconds(10));
  setter.join();
  ASSERT_TRUE(value.ok()) << value.status();
  EXPECT_EQ(*value, std::string("v\0w", 3));  // binary-safe
  EXPECT_EQ(store.size(), 1u);
}

TEST(InMemoryStoreTest, WaitTimesOutNamingMissingKeys) {
  InMemoryStore store;
  ASSERT_TRUE(store.Set("present", "1").ok());
  const absl::Time start = absl::Now();
  absl::Status status =
      store.Wait({"present", "missing/7"}, absl::Milliseconds(100));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(100));
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(status.message().find("missing/7"), std::string::npos) << status;
  EXPECT_EQ(status.message().find("present"), std::string::npos) << status;
  EXPECT_EQ(store.Get("nope", absl::Milliseconds(10)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
}

}  // namespace
}  // namespace hsdp::comm
