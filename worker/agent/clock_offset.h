// Estimates the coordinator's clock relative to this worker's from request
// round trips (NTP's way): a reply stamped `server` by the coordinator,
// sent at `send` and received at `recv` on this worker, gives
// offset = server - (send + recv) / 2 with an error of at most (recv - send)/2
// (the stamp was taken somewhere inside the round trip). The sample with the
// shortest round trip among the recent ones wins: it bounds the error best.
#ifndef HSDP_WORKER_AGENT_CLOCK_OFFSET_H_
#define HSDP_WORKER_AGENT_CLOCK_OFFSET_H_

#include <cstdint>
#include <deque>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace hsdp::agent {

struct ClockOffset {
  // Coordinator clock minus this worker's, nanoseconds.
  int64_t offset_nanos = 0;
  // |true offset - offset_nanos| <= error_nanos.
  int64_t error_nanos = 0;
};

// Thread-safe: the heartbeat thread adds samples, the training thread reads.
class ClockOffsetEstimator {
 public:
  // Recent samples kept: old ones age out, so a drifting clock is followed.
  static constexpr size_t kWindow = 16;

  ClockOffsetEstimator() = default;
  ClockOffsetEstimator(const ClockOffsetEstimator&) = delete;
  ClockOffsetEstimator& operator=(const ClockOffsetEstimator&) = delete;

  // Ignores samples whose round trip is negative (the local clock stepped).
  void AddSample(int64_t send_nanos, int64_t server_nanos, int64_t recv_nanos);
  // Empty until the first sample.
  std::optional<ClockOffset> Estimate() const;

 private:
  mutable absl::Mutex mu_;
  std::deque<ClockOffset> samples_ ABSL_GUARDED_BY(mu_);
};

}  // namespace hsdp::agent

#endif  // HSDP_WORKER_AGENT_CLOCK_OFFSET_H_
