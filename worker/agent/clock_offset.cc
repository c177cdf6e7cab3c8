#include "worker/agent/clock_offset.h"

namespace hsdp::agent {

void ClockOffsetEstimator::AddSample(int64_t send_nanos, int64_t server_nanos,
                                     int64_t recv_nanos) {
  if (recv_nanos < send_nanos || server_nanos <= 0) return;
  const int64_t half_rtt = (recv_nanos - send_nanos) / 2;
  ClockOffset sample{server_nanos - (send_nanos + half_rtt), half_rtt + 1};
  absl::MutexLock lock(&mu_);
  samples_.push_back(sample);
  if (samples_.size() > kWindow) samples_.pop_front();
}

std::optional<ClockOffset> ClockOffsetEstimator::Estimate() const {
  absl::MutexLock lock(&mu_);
  if (samples_.empty()) return std::nullopt;
  ClockOffset best = samples_.front();
  for (const ClockOffset& s : samples_) {
    if (s.error_nanos < best.error_nanos) best = s;
  }
  return best;
}

}  // namespace hsdp::agent
