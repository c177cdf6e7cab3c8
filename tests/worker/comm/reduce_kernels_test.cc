// The reduction kernels of the CPU backends (half-precision conversions, sums
// in rank order, in place), and the dtype table they switch on.
#include "worker/comm/reduce_kernels.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "gtest/gtest.h"
#include "hsdp/communicator.h"

namespace hsdp::comm {
namespace {

TEST(ReduceKernelsTest, HalfPrecisionConversions) {
  // bf16: exact values, round-to-nearest-even, NaN.
  EXPECT_EQ(FloatToBFloat16(1.0f), 0x3f80);
  EXPECT_EQ(BFloat16ToFloat(0xc000), -2.0f);
  EXPECT_EQ(BFloat16ToFloat(FloatToBFloat16(257.0f)),
            256.0f);  // tie goes to even
  EXPECT_EQ(BFloat16ToFloat(FloatToBFloat16(259.0f)),
            260.0f);  // tie goes to even
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(std::nanf("")))));
  // fp16: normal, subnormal, overflow, infinity, rounding.
  EXPECT_EQ(FloatToHalf(1.0f), 0x3c00);
  EXPECT_EQ(FloatToHalf(-2.5f), 0xc100);
  EXPECT_EQ(HalfToFloat(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -26)),
            0x0000);                         // below half the smallest: zero
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7bff);  // largest finite
  EXPECT_EQ(FloatToHalf(70000.0f), 0x7c00);  // overflow to inf
  EXPECT_EQ(HalfToFloat(0x7c00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(HalfToFloat(FloatToHalf(2049.0f)), 2048.0f);  // tie goes to even
  EXPECT_EQ(HalfToFloat(FloatToHalf(2051.0f)), 2052.0f);
  for (uint32_t bits = 0; bits < 0x7c00;
       ++bits) {  // every finite positive half round-trips
    ASSERT_EQ(FloatToHalf(HalfToFloat(static_cast<uint16_t>(bits))), bits);
  }
}

// In place into any one input (an in-place reduce-scatter sums into the rank's
// own contribution, which is term 1 here), across several tiles: the same bits
// as into a separate buffer.
TEST(ReduceKernelsTest, ReduceBuffersInPlaceIntoAnyInput) {
  constexpr int64_t kCount = 5000;  // more than two tiles
  for (DataType dtype : {DataType::kFloat32, DataType::kBFloat16}) {
    std::vector<std::vector<char>> terms(3);
    for (int k = 0; k < 3; ++k) {
      terms[k].resize(kCount * ElementSize(dtype));
      for (int64_t i = 0; i < kCount; ++i) {
        const float v = 1.0f / static_cast<float>(1 + i + 7 * k);
        if (dtype == DataType::kFloat32) {
          reinterpret_cast<float*>(terms[k].data())[i] = v;
        } else {
          reinterpret_cast<uint16_t*>(terms[k].data())[i] = FloatToBFloat16(v);
        }
      }
    }
    const void* in[3] = {terms[0].data(), terms[1].data(), terms[2].data()};
    std::vector<char> separate(terms[1].size());
    ReduceBuffers(in, 3, kCount, dtype, ReduceOp::kAvg, separate.data());
    ReduceBuffers(in, 3, kCount, dtype, ReduceOp::kAvg, terms[1].data());
    EXPECT_EQ(separate, terms[1]) << DataTypeName(dtype);
  }
}

TEST(ReduceKernelsTest, ReduceChunksSumsInRankOrder) {
  // fp32: ((c0 + c1) + c2) left to right, in place into chunk 0: 1e8 + 1 rounds
  // back to 1e8, so the result is 0 (another order would give 1).
  std::vector<float> chunks = {1e8f, 0.5f, 1.0f, 0.25f, -1e8f, 0.25f};
  ReduceChunks(chunks.data(), 3, 2, DataType::kFloat32, ReduceOp::kSum,
               chunks.data());
  EXPECT_EQ(chunks[0], 0.0f);
  EXPECT_EQ(chunks[1], 1.0f);
  std::vector<double> avg_in = {1, 2, 4, 8};
  double avg_out[2];
  ReduceChunks(avg_in.data(), 2, 2, DataType::kFloat64, ReduceOp::kAvg,
               avg_out);
  EXPECT_EQ(avg_out[0], 2.5);
  EXPECT_EQ(avg_out[1], 5.0);
  // Elementwise add and divide used by all-reduce.
  std::vector<uint16_t> a = {FloatToBFloat16(1.5f)},
                        b = {FloatToBFloat16(2.5f)};
  AddBuffers(DataType::kBFloat16, a.data(), a.data(), b.data(), 1);
  EXPECT_EQ(BFloat16ToFloat(a[0]), 4.0f);
  DivideBuffer(DataType::kBFloat16, a.data(), 1, 8);
  EXPECT_EQ(BFloat16ToFloat(a[0]), 0.5f);
}

TEST(CommunicatorTest, ElementSizesAndNames) {
  EXPECT_EQ(ElementSize(DataType::kBFloat16), 2u);
  EXPECT_EQ(ElementSize(DataType::kFloat64), 8u);
  EXPECT_EQ(ElementSize(DataType::kUInt8), 1u);
  EXPECT_STREQ(DataTypeName(DataType::kFloat16), "float16");
  EXPECT_EQ((Buffer{nullptr, 10, DataType::kInt32}.bytes()), 40u);
}

}  // namespace
}  // namespace hsdp::comm
