// The Gloo store adapter: prefixed keys, binary values, and one deadline for
// the adapter's whole life.
#include "worker/comm/gloo/gloo_store.h"

#include <chrono>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "gloo/common/error.h"
#include "gtest/gtest.h"
#include "worker/comm/store/in_memory_store.h"

namespace hsdp::comm {
namespace {

TEST(GlooStoreAdapterTest, PrefixesKeysAndHonoursTimeout) {
  InMemoryStore store;
  GlooStoreAdapter adapter(store, "job/shard/0", absl::Seconds(5));
  adapter.set("3", {'x', '\0', 'y'});
  absl::StatusOr<std::string> raw =
      store.Get("job/shard/0/3", absl::ZeroDuration());
  ASSERT_TRUE(raw.ok()) << raw.status();
  EXPECT_EQ(*raw, std::string("x\0y", 3));
  EXPECT_EQ(adapter.get("3"), std::vector<char>({'x', '\0', 'y'}));
  EXPECT_TRUE(adapter.first_error().ok());

  const absl::Time start = absl::Now();
  EXPECT_THROW(adapter.wait({"3", "4"}, std::chrono::milliseconds(100)),
               gloo::IoException);
  EXPECT_LT(absl::Now() - start,
            absl::Seconds(2));  // not the 5 s default: the override is used
  EXPECT_EQ(adapter.first_error().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(adapter.first_error().message().find("job/shard/0/4"),
            std::string::npos);
}

// One deadline for the adapter's whole life: a rendezvous waiting on several
// absent peers one after another still ends after `timeout`, not a multiple.
TEST(GlooStoreAdapterTest, DeadlineBoundsSuccessiveWaits) {
  constexpr absl::Duration kTimeout = absl::Milliseconds(300);
  InMemoryStore store;
  GlooStoreAdapter adapter(store, "p", kTimeout);
  const absl::Time start = absl::Now();
  EXPECT_THROW(adapter.wait({"1"}), gloo::IoException);
  EXPECT_GE(absl::Now() - start, kTimeout - absl::Milliseconds(50));
  const absl::Time second = absl::Now();
  EXPECT_THROW(adapter.wait({"2"}, std::chrono::seconds(10)),
               gloo::IoException);
  EXPECT_THROW(adapter.get("3"), gloo::IoException);
  EXPECT_LT(absl::Now() - second, absl::Milliseconds(200));
  EXPECT_NE(adapter.first_error().message().find("p/1"), std::string::npos)
      << adapter.first_error();
}

}  // namespace
}  // namespace hsdp::comm
