#include "worker/agent/clock_offset.h"

#include <gtest/gtest.h>

namespace hsdp::agent {
namespace {

TEST(ClockOffsetTest, EmptyUntilTheFirstSample) {
  ClockOffsetEstimator clock;
  EXPECT_FALSE(clock.Estimate().has_value());
}

TEST(ClockOffsetTest, MidpointOfTheRoundTripWithHalfItAsTheBound) {
  ClockOffsetEstimator clock;
  // Sent at 1000, answered at 1400: the server stamped 6200, so its clock is
  // 5000 ahead of this worker's (6200 - 1200), within 200.
  clock.AddSample(1000, 6200, 1400);
  std::optional<ClockOffset> offset = clock.Estimate();
  ASSERT_TRUE(offset.has_value());
  EXPECT_EQ(offset->offset_nanos, 5000);
  EXPECT_LE(offset->error_nanos, 201);
  EXPECT_GE(offset->error_nanos, 200);
}

TEST(ClockOffsetTest, TheShortestRoundTripWins) {
  ClockOffsetEstimator clock;
  clock.AddSample(0, 10'000, 8'000);        // rtt 8000: offset 6000 +- 4000
  clock.AddSample(20'000, 25'100, 20'200);  // rtt 200: offset 5000 +- 100
  clock.AddSample(30'000, 40'000, 34'000);  // rtt 4000
  EXPECT_EQ(clock.Estimate()->offset_nanos, 5000);
}

TEST(ClockOffsetTest, OldSamplesAgeOutAndBadOnesAreIgnored) {
  ClockOffsetEstimator clock;
  clock.AddSample(0, 5'000, 10);  // the best, then aged out
  for (size_t i = 0; i < ClockOffsetEstimator::kWindow; ++i) {
    const int64_t t = 1'000'000 * static_cast<int64_t>(i + 1);
    clock.AddSample(t, t + 7'000 + 500, t + 1000);
  }
  clock.AddSample(100, 1, 50);  // the local clock stepped back: ignored
  EXPECT_EQ(clock.Estimate()->offset_nanos, 7'000);
  EXPECT_GE(clock.Estimate()->error_nanos, 500);
}

}  // namespace
}  // namespace hsdp::agent
