// The worker's end of CoordinatorService.StreamReports: step reports go out as
// messages on one open stream instead of one ReportStep call per step, so a
// report costs the coordinator a fraction of a call and the training thread no
// round trip.
//
// An accelerator only, as the schedule stream is: whatever the stream cannot
// carry (a coordinator without StreamReports, a stream that broke, a report
// that must be acknowledged) the caller sends with ReportStep, which keeps all
// the retry and re-join logic (agent.h). A message handed to the stream is
// recorded by the coordinator in order unless the stream breaks first; the
// error that broke it comes back from the next Send or from Close.
//
// Thread-safety: thread-safe (one mutex; Send and Close block only on the
// stream's own flow control and, when opening, on the coordinator's first
// answer).
#ifndef HSDP_WORKER_AGENT_REPORT_STREAM_H_
#define HSDP_WORKER_AGENT_REPORT_STREAM_H_

#include <grpcpp/grpcpp.h>

#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "hsdp/v1/coordinator_service.grpc.pb.h"

namespace hsdp::agent {

class ReportStream {
 public:
  // Streams over `channel` (which carries the job token, as the agent's
  // does).
  explicit ReportStream(std::shared_ptr<grpc::Channel> channel);
  // Closes the stream (as Close does).
  ~ReportStream();
  ReportStream(const ReportStream&) = delete;
  ReportStream& operator=(const ReportStream&) = delete;

  // Hands `request` to the stream, opening one first if none is open (only
  // over a connected channel: UNAVAILABLE at once otherwise). OK: sent.
  // Otherwise `request` was not sent and the stream is closed: the error that
  // ended it (e.g. FAILED_PRECONDITION for a worker declared lost, UNAVAILABLE
  // for a coordinator that went away), or UNIMPLEMENTED when the coordinator
  // has no StreamReports (unsupported() then stays true and Send refuses at
  // once). The next Send opens a new stream.
  absl::Status Send(const hsdp::v1::ReportStepRequest& request);

  // Hands a commit vote to the stream, as Send hands a report (the commit
  // comes on the schedule stream). UNIMPLEMENTED, and not sent, when the
  // coordinator counts no votes on the stream (an older one).
  absl::Status SendVote(const hsdp::v1::CommitStepRequest& vote);

  // Ends the open stream once the coordinator recorded every report sent on
  // it: OK, or the error that ended it first. OK when none is open.
  absl::Status Close();

  // The coordinator has no StreamReports.
  bool unsupported() const;

 private:
  // Opens a stream and waits for the coordinator's initial metadata.
  absl::Status OpenLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Opens a stream if none is open, then writes `message`.
  absl::Status WriteLocked(const hsdp::v1::StreamReportsRequest& message)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Half-closes (when `writes_done`) and finishes the open stream.
  absl::Status FinishLocked(bool writes_done)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::shared_ptr<grpc::Channel> channel_;
  const std::unique_ptr<hsdp::v1::CoordinatorService::Stub> stub_;
  mutable absl::Mutex mu_;
  std::unique_ptr<grpc::ClientContext> context_ ABSL_GUARDED_BY(mu_);
  hsdp::v1::StreamReportsResponse response_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<grpc::ClientWriter<hsdp::v1::StreamReportsRequest>> writer_
      ABSL_GUARDED_BY(mu_);
  bool unsupported_ ABSL_GUARDED_BY(mu_) = false;
  // The open stream's coordinator counts votes on it.
  bool votes_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace hsdp::agent

#endif  // HSDP_WORKER_AGENT_REPORT_STREAM_H_
