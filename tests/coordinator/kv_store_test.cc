#include "coordinator/core/kv_store.h"

#include <gtest/gtest.h>

#include <thread>

#include "absl/time/clock.h"

namespace hsdp::coordinator {
namespace {

constexpr absl::Duration kShort = absl::Milliseconds(50);
constexpr absl::Duration kLong = absl::Seconds(10);

TEST(KvStoreTest, SetThenGet) {
  KvStore store;
  ASSERT_TRUE(store.Set("job", 0, "a", "1").ok());
  absl::StatusOr<std::string> v =
      store.Get("job", 0, "a", absl::ZeroDuration());
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "1");
  ASSERT_TRUE(store.Set("job", 0, "a", "2").ok());  // overwrite
  EXPECT_EQ(*store.Get("job", 0, "a", kShort), "2");
  EXPECT_EQ(store.KeyCount("job", 0), 1u);
}

TEST(KvStoreTest, GetTimesOut) {
  KvStore store;
  const absl::Time start = absl::Now();
  absl::StatusOr<std::string> v = store.Get("job", 0, "missing", kShort);
  EXPECT_EQ(v.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(v.status().message().find("missing"), std::string::npos);
  EXPECT_GE(absl::Now() - start, kShort);
}

TEST(KvStoreTest, GetBlocksUntilSet) {
  KvStore store;
  absl::StatusOr<std::string> got;
  std::thread reader([&] { got = store.Get("job", 3, "addr", kLong); });
  absl::SleepFor(absl::Milliseconds(30));
  ASSERT_TRUE(store.Set("job", 3, "addr", "10.0.0.1:1234").ok());
  reader.join();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "10.0.0.1:1234");
}

TEST(KvStoreTest, WaitForSeveralKeysNamesMissingOne) {
  KvStore store;
  ASSERT_TRUE(store.Set("job", 0, "k0", "").ok());
  absl::Status s = store.Wait("job", 0, {"k0", "k1"}, kShort);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(s.message().find("k1"), std::string::npos) << s;

  absl::Status waited;
  std::thread waiter([&] {
    waited = store.Wait("job", 0, {"k0", "k1", "k2"}, kLong);
  });
  ASSERT_TRUE(store.Set("job", 0, "k1", "x").ok());
  ASSERT_TRUE(store.Set("job", 0, "k2", "y").ok());
  waiter.join();
  EXPECT_TRUE(waited.ok()) << waited;
}

TEST(KvStoreTest, ScopedByJobAndGeneration) {
  KvStore store;
  ASSERT_TRUE(store.Set("job", 1, "k", "gen1").ok());
  EXPECT_EQ(store.Get("job", 2, "k", absl::ZeroDuration()).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(store.Get("other", 1, "k", absl::ZeroDuration()).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  ASSERT_TRUE(store.Set("job", 2, "k", "gen2").ok());
  EXPECT_EQ(*store.Get("job", 1, "k", absl::ZeroDuration()), "gen1");
  store.DropGenerationsBefore("job", 2);
  EXPECT_EQ(store.KeyCount("job", 1), 0u);
  EXPECT_EQ(*store.Get("job", 2, "k", absl::ZeroDuration()), "gen2");
}

TEST(KvStoreTest, RejectsBadKeysAndValues) {
  KvStore store;
  EXPECT_EQ(store.Set("job", 0, "", "v").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      store.Set("job", 0, std::string(kMaxKvKeyBytes + 1, 'k'), "v").code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      store.Set("job", 0, "k", std::string(kMaxKvValueBytes + 1, 'v')).code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store.KeyCount("job", 0), 0u);
}

// Regression: StoreSet refused an empty key but StoreGet of one waited out its
// whole timeout. A key Set can never accept is refused at once by every call.
TEST(KvStoreTest, GetAndWaitRefuseKeysSetWouldRefuseAtOnce) {
  KvStore store;
  const absl::Time start = absl::Now();
  absl::StatusOr<std::string> got = store.Get("job", 0, "", kLong);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(got.status().message().find("empty"), std::string::npos);
  EXPECT_EQ(store.Wait("job", 0, {"a", ""}, kLong).code(),
            absl::StatusCode::kInvalidArgument);
  const std::string huge(kMaxKvKeyBytes + 1, 'k');
  EXPECT_EQ(store.Get("job", 0, huge, kLong).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
}

TEST(KvStoreTest, RefusalsNameTheLimitAndChangeNothing) {
  KvStore::Limits limits;
  limits.max_key_bytes = 8;
  limits.max_value_bytes = 16;
  limits.max_keys_per_scope = 3;
  limits.max_bytes_per_scope = 40;
  KvStore store(limits);
  ASSERT_TRUE(store.Set("job", 0, "a", "0123456789").ok());  // 11 bytes
  ASSERT_TRUE(store.Set("job", 0, "b", "0123456789").ok());  // 22 bytes

  absl::Status key = store.Set("job", 0, "123456789", "v");
  EXPECT_EQ(key.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(key.message().find("limit is 8 bytes per key"), std::string::npos)
      << key;
  absl::Status value = store.Set("job", 0, "c", std::string(17, 'v'));
  EXPECT_EQ(value.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(value.message().find("limit is 16 bytes per value"),
            std::string::npos)
      << value;
  // 22 + 1 + 16 = 39 bytes fits; a 4th key does not.
  ASSERT_TRUE(store.Set("job", 0, "c", std::string(16, 'v')).ok());
  absl::Status keys = store.Set("job", 0, "d", "");
  EXPECT_EQ(keys.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(keys.message().find("limit is 3 keys per generation"),
            std::string::npos)
      << keys;
  // Overwriting "a" with a longer value would pass 40 bytes in the scope.
  absl::Status total = store.Set("job", 0, "a", "0123456789ab");
  EXPECT_EQ(total.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(total.message().find("limit is 40 bytes per generation"),
            std::string::npos)
      << total;
  // Nothing above changed the store.
  EXPECT_EQ(store.KeyCount("job", 0), 3u);
  EXPECT_EQ(store.ByteCount("job", 0), 39u);
  EXPECT_EQ(*store.Get("job", 0, "a", absl::ZeroDuration()), "0123456789");
  // A shorter overwrite frees bytes; another generation has its own budget.
  ASSERT_TRUE(store.Set("job", 0, "a", "0").ok());
  EXPECT_EQ(store.ByteCount("job", 0), 30u);
  ASSERT_TRUE(store.Set("job", 1, "d", "").ok());
  absl::Status wait = store.Wait("job", 0, {"a", "b", "c", "d"}, kShort);
  EXPECT_EQ(wait.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(wait.message().find("limit is 3 keys"), std::string::npos) << wait;
}

TEST(KvStoreTest, ShutdownWakesWaiters) {
  KvStore store;
  absl::StatusOr<std::string> got;
  std::thread reader([&] { got = store.Get("job", 0, "never", kLong); });
  absl::SleepFor(absl::Milliseconds(30));
  const absl::Time start = absl::Now();
  store.Shutdown();
  reader.join();
  EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(store.Wait("job", 0, {"x"}, kLong).code(),
            absl::StatusCode::kUnavailable);
}

TEST(KvStoreTest, RendezvousPrefix) {
  EXPECT_EQ(RendezvousPrefix("job-1", 3), "hsdp/job-1/gen-3/");
}

}  // namespace
}  // namespace hsdp::coordinator
