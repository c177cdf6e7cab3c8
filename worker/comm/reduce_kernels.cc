#include "worker/comm/reduce_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace hsdp::comm {
namespace {

// Reductions run tile by tile through an accumulator small enough to stay in
// L1 (bf16/fp16 accumulate in float).
constexpr int64_t kTileElements = 2048;

uint32_t FloatBits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

float BitsToFloat(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// Tile by tile through an accumulator that stays in L1: `out` may then be any
// one of the inputs exactly (an in-place reduce-scatter sums into this rank's
// own contribution), since each tile is read in full before it is written.
template <typename A>
void ReduceTiles(const void* const* inputs, int num_inputs, int64_t count,
                 ReduceOp op, void* out) {
  using Storage = typename A::Storage;
  using Acc = typename A::Acc;
  Acc acc[kTileElements];
  const Acc divisor = static_cast<Acc>(num_inputs);
  Storage* o = static_cast<Storage*>(out);
  for (int64_t begin = 0; begin < count; begin += kTileElements) {
    const int64_t n = std::min(kTileElements, count - begin);
    const Storage* first = static_cast<const Storage*>(inputs[0]) + begin;
    if constexpr (std::is_same_v<Storage, Acc>) {
      std::memcpy(acc, first, static_cast<size_t>(n) * sizeof(Acc));
    } else {
      for (int64_t i = 0; i < n; ++i) acc[i] = A::Load(first[i]);
    }
    for (int k = 1; k < num_inputs; ++k) {
      const Storage* in = static_cast<const Storage*>(inputs[k]) + begin;
      for (int64_t i = 0; i < n; ++i) acc[i] += A::Load(in[i]);
    }
    if (op == ReduceOp::kAvg) {
      for (int64_t i = 0; i < n; ++i) acc[i] /= divisor;
    }
    if constexpr (std::is_same_v<Storage, Acc>) {
      std::memcpy(o + begin, acc, static_cast<size_t>(n) * sizeof(Acc));
    } else {
      for (int64_t i = 0; i < n; ++i) o[begin + i] = A::Store(acc[i]);
    }
  }
}

}  // namespace

float BFloat16ToFloat(uint16_t bits) {
  return BitsToFloat(static_cast<uint32_t>(bits) << 16);
}

uint16_t FloatToBFloat16(float value) {
  const uint32_t bits = FloatBits(value);
  if (std::isnan(value))
    return static_cast<uint16_t>((bits >> 16) | 0x40);  // keep it a NaN
  const uint32_t round_bias = 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>((bits + round_bias) >> 16);
}

float HalfToFloat(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1f;
  const uint32_t mantissa = bits & 0x3ff;
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24, exact in float.
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 0x1f)
    return BitsToFloat(sign | 0x7f800000 | (mantissa << 13));
  return BitsToFloat(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

uint16_t FloatToHalf(float value) {
  const uint32_t bits = FloatBits(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000);
  uint32_t mantissa = bits & 0x7fffff;
  const int32_t float_exponent = static_cast<int32_t>((bits >> 23) & 0xff);
  if (float_exponent == 0xff) return sign | 0x7c00 | (mantissa ? 0x200 : 0);
  const int32_t exponent = float_exponent - 127 + 15;
  if (exponent >= 0x1f) return sign | 0x7c00;
  if (exponent <= 0) {
    // Subnormal half (or zero): shift the full significand down, rounding to
    // nearest even.
    if (exponent < -10) return sign;
    mantissa |= 0x800000;
    const int shift = 14 - exponent;
    uint32_t half_mantissa = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (rest > halfway || (rest == halfway && (half_mantissa & 1)))
      ++half_mantissa;
    return static_cast<uint16_t>(sign | half_mantissa);
  }
  uint32_t half =
      sign | (static_cast<uint32_t>(exponent) << 10) | (mantissa >> 13);
  const uint32_t rest = mantissa & 0x1fff;
  // A carry out of the mantissa correctly bumps the exponent (up to infinity).
  if (rest > 0x1000 || (rest == 0x1000 && (half & 1))) ++half;
  return static_cast<uint16_t>(half);
}

void ReduceBuffers(const void* const* inputs, int num_inputs, int64_t count,
                   DataType dtype, ReduceOp op, void* out) {
  if (num_inputs < 1 || count <= 0) return;
  WithArithmetic(dtype, [&](auto arithmetic) {
    ReduceTiles<decltype(arithmetic)>(inputs, num_inputs, count, op, out);
  });
}

void ReduceChunks(const void* chunks, int num_chunks, int64_t count,
                  DataType dtype, ReduceOp op, void* out) {
  std::vector<const void*> inputs(static_cast<size_t>(num_chunks));
  const size_t chunk_bytes = static_cast<size_t>(count) * ElementSize(dtype);
  for (int k = 0; k < num_chunks; ++k)
    inputs[k] = static_cast<const char*>(chunks) + k * chunk_bytes;
  ReduceBuffers(inputs.data(), num_chunks, count, dtype, op, out);
}

void AddBuffers(DataType dtype, void* out, const void* a, const void* b,
                size_t count) {
  WithArithmetic(dtype, [&](auto arithmetic) {
    using A = decltype(arithmetic);
    using Storage = typename A::Storage;
    Storage* o = static_cast<Storage*>(out);
    const Storage* x = static_cast<const Storage*>(a);
    const Storage* y = static_cast<const Storage*>(b);
    for (size_t i = 0; i < count; ++i)
      o[i] = A::Store(A::Load(x[i]) + A::Load(y[i]));
  });
}

void DivideBuffer(DataType dtype, void* data, int64_t count, int divisor) {
  WithArithmetic(dtype, [&](auto arithmetic) {
    using A = decltype(arithmetic);
    using Storage = typename A::Storage;
    Storage* d = static_cast<Storage*>(data);
    const typename A::Acc div = static_cast<typename A::Acc>(divisor);
    for (int64_t i = 0; i < count; ++i) d[i] = A::Store(A::Load(d[i]) / div);
  });
}

}  // namespace hsdp::comm
