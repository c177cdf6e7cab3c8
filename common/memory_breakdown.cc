#include "hsdp/memory_breakdown.h"

#include "absl/strings/str_format.h"

namespace hsdp {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;

}  // namespace

int64_t MemoryBreakdown::Total() const {
  return shards + optimizer_state + sharded_grads + unsharded_params +
         unsharded_grads + comm_buffers + activations + other;
}

std::string MemoryBreakdown::ToString() const {
  return absl::StrFormat(
      "total %.2f MiB = shards %.2f + optimizer %.2f + sharded grads %.2f + "
      "unsharded params %.2f + unsharded grads %.2f + comm buffers %.2f + "
      "activations %.2f + other %.2f",
      Total() / kMiB, shards / kMiB, optimizer_state / kMiB,
      sharded_grads / kMiB, unsharded_params / kMiB, unsharded_grads / kMiB,
      comm_buffers / kMiB, activations / kMiB, other / kMiB);
}

}  // namespace hsdp
