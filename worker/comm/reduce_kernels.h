// Host-side reduction kernels shared by the CPU backends (Gloo, shared
// memory): half-precision conversions, the arithmetic of each dtype, and the
// local sums behind reduce-scatter / all-reduce. Torch-free on purpose (see
// communicator.h). Stateless: thread-safe.
#ifndef HSDP_WORKER_COMM_REDUCE_KERNELS_H_
#define HSDP_WORKER_COMM_REDUCE_KERNELS_H_

#include <cstddef>
#include <cstdint>

#include "hsdp/communicator.h"

namespace hsdp::comm {

// Round-to-nearest-even conversions (NaN stays NaN, overflow goes to infinity).
float BFloat16ToFloat(uint16_t bits);
uint16_t FloatToBFloat16(float value);
float HalfToFloat(uint16_t bits);
uint16_t FloatToHalf(float value);

// The arithmetic of one dtype: elements stored as Storage, summed and divided
// as Acc (float for bf16/fp16, rounded once on the way back).
template <typename T>
struct NativeArithmetic {
  using Storage = T;
  using Acc = T;
  static Acc Load(Storage v) { return v; }
  static Storage Store(Acc v) { return v; }
};

template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
struct HalfArithmetic {
  using Storage = uint16_t;
  using Acc = float;
  static Acc Load(Storage v) { return ToFloat(v); }
  static Storage Store(Acc v) { return FromFloat(v); }
};

// Calls fn(Arithmetic{}) with the arithmetic of `dtype`, e.g. to read or
// write one element whatever its type:
//   WithArithmetic(dtype, [&](auto a) {
//     using A = decltype(a);
//     *static_cast<typename A::Storage*>(p) = A::Store(1.5f);
//   });
template <typename Fn>
void WithArithmetic(DataType dtype, Fn&& fn) {
  switch (dtype) {
    case DataType::kFloat32:
      return fn(NativeArithmetic<float>{});
    case DataType::kFloat64:
      return fn(NativeArithmetic<double>{});
    case DataType::kInt32:
      return fn(NativeArithmetic<int32_t>{});
    case DataType::kInt64:
      return fn(NativeArithmetic<int64_t>{});
    case DataType::kUInt8:
      return fn(NativeArithmetic<uint8_t>{});
    case DataType::kBFloat16:
      return fn(HalfArithmetic<BFloat16ToFloat, FloatToBFloat16>{});
    case DataType::kFloat16:
      return fn(HalfArithmetic<HalfToFloat, FloatToHalf>{});
  }
}

// out[i] = (chunks[0][i] + chunks[1][i] + ... + chunks[num_chunks-1][i]) [/
// num_chunks for kAvg], where chunk k starts at element k * count of `chunks`.
// Summed left to right, in float for bf16/fp16 and rounded once. `out` may be
// chunk 0 but must not overlap the other chunks.
void ReduceChunks(const void* chunks, int num_chunks, int64_t count,
                  DataType dtype, ReduceOp op, void* out);
// The same over `num_inputs` separate buffers of `count` elements each:
// out = inputs[0] + inputs[1] + ... (left to right, same rounding as
// ReduceChunks). `out` may be exactly one of the inputs (in place) but must not
// otherwise overlap them.
void ReduceBuffers(const void* const* inputs, int num_inputs, int64_t count,
                   DataType dtype, ReduceOp op, void* out);

// out[i] = a[i] + b[i] in `dtype` (the elementwise function Gloo's allreduce
// calls).
void AddBuffers(DataType dtype, void* out, const void* a, const void* b,
                size_t count);

// data[i] /= divisor in `dtype` (integer types truncate).
void DivideBuffer(DataType dtype, void* data, int64_t count, int divisor);

}  // namespace hsdp::comm

#endif  // HSDP_WORKER_COMM_REDUCE_KERNELS_H_
