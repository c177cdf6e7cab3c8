// Flat communication buffers kept for reuse. On CPU a fresh buffer per
// collective costs a page fault per 4 KiB — as much time as the collective
// itself — so units hand their buffers back here. At most `limit` idle bytes
// are kept (one largest unit's or fusion group's flat buffers); live
// (acquired) and idle bytes are both accounted. A request no idle buffer fits
// drops the idle ones first: they would otherwise stay alive next to the new
// buffer (e.g. root's small buffer next to a block's).
//
// Thread-compatible: owned by the EngineCore, used on the one thread driving
// the engine.
#ifndef HSDP_WORKER_FSDP_FLAT_BUFFER_POOL_H_
#define HSDP_WORKER_FSDP_FLAT_BUFFER_POOL_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace hsdp::fsdp {

class FlatBufferPool {
 public:
  FlatBufferPool() = default;
  FlatBufferPool(const FlatBufferPool&) = delete;
  FlatBufferPool& operator=(const FlatBufferPool&) = delete;

  at::Tensor Acquire(int64_t numel, const at::TensorOptions& options);
  // Takes the buffer back (resetting `buffer`); it is kept for reuse only when
  // nothing else references its storage, else simply dropped. An undefined
  // buffer is a no-op.
  void Release(at::Tensor& buffer);
  // Idle bytes kept at most; idle buffers over a lowered limit go (oldest
  // first).
  void set_limit(int64_t bytes);
  int64_t bytes() const { return live_ + idle_; }
  int64_t peak_bytes() const { return peak_; }
  void ResetPeak() { peak_ = bytes(); }

 private:
  std::vector<at::Tensor> idle_buffers_;  // oldest first
  int64_t live_ = 0;
  int64_t idle_ = 0;
  int64_t peak_ = 0;
  int64_t limit_ = 0;
};

}  // namespace hsdp::fsdp

#endif  // HSDP_WORKER_FSDP_FLAT_BUFFER_POOL_H_
