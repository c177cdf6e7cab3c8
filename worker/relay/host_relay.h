// A host's relay between its workers and the coordinator (hsdp-relay).
//
// The workers of one host open their two streams (WatchSchedules,
// StreamReports) to the relay instead of the coordinator (hsdp-worker
// --relay). The relay holds, for the whole host, one schedule stream per
// generation and one report stream to the coordinator:
// - schedules down: each message the coordinator pushes (a sealed step, a
//   commit) comes once per host and is handed, bytes unchanged, to every local
//   stream of that generation; a stream opened later first gets the
//   generation's latest commit and the steps it asks for that the relay still
//   holds;
// - reports and votes up: the messages local workers send are queued, and
//   whatever queued while the previous upstream write was in flight goes out
//   as one message (StreamReportsRequest.relayed), recorded by the coordinator
//   as if each had come alone.
// So the coordinator's per-step messages grow with hosts, not ranks.
//
// An accelerator, as the streams it carries are: every call (Join, Heartbeat,
// GetSchedule, CommitStep, ReportStep, ...) goes from the workers straight to
// the coordinator, and whatever the relay cannot carry ends the worker's
// stream, after which the worker uses those calls: a relay that stops or
// cannot reach the coordinator, a step it no longer holds, an upstream stream
// that ended (its status goes to every local stream of it). One worker's
// refused message ends the host's upstream report stream, so the relay then
// ends every local stream (each worker falls back once and reopens); messages
// of the others that were in the same batch are recorded all the same. The
// relay's upstream schedule stream stands for no worker in particular
// (WatchSchedulesRequest.relay); when a worker's own stream to the relay ends
// from its side (its process died), the relay says so upstream
// (StreamReportsRequest.stream_lost), so an ending generation does not wait
// for that worker, as it would not without a relay. A
// local stream that closes its side returns once the coordinator recorded
// everything it sent (the relay closes its upstream report stream to learn
// it, and opens a new one for later messages). An idle upstream report
// stream is probed with an empty message every second, so a refusal that
// ended it reaches the local streams even when no other message follows.
//
// Thread-safety: thread-safe. gRPC's synchronous server runs each local stream
// on its own thread; one thread reads each generation's upstream schedule
// stream and one writes the upstream report stream.
#ifndef HSDP_WORKER_RELAY_HOST_RELAY_H_
#define HSDP_WORKER_RELAY_HOST_RELAY_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "hsdp/v1/coordinator_service.grpc.pb.h"

namespace hsdp::relay {

class HostRelay final : public hsdp::v1::CoordinatorService::Service {
 public:
  struct Options {
    // The job token local workers must present (`authorization: Bearer
    // <token>`); empty: none. The upstream channel carries its own.
    std::string job_token;
    // Schedule messages kept per generation for local streams that open late.
    int keep_messages = 64;
  };

  // What the relay has carried (for logs and tests).
  struct Stats {
    int64_t upstream_watches = 0;  // schedule streams opened upstream
    int64_t upstream_report_streams = 0;
    int64_t upstream_messages = 0;  // report-stream messages written upstream
    int64_t relayed = 0;            // local messages they carried
    int64_t local_watches = 0;      // local schedule streams served
  };

  // Relays to the coordinator over `upstream` (which carries the job token
  // and TLS the coordinator asks for).
  HostRelay(std::shared_ptr<grpc::Channel> upstream, Options options);
  // Stops (as Stop does) and joins its threads.
  ~HostRelay() override;
  HostRelay(const HostRelay&) = delete;
  HostRelay& operator=(const HostRelay&) = delete;

  grpc::Status WatchSchedules(
      grpc::ServerContext* context,
      const hsdp::v1::WatchSchedulesRequest* request,
      grpc::ServerWriter<hsdp::v1::WatchSchedulesResponse>* writer) override;
  grpc::Status StreamReports(
      grpc::ServerContext* context,
      grpc::ServerReader<hsdp::v1::StreamReportsRequest>* reader,
      hsdp::v1::StreamReportsResponse* response) override;

  // Ends every local stream UNAVAILABLE, sends up what local workers had
  // already handed it, and closes the upstream streams. Call before shutting
  // the server down (its Shutdown waits for the local streams).
  void Stop();

  Stats stats() const;

 private:
  struct Feed;
  struct LocalReader;
  struct Barrier;
  struct Queued;

  // The feed of `request`'s generation that can serve it: the open one, or
  // a new one (started from request.from_step) when none is open or the open
  // one started after that step.
  std::shared_ptr<Feed> FeedForLocked(
      const hsdp::v1::WatchSchedulesRequest& request)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A local schedule stream ended from the worker's side: queues the report
  // of it for the coordinator; returns the stream's status.
  grpc::Status WorkerWentAway(const hsdp::v1::WatchSchedulesRequest& request)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Reads one feed's upstream stream until it ends.
  void ReadFeed(std::shared_ptr<Feed> feed,
                hsdp::v1::WatchSchedulesRequest request);
  // Writes queued local messages upstream until Stop.
  void RunUplink();
  // Opens the upstream report stream if none is open; OK once open.
  absl::Status OpenUpstreamLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(up_mu_);
  // Writes `batch` upstream (one message where the coordinator takes relayed
  // ones); the error that ended the upstream stream otherwise.
  absl::Status WriteLocked(std::vector<hsdp::v1::StreamReportsRequest> batch)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(up_mu_);
  // Writes `message` on the open upstream report stream (OK when none is
  // open); the error that ended the stream otherwise, which closes it.
  absl::Status WriteOneLocked(const hsdp::v1::StreamReportsRequest& message)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(up_mu_);
  // Closes the upstream report stream: OK once the coordinator recorded all
  // of it, else the error that ended it.
  absl::Status CloseUpstreamLocked(bool writes_done)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(up_mu_);
  // Ends every local stream with `why` (an upstream report stream ended).
  void FailLocals(const absl::Status& why) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status CheckToken(const grpc::ServerContext& context) const;

  const Options options_;
  const std::unique_ptr<hsdp::v1::CoordinatorService::Stub> stub_;

  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  // By job and generation.
  std::map<std::pair<std::string, int64_t>, std::shared_ptr<Feed>> feeds_
      ABSL_GUARDED_BY(mu_);
  // Feeds replaced or ended, whose reader threads Stop joins.
  std::vector<std::shared_ptr<Feed>> retired_ ABSL_GUARDED_BY(mu_);
  std::deque<Queued> queue_ ABSL_GUARDED_BY(mu_);
  std::set<LocalReader*> readers_ ABSL_GUARDED_BY(mu_);
  // Counts upstream report-stream failures; a local schedule stream ends
  // with the latest one's status once it moved.
  int64_t failures_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status last_failure_ ABSL_GUARDED_BY(mu_);
  Stats stats_ ABSL_GUARDED_BY(mu_);

  // The upstream report stream (taken before mu_ where both are held).
  absl::Mutex up_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  std::unique_ptr<grpc::ClientContext> up_context_ ABSL_GUARDED_BY(up_mu_);
  std::unique_ptr<grpc::ClientWriter<hsdp::v1::StreamReportsRequest>> up_writer_
      ABSL_GUARDED_BY(up_mu_);
  hsdp::v1::StreamReportsResponse up_response_ ABSL_GUARDED_BY(up_mu_);
  // The open stream's `hsdp-report-stream` marker ("3": relayed messages).
  std::string up_marker_ ABSL_GUARDED_BY(up_mu_);

  std::thread uplink_;
};

}  // namespace hsdp::relay

#endif  // HSDP_WORKER_RELAY_HOST_RELAY_H_
