#include "worker/fsdp/flat_buffer_pool.h"

#include <ATen/ATen.h>

#include <utility>

namespace hsdp::fsdp {

at::Tensor FlatBufferPool::Acquire(int64_t numel,
                                   const at::TensorOptions& options) {
  at::Tensor buffer;
  for (auto it = idle_buffers_.begin(); it != idle_buffers_.end(); ++it) {
    if (it->numel() == numel && it->dtype() == options.dtype() &&
        it->device() == options.device()) {
      buffer = std::move(*it);
      idle_buffers_.erase(it);
      idle_ -= static_cast<int64_t>(buffer.nbytes());
      break;
    }
  }
  if (!buffer.defined()) {
    idle_buffers_.clear();
    idle_ = 0;
    buffer = at::empty({numel}, options);
  }
  live_ += static_cast<int64_t>(buffer.nbytes());
  peak_ = std::max(peak_, bytes());
  return buffer;
}

void FlatBufferPool::set_limit(int64_t bytes) {
  limit_ = bytes;
  while (idle_ > limit_ && !idle_buffers_.empty()) {
    idle_ -= static_cast<int64_t>(idle_buffers_.front().nbytes());
    idle_buffers_.erase(idle_buffers_.begin());
  }
}

void FlatBufferPool::Release(at::Tensor& buffer) {
  if (!buffer.defined()) return;
  const int64_t nbytes = static_cast<int64_t>(buffer.nbytes());
  live_ -= nbytes;
  // Reuse is only safe when no view of the bytes survives elsewhere.
  const bool sole_owner =
      buffer.use_count() == 1 && buffer.storage().use_count() == 1;
  if (sole_owner && nbytes <= limit_) {
    while (idle_ + nbytes > limit_ && !idle_buffers_.empty()) {
      idle_ -= static_cast<int64_t>(idle_buffers_.front().nbytes());
      idle_buffers_.erase(idle_buffers_.begin());
    }
    idle_ += nbytes;
    idle_buffers_.push_back(std::move(buffer));
  }
  buffer.reset();
}

}  // namespace hsdp::fsdp
