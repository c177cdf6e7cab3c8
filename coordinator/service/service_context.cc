#include "coordinator/service/service_context.h"

#include <grpcpp/server_context.h>

#include <algorithm>
#include <chrono>

#include "absl/time/clock.h"

namespace hsdp::coordinator {

absl::Time LongPollDeadline(const grpc::ServerContext& context,
                            absl::Duration max_wait) {
  const absl::Time cap = absl::Now() + max_wait;
  const auto deadline = context.deadline();
  // gRPC reports "no deadline" as the time_point maximum, which absl cannot
  // convert.
  if (deadline == std::chrono::system_clock::time_point::max()) return cap;
  return std::min(cap, absl::FromChrono(deadline));
}

}  // namespace hsdp::coordinator
