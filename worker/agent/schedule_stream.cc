#include "worker/agent/schedule_stream.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <utility>

namespace hsdp::agent {

ScheduleStream::ScheduleStream(hsdp::v1::CoordinatorService::Stub* stub,
                               std::string job_id, int64_t worker_id, int rank,
                               int64_t generation, int64_t from_step,
                               Options options)
    : stub_(stub),
      job_id_(std::move(job_id)),
      worker_id_(worker_id),
      rank_(rank),
      generation_(generation),
      options_(options),
      next_step_(from_step) {
  committed_.set_step(-1);
  reader_ = std::thread([this] { Run(); });
}

ScheduleStream::~ScheduleStream() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    if (context_ != nullptr) context_->TryCancel();
  }
  reader_.join();
}

bool ScheduleStream::unsupported() const {
  absl::MutexLock lock(&mu_);
  return state_ == State::kUnsupported;
}

std::optional<hsdp::v1::GetScheduleResponse> ScheduleStream::Take(
    int64_t step, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return state_ == State::kDown || state_ == State::kUnsupported ||
           state_ == State::kEnded || received_.count(step) > 0 ||
           (drained_ && !received_.empty() &&
            received_.rbegin()->first <= step);
  };
  mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
  std::optional<hsdp::v1::GetScheduleResponse> out;
  auto it = received_.find(step);
  if (it != received_.end()) {
    out = std::move(it->second);
  } else if (drained_ && !received_.empty() &&
             received_.rbegin()->first <= step &&
             received_.rbegin()->second.drained()) {
    out = received_.rbegin()->second;  // every step past the drain step
  }
  received_.erase(received_.begin(), received_.lower_bound(step));
  if (out.has_value() && !out->drained()) received_.erase(step);
  return out;
}

std::optional<hsdp::v1::CommitStepResponse> ScheduleStream::AwaitCommit(
    int64_t step, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto answered = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return committed_.step() >= step;
  };
  auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return answered() || state_ == State::kDown ||
           state_ == State::kUnsupported || state_ == State::kEnded;
  };
  mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
  if (!answered()) return std::nullopt;
  hsdp::v1::CommitStepResponse answer;
  answer.set_step(step);
  // A later commit: this step's generation went on after it.
  answer.set_reform_after(committed_.step() == step &&
                          committed_.reform_after());
  return answer;
}

grpc::Status ScheduleStream::ReadOnce() {
  grpc::ClientContext context;
  hsdp::v1::WatchSchedulesRequest request;
  request.set_job_id(job_id_);
  request.set_rank(rank_);
  request.set_worker_id(worker_id_);
  request.set_generation(generation_);
  {
    absl::MutexLock lock(&mu_);
    if (stop_) return grpc::Status::CANCELLED;
    request.set_from_step(next_step_);
    context_ = &context;
    state_ = State::kConnecting;
  }
  std::unique_ptr<grpc::ClientReader<hsdp::v1::WatchSchedulesResponse>> stream =
      stub_->WatchSchedules(&context, request);
  hsdp::v1::WatchSchedulesResponse message;
  while (stream->Read(&message)) {
    if (message.has_committed()) {
      absl::MutexLock lock(&mu_);
      state_ = State::kUp;
      if (message.committed().step() > committed_.step()) {
        committed_ = message.committed();
      }
    }
    // A commit alone carries no step.
    if (!message.drained() && message.schedule().empty()) continue;
    hsdp::v1::GetScheduleResponse response;
    if (message.drained()) {
      response.set_drained(true);
    } else if (!response.mutable_schedule()->ParseFromString(
                   message.schedule())) {
      continue;  // GetSchedule will serve this step
    }
    absl::MutexLock lock(&mu_);
    state_ = State::kUp;
    drained_ = drained_ || message.drained();
    next_step_ = std::max(next_step_, message.step() + 1);
    received_[message.step()] = std::move(response);
  }
  const grpc::Status status = stream->Finish();
  absl::MutexLock lock(&mu_);
  context_ = nullptr;
  switch (status.error_code()) {
    case grpc::StatusCode::UNIMPLEMENTED:
      state_ = State::kUnsupported;
      break;
    case grpc::StatusCode::ABORTED:  // the generation ended
      state_ = State::kEnded;
      break;
    default:
      state_ = State::kDown;
  }
  return status;
}

void ScheduleStream::Run() {
  absl::Duration backoff = options_.initial_backoff;
  while (true) {
    const grpc::Status status = ReadOnce();
    absl::MutexLock lock(&mu_);
    if (stop_ || drained_) return;
    if (status.ok()) backoff = options_.initial_backoff;
    if (state_ == State::kUnsupported || state_ == State::kEnded) return;
    // Broken (a restart, a lost membership the agent re-joins): try again.
    mu_.AwaitWithTimeout(absl::Condition(&stop_), backoff);
    if (stop_) return;
    backoff = std::min(backoff * 2, options_.max_backoff);
  }
}

}  // namespace hsdp::agent
