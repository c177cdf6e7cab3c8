// What the gRPC front ends share besides the core: the count of calls in
// flight (for a graceful stop), the cap on a long poll, and the schedule
// feed the worker service streams from.
#ifndef HSDP_COORDINATOR_SERVICE_SERVICE_CONTEXT_H_
#define HSDP_COORDINATOR_SERVICE_SERVICE_CONTEXT_H_

#include <grpcpp/support/status.h>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coordinator/service/grpc_status.h"

namespace grpc {
class ServerContext;
}

namespace hsdp::coordinator {

class ScheduleFeed;

// A long poll never waits longer than this even when the client sets no
// deadline, so a vanished client cannot pin a server thread forever.
inline constexpr absl::Duration kMaxLongPoll = absl::Seconds(60);

// Counts calls being handled, so a graceful shutdown can wait for exactly those
// and then close client connections at once (gRPC's own Shutdown(deadline)
// also waits for idle client connections to go away, which can take the whole
// deadline). Thread-safe.
class CallTracker {
 public:
  CallTracker() = default;
  CallTracker(const CallTracker&) = delete;
  CallTracker& operator=(const CallTracker&) = delete;

  // Marks one call in flight for its lifetime.
  class Scope {
   public:
    explicit Scope(CallTracker* tracker) : tracker_(tracker) {
      absl::MutexLock lock(&tracker_->mu_);
      ++tracker_->active_;
    }
    ~Scope() {
      absl::MutexLock lock(&tracker_->mu_);
      --tracker_->active_;
    }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    CallTracker* const tracker_;
  };

  // True when no call is in flight (waiting at most until `deadline`).
  bool WaitIdle(absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    auto idle = [this]()
                    ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return active_ == 0; };
    return mu_.AwaitWithDeadline(absl::Condition(&idle), deadline);
  }

 private:
  absl::Mutex mu_;
  int active_ ABSL_GUARDED_BY(mu_) = 0;
};

// Owned by the server; copied into each service.
struct ServiceContext {
  CallTracker* calls = nullptr;
  // Cap on one long poll (in-process fuzzing shortens it).
  absl::Duration max_long_poll = kMaxLongPoll;
  // Serves WatchSchedules; null: UNIMPLEMENTED (workers use GetSchedule).
  ScheduleFeed* schedule_feed = nullptr;
};

// Runs a handler body (returning absl::Status) as one tracked call and
// converts its result for the wire.
template <typename Body>
grpc::Status ServeTracked(CallTracker* calls, Body&& body) {
  CallTracker::Scope scope(calls);
  return ToGrpcStatus(body());
}

// The deadline of a blocking call: the call's own deadline, capped at now +
// `cap`.
absl::Time LongPollDeadline(const grpc::ServerContext& context,
                            absl::Duration cap = kMaxLongPoll);

}  // namespace hsdp::coordinator

#endif  // HSDP_COORDINATOR_SERVICE_SERVICE_CONTEXT_H_
