// Private to worker/agent: the retry loop every Agent call goes through, and
// the status-code rules it applies (see agent.h), shared by agent.cc and
// agent_elastic.cc.
#ifndef HSDP_WORKER_AGENT_AGENT_INTERNAL_H_
#define HSDP_WORKER_AGENT_AGENT_INTERNAL_H_

#include <grpcpp/client_context.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/status_util.h"
#include "worker/agent/agent.h"

namespace hsdp::agent {
namespace internal {

// Codes worth another attempt: the coordinator is down, restarting, or shedding
// load. Never ABORTED: that means the generation ended (re-form), which no
// retry changes.
inline bool IsTransient(absl::StatusCode code) {
  return code == absl::StatusCode::kUnavailable ||
         code == absl::StatusCode::kResourceExhausted;
}

// Codes a restarted coordinator returns for a worker it no longer knows.
inline bool IsMembershipLoss(absl::StatusCode code) {
  return code == absl::StatusCode::kNotFound ||
         code == absl::StatusCode::kFailedPrecondition;
}

inline void SetDeadline(grpc::ClientContext& ctx, absl::Duration timeout) {
  ctx.set_deadline(std::chrono::system_clock::now() +
                   absl::ToChronoMilliseconds(timeout));
}

}  // namespace internal

template <typename Fn>
absl::Status Agent::CallWithRetry(const std::string& what,
                                  absl::Duration attempt_timeout, Fn attempt) {
  if (!setup_.ok()) return AnnotateStatus(setup_, what);
  absl::Duration backoff = options_.initial_backoff;
  std::optional<absl::Time> first_failure;
  while (true) {
    grpc::ClientContext ctx;
    internal::SetDeadline(ctx, attempt_timeout);
    {
      // Registered so the destructor can cancel a long poll instead of waiting
      // it out.
      absl::MutexLock lock(&mu_);
      if (stop_)
        return absl::CancelledError(
            absl::StrCat(what, ": agent shutting down"));
      in_flight_.insert(&ctx);
    }
    absl::Status status = FromGrpc(attempt(ctx), what);
    {
      absl::MutexLock lock(&mu_);
      in_flight_.erase(&ctx);
    }
    if (status.ok() || !internal::IsTransient(status.code())) return status;
    const absl::Time now = absl::Now();
    if (!first_failure) first_failure = now;
    if (now - *first_failure >= options_.retry_budget) {
      return absl::UnavailableError(absl::StrCat(
          "coordinator ", options_.coordinator, " unreachable for ",
          absl::FormatDuration(options_.retry_budget), " (", status.message(),
          ")"));
    }
    {
      // Sleep, but wake early when the agent is being destroyed.
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stop_), backoff)) {
        return absl::CancelledError(
            absl::StrCat(what, ": agent shutting down"));
      }
    }
    backoff = std::min(backoff * 2, options_.max_backoff);
  }
}

}  // namespace hsdp::agent

#endif  // HSDP_WORKER_AGENT_AGENT_INTERNAL_H_
