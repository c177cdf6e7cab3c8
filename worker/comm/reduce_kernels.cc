#include "worker/comm/reduce_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
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
template <typename T>
void ReduceNative(const void* const* inputs, int num_inputs, int64_t count,
                  ReduceOp op, T* out) {
  T acc[kTileElements];
  const T divisor = static_cast<T>(num_inputs);
  for (int64_t begin = 0; begin < count; begin += kTileElements) {
    const int64_t n = std::min(kTileElements, count - begin);
    std::memcpy(acc, static_cast<const T*>(inputs[0]) + begin,
                static_cast<size_t>(n) * sizeof(T));
    for (int k = 1; k < num_inputs; ++k) {
      const T* in = static_cast<const T*>(inputs[k]) + begin;
      for (int64_t i = 0; i < n; ++i) acc[i] += in[i];
    }
    if (op == ReduceOp::kAvg) {
      for (int64_t i = 0; i < n; ++i) acc[i] /= divisor;
    }
    std::memcpy(out + begin, acc, static_cast<size_t>(n) * sizeof(T));
  }
}

template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
void ReduceHalf(const void* const* inputs, int num_inputs, int64_t count,
                ReduceOp op, uint16_t* out) {
  float acc[kTileElements];
  const float divisor = static_cast<float>(num_inputs);
  for (int64_t begin = 0; begin < count; begin += kTileElements) {
    const int64_t n = std::min(kTileElements, count - begin);
    for (int k = 0; k < num_inputs; ++k) {
      const uint16_t* in = static_cast<const uint16_t*>(inputs[k]) + begin;
      if (k == 0) {
        for (int64_t i = 0; i < n; ++i) acc[i] = ToFloat(in[i]);
      } else {
        for (int64_t i = 0; i < n; ++i) acc[i] += ToFloat(in[i]);
      }
    }
    if (op == ReduceOp::kAvg) {
      for (int64_t i = 0; i < n; ++i) acc[i] /= divisor;
    }
    for (int64_t i = 0; i < n; ++i) out[begin + i] = FromFloat(acc[i]);
  }
}

template <typename T>
void AddNative(void* out, const void* a, const void* b, size_t count) {
  T* o = static_cast<T*>(out);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  for (size_t i = 0; i < count; ++i) o[i] = x[i] + y[i];
}

template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
void AddHalf(void* out, const void* a, const void* b, size_t count) {
  uint16_t* o = static_cast<uint16_t*>(out);
  const uint16_t* x = static_cast<const uint16_t*>(a);
  const uint16_t* y = static_cast<const uint16_t*>(b);
  for (size_t i = 0; i < count; ++i)
    o[i] = FromFloat(ToFloat(x[i]) + ToFloat(y[i]));
}

template <typename T>
void DivideNative(void* data, int64_t count, int divisor) {
  T* d = static_cast<T*>(data);
  const T div = static_cast<T>(divisor);
  for (int64_t i = 0; i < count; ++i) d[i] /= div;
}

template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
void DivideHalf(void* data, int64_t count, int divisor) {
  uint16_t* d = static_cast<uint16_t*>(data);
  const float div = static_cast<float>(divisor);
  for (int64_t i = 0; i < count; ++i) d[i] = FromFloat(ToFloat(d[i]) / div);
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
  switch (dtype) {
    case DataType::kFloat32:
      return ReduceNative(inputs, num_inputs, count, op,
                          static_cast<float*>(out));
    case DataType::kFloat64:
      return ReduceNative(inputs, num_inputs, count, op,
                          static_cast<double*>(out));
    case DataType::kInt32:
      return ReduceNative(inputs, num_inputs, count, op,
                          static_cast<int32_t*>(out));
    case DataType::kInt64:
      return ReduceNative(inputs, num_inputs, count, op,
                          static_cast<int64_t*>(out));
    case DataType::kUInt8:
      return ReduceNative(inputs, num_inputs, count, op,
                          static_cast<uint8_t*>(out));
    case DataType::kBFloat16:
      return ReduceHalf<BFloat16ToFloat, FloatToBFloat16>(
          inputs, num_inputs, count, op, static_cast<uint16_t*>(out));
    case DataType::kFloat16:
      return ReduceHalf<HalfToFloat, FloatToHalf>(inputs, num_inputs, count, op,
                                                  static_cast<uint16_t*>(out));
  }
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
  switch (dtype) {
    case DataType::kFloat32:
      return AddNative<float>(out, a, b, count);
    case DataType::kFloat64:
      return AddNative<double>(out, a, b, count);
    case DataType::kInt32:
      return AddNative<int32_t>(out, a, b, count);
    case DataType::kInt64:
      return AddNative<int64_t>(out, a, b, count);
    case DataType::kUInt8:
      return AddNative<uint8_t>(out, a, b, count);
    case DataType::kBFloat16:
      return AddHalf<BFloat16ToFloat, FloatToBFloat16>(out, a, b, count);
    case DataType::kFloat16:
      return AddHalf<HalfToFloat, FloatToHalf>(out, a, b, count);
  }
}

void DivideBuffer(DataType dtype, void* data, int64_t count, int divisor) {
  switch (dtype) {
    case DataType::kFloat32:
      return DivideNative<float>(data, count, divisor);
    case DataType::kFloat64:
      return DivideNative<double>(data, count, divisor);
    case DataType::kInt32:
      return DivideNative<int32_t>(data, count, divisor);
    case DataType::kInt64:
      return DivideNative<int64_t>(data, count, divisor);
    case DataType::kUInt8:
      return DivideNative<uint8_t>(data, count, divisor);
    case DataType::kBFloat16:
      return DivideHalf<BFloat16ToFloat, FloatToBFloat16>(data, count, divisor);
    case DataType::kFloat16:
      return DivideHalf<HalfToFloat, FloatToHalf>(data, count, divisor);
  }
}

}  // namespace hsdp::comm
