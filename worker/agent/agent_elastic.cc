// Agent: the elastic protocol — AwaitGeneration, ReportFailure, CommitStep and
// the generation watcher (worker/agent/ELASTIC.md).
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "worker/agent/agent.h"
#include "worker/agent/agent_internal.h"

namespace hsdp::agent {
namespace {

using hsdp::v1::AwaitGenerationResponse;

// Re-joins after a restarted coordinator forgot this worker, at most this
// often per call.
constexpr int kMaxRejoins = 3;

bool Settled(const AwaitGenerationResponse& r) {
  return r.outcome() != hsdp::v1::AWAIT_OUTCOME_ENDED;
}

}  // namespace

absl::StatusOr<AwaitGenerationResponse> Agent::AwaitOnce(
    int64_t known_generation, absl::Duration timeout) {
  hsdp::v1::AwaitGenerationRequest req;
  req.set_job_id(options_.job_id);
  req.set_worker_id(worker_id());
  req.set_generation(known_generation);
  AwaitGenerationResponse resp;
  absl::Status s = CallWithRetry(
      absl::StrCat("AwaitGeneration(after ", known_generation, ")"), timeout,
      [&](grpc::ClientContext& ctx) {
        return stub_->AwaitGeneration(&ctx, req, &resp);
      });
  if (!s.ok()) return s;
  return resp;
}

absl::StatusOr<AwaitGenerationResponse> Agent::AwaitGeneration(
    int64_t known_generation, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    absl::StatusOr<AwaitGenerationResponse> r;
    {
      absl::MutexLock lock(&mu_);
      if (watched_.has_value() &&
          (watched_->generation().generation() > known_generation ||
           watched_->outcome() == hsdp::v1::AWAIT_OUTCOME_EXIT)) {
        r = *std::move(watched_);
        watched_.reset();
      }
    }
    if (!r.ok()) {
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) {
        return absl::DeadlineExceededError(absl::StrCat(
            "AwaitGeneration: no change after generation ", known_generation,
            " within ", absl::FormatDuration(timeout)));
      }
      r = AwaitOnce(known_generation,
                    std::min(left, options_.long_poll_timeout));
      if (r.status().code() == absl::StatusCode::kDeadlineExceeded) continue;
      if (!r.ok()) return r.status();
    }
    absl::MutexLock lock(&mu_);
    if (r->outcome() == hsdp::v1::AWAIT_OUTCOME_FORMED) {
      AdoptGenerationLocked(r->generation());
    } else if (r->outcome() == hsdp::v1::AWAIT_OUTCOME_STANDBY) {
      hsdp::v1::Generation standby;
      standby.set_generation(r->generation().generation());
      AdoptGenerationLocked(standby);
    }
    return r;
  }
}

absl::StatusOr<bool> Agent::ReportFailure(int64_t step,
                                          const std::string& detail) {
  hsdp::v1::ReportFailureRequest req;
  req.set_job_id(options_.job_id);
  {
    absl::MutexLock lock(&mu_);
    req.set_worker_id(join_.worker_id());
    req.set_generation(join_.generation());
  }
  req.set_step(step);
  req.set_detail(detail);
  hsdp::v1::ReportFailureResponse resp;
  absl::Status s =
      CallWithRetry(absl::StrCat("ReportFailure(step ", step, ")"),
                    options_.rpc_timeout, [&](grpc::ClientContext& ctx) {
                      return stub_->ReportFailure(&ctx, req, &resp);
                    });
  if (!s.ok()) return s;
  return resp.ended();
}

absl::StatusOr<bool> Agent::FailJob(int64_t step, const std::string& reason) {
  hsdp::v1::ReportFailureRequest req;
  req.set_job_id(options_.job_id);
  {
    absl::MutexLock lock(&mu_);
    req.set_worker_id(join_.worker_id());
    req.set_generation(join_.generation());
  }
  req.set_step(step);
  req.set_detail(reason);
  req.set_fatal(true);
  hsdp::v1::ReportFailureResponse resp;
  absl::Status s =
      CallWithRetry(absl::StrCat("ReportFailure(step ", step, ", fatal)"),
                    options_.rpc_timeout, [&](grpc::ClientContext& ctx) {
                      return stub_->ReportFailure(&ctx, req, &resp);
                    });
  if (!s.ok()) return s;
  return resp.ended();
}

