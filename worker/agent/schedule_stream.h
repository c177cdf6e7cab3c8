// The worker's end of CoordinatorService.WatchSchedules: a background thread
// holds the stream over which the coordinator pushes each sealed step and
// each commit, and the training thread takes steps and awaits commits from
// it. An accelerator only: whatever the
// stream cannot serve (a coordinator without WatchSchedules, a broken stream,
// a step that does not come in time) the caller fetches with GetSchedule, and
// a commit that does not come it asks CommitStep: those calls keep all the
// retry and re-join logic (agent.h).
//
// A broken stream (coordinator restart) is reopened from the first step not
// yet received, with backoff; UNIMPLEMENTED ends the attempts for good.
//
// Thread-safety: thread-safe; one reader thread, owned and joined by the
// destructor.
#ifndef HSDP_WORKER_AGENT_SCHEDULE_STREAM_H_
#define HSDP_WORKER_AGENT_SCHEDULE_STREAM_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "hsdp/v1/coordinator_service.grpc.pb.h"

namespace hsdp::agent {

class ScheduleStream {
 public:
  struct Options {
    absl::Duration initial_backoff = absl::Milliseconds(100);
    absl::Duration max_backoff = absl::Seconds(2);
  };

  // Opens the stream of worker `worker_id` (rank `rank`) in generation
  // `generation` from `from_step`. `stub` must outlive this. The stream ends
  // for good when the generation ends (ABORTED): the agent opens a new one for
  // the next generation.
  ScheduleStream(hsdp::v1::CoordinatorService::Stub* stub, std::string job_id,
                 int64_t worker_id, int rank, int64_t generation,
                 int64_t from_step, Options options);
  // Cancels the stream and joins the reader.
  ~ScheduleStream();
  ScheduleStream(const ScheduleStream&) = delete;
  ScheduleStream& operator=(const ScheduleStream&) = delete;

  // The pushed schedule of `step` (or the drained answer), waiting up to
  // `timeout` while the stream is up or connecting; nullopt at once while it is
  // down or unsupported, and after the timeout. Steps before `step` are
  // dropped.
  std::optional<hsdp::v1::GetScheduleResponse> Take(int64_t step,
                                                    absl::Duration timeout);

  // The commit of `step` (a voter's answer, as CommitStep gives it), waiting
  // up to `timeout` while the stream is up or connecting; nullopt at once
  // while it is down, unsupported or ended with no such commit received, and
  // after the timeout. A later step's commit answers too: steps commit in
  // order, and its generation went on past `step`.
  std::optional<hsdp::v1::CommitStepResponse> AwaitCommit(
      int64_t step, absl::Duration timeout);

  // The coordinator has no WatchSchedules.
  bool unsupported() const;
  int64_t generation() const { return generation_; }

 private:
  void Run();
  // One stream from next_step_; returns its final status.
  grpc::Status ReadOnce();

  hsdp::v1::CoordinatorService::Stub* const stub_;
  const std::string job_id_;
  const int64_t worker_id_;
  const int rank_;
  const int64_t generation_;
  const Options options_;

  mutable absl::Mutex mu_;
  std::map<int64_t, hsdp::v1::GetScheduleResponse> received_
      ABSL_GUARDED_BY(mu_);
  // The first step not received yet (a reopened stream starts there).
  int64_t next_step_ ABSL_GUARDED_BY(mu_);
  enum class State { kConnecting, kUp, kDown, kUnsupported, kEnded };
  State state_ ABSL_GUARDED_BY(mu_) = State::kConnecting;
  bool drained_ ABSL_GUARDED_BY(mu_) = false;
  // The latest commit received (step -1: none).
  hsdp::v1::CommitStepResponse committed_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ClientContext* context_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::thread reader_;
};

}  // namespace hsdp::agent

#endif  // HSDP_WORKER_AGENT_SCHEDULE_STREAM_H_
