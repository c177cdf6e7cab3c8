// The schedule feed: CoordinatorService.WatchSchedules, one server stream per
// worker over which the coordinator pushes each sealed step, instead of one
// long-polled GetSchedule call per step and worker.
//
// Why: at 1000+ workers a step's burst of unary calls costs a full gRPC call
// per worker and queues behind itself; a push is one message on a stream that
// is already open. The message is serialized once per step and every stream
// writes those same bytes (the method is registered raw: a grpc::ByteBuffer
// copy shares its slices). Streams are indexed by generation and by the step
// each waits for, so a push, and the pusher's periodic check, touch only the
// streams a step feeds.
//
// When a step is pushed: once the slowest rank completed step s - 1 -
// push_ahead (ScheduleLog's floor), step s is read through
// ScheduleLog::GetSchedule, which seals and persists it exactly as a worker's
// first read would, and its sealed bytes go to every stream waiting for it.
// push_ahead 1 (the default) is what an agent's background prefetch of the
// next step does: each rank holds step s + 1 while it runs step s.
// Steps are pushed in order on each stream; a stream opened late first gets
// the sealed steps it missed. A stream belongs to the generation its worker
// trains in: it carries that generation's schedules, and ends ABORTED once the
// generation ended (the worker re-forms, then opens a stream for the next).
// Commits go out the same way: each commit of a generation (CommitNews from
// the log, recorded with the commit, before an end at its boundary) is
// serialized once
// and written to every stream of that generation, inside the message of the
// step the commit made pushable where a stream waits for one (the commit of s
// raised the floor to s), alone otherwise; a stream opened later first gets
// the generation's latest commit. Once the log says a
// generation ended, its streams end ABORTED after what is queued on them (a
// commit that ended the generation reaches every voter first). So a worker
// that voted on its report stream waits for the answer here, and learns at
// once when there will be none.
// After the drain step a stream gets one message with drained set and ends OK;
// Shutdown() ends every stream with UNAVAILABLE. A stream the worker's side
// ends first (its process died, so its connection closed; or it cancelled)
// is reported to Options::on_stream_lost.
//
// Threads: one pusher thread (reads the log, fans out), and gRPC's callback
// threads for the streams' completions.
//
// Thread-safety: thread-safe. Lock order: the feed's mutex, then a stream's.
#ifndef HSDP_COORDINATOR_SERVICE_SCHEDULE_FEED_H_
#define HSDP_COORDINATOR_SERVICE_SCHEDULE_FEED_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coordinator/core/schedule_log.h"
#include "hsdp/v1/coordinator_service.pb.h"

namespace grpc {
class ByteBuffer;
class Status;
template <class Response>
class ServerWriteReactor;
}  // namespace grpc

namespace hsdp::coordinator {

inline constexpr int kDefaultPushAhead = 1;

class ScheduleWatch;

class ScheduleFeed {
 public:
  struct Options {
    // Steps past the floor's next step that are pushed (see the file
    // comment); clamped to the log's read-ahead window.
    int push_ahead = kDefaultPushAhead;
    // The pusher re-checks for new streams at least this often.
    absl::Duration poll_interval = absl::Milliseconds(10);
    // Called, on a gRPC thread and without the feed's locks, with the worker
    // id and generation of a stream that ended from the worker's side. May
    // be empty.
    std::function<void(int64_t worker_id, int64_t generation)> on_stream_lost;
  };

  // `log` must outlive the feed.
  ScheduleFeed(ScheduleLog* log, Options options);
  ~ScheduleFeed();
  ScheduleFeed(const ScheduleFeed&) = delete;
  ScheduleFeed& operator=(const ScheduleFeed&) = delete;

  // A new stream for `request` (already checked by the service: token, job
  // and member) of a worker training in `generation`. Owned by gRPC until its
  // OnDone.
  grpc::ServerWriteReactor<grpc::ByteBuffer>* Subscribe(
      const hsdp::v1::WatchSchedulesRequest& request,
      const GenerationContext& generation);

  // Ends every stream with UNAVAILABLE, refuses new ones and stops the pusher.
  // Idempotent. The feed must still outlive the gRPC server's Wait() (streams
  // report their end to it).
  void Shutdown();

  // Ends the stream(s) of `worker_id` in `generation` with `status` (after
  // what is queued on them): a vote of that worker was refused, and it waits
  // on its stream for the commit.
  void EndStreamOf(int64_t worker_id, int64_t generation,
                   const grpc::Status& status);

  // Streams open now.
  int subscribers() const;

 private:
  friend class ScheduleWatch;

  // The open streams of one generation, by the step each waits for next
  // (a drained stream waits for none: the largest int64).
  struct GenerationStreams {
    GenerationContext context;
    std::map<int64_t, std::vector<ScheduleWatch*>> waiting;
    // Its streams were ended ABORTED (the generation is over).
    bool ended = false;
  };

  void Run();
  // Writes the news' commit to its generation's streams that lack it, and
  // ends the streams of generations that ended.
  void PushNews(const CommitNews& news);
  // Pushes every step up to the floor's limit that some stream waits for,
  // with the news' commit to the streams that lack it.
  void PushAvailable(int64_t floor, const CommitNews& news);
  // The same for the streams of generation `number`; ends them ABORTED when
  // that generation has ended.
  void PushGeneration(int64_t number, int64_t limit, const CommitNews& news);
  // Ends the streams of generation `number` ABORTED with `why`.
  void EndGeneration(int64_t number, const std::string& why);
  void Unregister(ScheduleWatch* watch);
  // The streams of `streams`, each with a reference the caller releases.
  static std::vector<ScheduleWatch*> RefAll(const GenerationStreams& streams);

  ScheduleLog* const log_;
  const Options options_;
  mutable absl::Mutex mu_;
  std::map<int64_t, GenerationStreams> generations_ ABSL_GUARDED_BY(mu_);
  int streams_ ABSL_GUARDED_BY(mu_) = 0;
  // The commit news PushNews last looked at, and whether a stream was opened
  // since: otherwise no stream can lack the latest commit.
  int64_t news_pushed_ ABSL_GUARDED_BY(mu_) = 0;
  bool subscribed_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  std::thread pusher_;
};

// A stream that ends with `status` (not OK) at once: a refused
// WatchSchedules.
grpc::ServerWriteReactor<grpc::ByteBuffer>* RefuseWatch(
    const grpc::Status& status);

}  // namespace hsdp::coordinator

#endif  // HSDP_COORDINATOR_SERVICE_SCHEDULE_FEED_H_