absl::StatusOr<hsdp::v1::CommitStepResponse> Agent::CommitStep(int64_t step) {
  hsdp::v1::CommitStepRequest req;
  req.set_job_id(options_.job_id);
  req.set_step(step);
  hsdp::v1::CommitStepResponse resp;
  if (std::optional<hsdp::v1::CommitStepResponse> streamed =
          CommitOnStreams(req)) {
    return *std::move(streamed);
  }
  const std::string what = absl::StrCat("CommitStep(step ", step, ")");
  for (int rejoins = 0;; ++rejoins) {
    const int64_t epoch = join_epoch();
    {
      absl::MutexLock lock(&mu_);
      req.set_worker_id(join_.worker_id());
      req.set_generation(join_.generation());
    }
    absl::Status s;
    // A vote that ran out its poll only means the others have not voted yet;
    // voting again is idempotent.
    do {
      s = CallWithRetry(what, options_.long_poll_timeout,
                        [&](grpc::ClientContext& ctx) {
                          return stub_->CommitStep(&ctx, req, &resp);
                        });
    } while (s.code() == absl::StatusCode::kDeadlineExceeded);
    if (s.ok()) return resp;
    if (!internal::IsMembershipLoss(s.code()) || rejoins >= kMaxRejoins) {
      return s;
    }
    if (absl::Status r = Rejoin(epoch); !r.ok()) return r;
  }
}

std::optional<hsdp::v1::CommitStepResponse> Agent::CommitOnStreams(
    hsdp::v1::CommitStepRequest vote) {
  {
    absl::MutexLock lock(&mu_);
    vote.set_worker_id(join_.worker_id());
    vote.set_generation(join_.generation());
  }
  // The vote goes up the report stream and the commit comes down the schedule
  // stream of the vote's generation (opened by this step's GetSchedule).
  if (report_stream_ == nullptr || schedule_stream_ == nullptr ||
      schedule_stream_->generation() != vote.generation()) {
    return std::nullopt;
  }
  if (!report_stream_->SendVote(vote).ok()) return std::nullopt;
  // A refused vote, a generation that ended or a stream that broke ends the
  // wait at once; CommitStep (idempotent) then gives the answer.
  return schedule_stream_->AwaitCommit(vote.step(), options_.long_poll_timeout);
}

void Agent::StartGenerationWatch(GenerationEndFn on_end) {
  if (watcher_.joinable()) return;
  watcher_ =
      std::thread([this, on_end = std::move(on_end)] { WatchLoop(on_end); });
}

void Agent::WatchLoop(GenerationEndFn on_end) {
  // The generation whose end was already reported.
  int64_t reported = -1;
  while (true) {
    int64_t generation;
    {
      absl::MutexLock lock(&mu_);
      // Watch while a member of a generation not reported yet.
      auto armed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || (join_.rank() >= 0 && join_.generation() != reported);
      };
      mu_.Await(absl::Condition(&armed));
      if (stop_) return;
      generation = join_.generation();
    }
    absl::StatusOr<AwaitGenerationResponse> r =
        AwaitOnce(generation, options_.long_poll_timeout);
    if (r.status().code() == absl::StatusCode::kDeadlineExceeded) continue;
    if (r.status().code() == absl::StatusCode::kCancelled) return;
    reported = generation;
    if (!r.ok()) {
      on_end(generation, r.status());
      continue;
    }
    on_end(
        generation,
        absl::AbortedError(absl::StrCat(
            "generation ", generation, " ended",
            r->message().empty() ? "" : absl::StrCat(" (", r->message(), ")"),
            ": re-form")));
    // Confirm at once (calling again while it ends), whatever the training
    // thread is doing, and keep the answer for its AwaitGeneration.
    while (r.ok() && !Settled(*r)) {
      absl::StatusOr<AwaitGenerationResponse> next =
          AwaitOnce(generation, options_.long_poll_timeout);
      // Still forming (e.g. waiting for workers): keep confirming.
      if (next.status().code() == absl::StatusCode::kDeadlineExceeded) continue;
      r = std::move(next);
    }
    if (!r.ok()) continue;
    absl::MutexLock lock(&mu_);
    if (join_.generation() == generation) watched_ = *std::move(r);
  }
}

}  // namespace hsdp::agent
