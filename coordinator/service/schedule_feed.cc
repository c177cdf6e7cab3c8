#include "coordinator/service/schedule_feed.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/codegen/proto_utils.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <iostream>
#include <limits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace hsdp::coordinator {

using hsdp::v1::WatchSchedulesResponse;

namespace {

// The step a drained stream waits for: none.
constexpr int64_t kNoStep = std::numeric_limits<int64_t>::max();

// `response` serialized once, for every stream to write; null if it cannot be.
std::shared_ptr<const grpc::ByteBuffer> Serialize(
    const WatchSchedulesResponse& response) {
  auto message = std::make_shared<grpc::ByteBuffer>();
  bool own_buffer = false;
  if (!grpc::SerializationTraits<WatchSchedulesResponse>::Serialize(
           response, message.get(), &own_buffer)
           .ok()) {
    return nullptr;
  }
  return message;
}

void SetCommit(const CommitNews& news, WatchSchedulesResponse* response) {
  response->mutable_committed()->set_step(news.step);
  response->mutable_committed()->set_reform_after(news.reform_after);
}

// The message that announces the commit in `news` alone.
std::shared_ptr<const grpc::ByteBuffer> CommitMessage(const CommitNews& news) {
  WatchSchedulesResponse response;
  SetCommit(news, &response);
  return Serialize(response);
}

std::string EndedWhy(int64_t generation) {
  return absl::StrCat("generation ", generation, " ended: re-form");
}

}  // namespace

// One worker's stream. Writes go out one at a time from a queue; Finish comes
// after the queued writes (or at once when the client is gone). gRPC holds a
// reference until OnDone, the feed one while the stream is registered and one
// around each push, so the object lives until all of them are released.
// Thread-safe.
class ScheduleWatch final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  ScheduleWatch(ScheduleFeed* feed, int64_t worker_id, int64_t from_step,
                GenerationContext generation)
      : feed_(feed),
        worker_id_(worker_id),
        next_step_(from_step),
        generation_(generation) {}

  // gRPC runs OnDone (whose Unref may delete this) after every other
  // reaction, but orders them through its own uninstrumented synchronization:
  // taking the mutex that guarded the last writes makes that order visible to
  // ThreadSanitizer before the members go.
  ~ScheduleWatch() override { absl::MutexLock lock(&mu_); }

  const GenerationContext& generation() const { return generation_; }

  // The next step this stream waits for; only under the feed's mutex.
  int64_t next_step() const { return next_step_; }
  void set_next_step(int64_t step) { next_step_ = step; }
  // The latest commit queued on it (-1: none); only under the feed's mutex.
  int64_t commit_step() const { return commit_step_; }
  void set_commit_step(int64_t step) { commit_step_ = step; }

  void Ref() { refs_.fetch_add(1); }
  void Unref() {
    if (refs_.fetch_sub(1) == 1) delete this;
  }

  // Queues `message` (a serialized WatchSchedulesResponse); `last` ends the
  // stream OK after it.
  void Push(std::shared_ptr<const grpc::ByteBuffer> message, bool last) {
    {
      absl::MutexLock lock(&mu_);
      if (finishing_) return;
      queue_.push_back(std::move(message));
      if (last) {
        finishing_ = true;
        status_ = grpc::Status::OK;
      }
    }
    Advance();
  }

  // Ends the stream with `status` after the write in flight, and after the
  // queued ones unless `drop_queued`.
  void End(grpc::Status status, bool drop_queued = true) {
    {
      absl::MutexLock lock(&mu_);
      if (finishing_) return;
      finishing_ = true;
      status_ = std::move(status);
      if (drop_queued) queue_.clear();
    }
    Advance();
  }

  int64_t worker_id() const { return worker_id_; }

  void OnWriteDone(bool ok) override {
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      in_flight_.reset();
      if (!ok && !finishing_) {  // the client went away
        finishing_ = true;
        status_ = grpc::Status(grpc::StatusCode::CANCELLED, "write failed");
        queue_.clear();
      }
    }
    Advance();
  }

  // gRPC calls this when the worker's side ends the call before our status
  // reached it: a cancel, or its connection closed (also after Finish, when
  // the status could not be delivered).
  void OnCancel() override {
    End(grpc::Status(grpc::StatusCode::CANCELLED, "stream cancelled"));
    const auto& lost = feed_->options_.on_stream_lost;
    if (lost && worker_id_ != 0) lost(worker_id_, generation_.generation);
  }

  void OnDone() override {
    feed_->Unregister(this);
    Unref();  // gRPC's
  }

 private:
  // Starts the next write, or Finish once nothing is left; never while holding
  // mu_ (a reaction may run on this thread).
  void Advance() {
    const grpc::ByteBuffer* write = nullptr;
    bool finish = false;
    grpc::Status status;
    {
      absl::MutexLock lock(&mu_);
      if (writing_ || finished_) return;
      if (!queue_.empty()) {
        writing_ = true;
        in_flight_ = std::move(queue_.front());
        queue_.pop_front();
        write = in_flight_.get();
      } else if (finishing_) {
        finished_ = true;
        finish = true;
        status = status_;
      }
    }
    if (write != nullptr) StartWrite(write);
    if (finish) Finish(status);
  }

  ScheduleFeed* const feed_;
  const int64_t worker_id_;   // 0: a client that sent only its rank
  int64_t next_step_;         // guarded by feed_->mu_
  int64_t commit_step_ = -1;  // guarded by feed_->mu_
  const GenerationContext generation_;
  // gRPC's and the feed registry's.
  std::atomic<int> refs_{2};
  absl::Mutex mu_;
  std::deque<std::shared_ptr<const grpc::ByteBuffer>> queue_
      ABSL_GUARDED_BY(mu_);
  std::shared_ptr<const grpc::ByteBuffer> in_flight_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status status_ ABSL_GUARDED_BY(mu_);
};

namespace {

// A stream refused before it started.
class RefusedWatch final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  explicit RefusedWatch(grpc::Status status) { Finish(std::move(status)); }
  void OnDone() override { delete this; }
};

}  // namespace

grpc::ServerWriteReactor<grpc::ByteBuffer>* RefuseWatch(
    const grpc::Status& status) {
  return new RefusedWatch(status);
}

ScheduleFeed::ScheduleFeed(ScheduleLog* log, Options options)
    : log_(log), options_(options) {
  pusher_ = std::thread([this] { Run(); });
}

ScheduleFeed::~ScheduleFeed() { Shutdown(); }

grpc::ServerWriteReactor<grpc::ByteBuffer>* ScheduleFeed::Subscribe(
    const hsdp::v1::WatchSchedulesRequest& request,
    const GenerationContext& generation) {
  if (request.from_step() < 0) {
    return new RefusedWatch(grpc::Status(
        grpc::StatusCode::INVALID_ARGUMENT,
        absl::StrCat("from_step ", request.from_step(), " is negative")));
  }
  // A relay's stream stands for several workers: none is lost when it ends,
  // and none's refused vote ends it (worker id 0: no one's).
  auto* watch =
      new ScheduleWatch(this, request.relay() ? 0 : request.worker_id(),
                        request.from_step(), generation);
  // The generation's latest commit first: the worker may wait for it.
  const CommitNews news = log_->commit_news();
  if (news.generation == generation.generation) {
    if (auto message = CommitMessage(news)) {
      watch->set_commit_step(news.step);  // not shared yet
      watch->Push(message, /*last=*/false);
    }
  }
  bool registered = false;
  bool ended = news.ended_generation >= generation.generation;
  {
    absl::MutexLock lock(&mu_);
    if (!stopped_) {
      GenerationStreams& streams = generations_[generation.generation];
      streams.context = generation;
      streams.waiting[request.from_step()].push_back(watch);
      ++streams_;
      subscribed_ = true;
      registered = true;
      // Its generation ended between the member check and now.
      ended = ended || streams.ended;
    }
  }
  if (!registered) {
    watch->End(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                            "coordinator is shutting down"));
    watch->Unref();  // the registry's
    return watch;
  }
  if (ended) {
    watch->End(grpc::Status(grpc::StatusCode::ABORTED,
                            EndedWhy(generation.generation)),
               /*drop_queued=*/false);
  }
  log_->Wake();  // the pusher serves the new stream now
  // Valid for gRPC: its reference lasts until OnDone.
  return watch;
}

void ScheduleFeed::Unregister(ScheduleWatch* watch) {
  bool erased = false;
  {
    absl::MutexLock lock(&mu_);
    auto g = generations_.find(watch->generation().generation);
    if (g != generations_.end()) {
      auto bucket = g->second.waiting.find(watch->next_step());
      if (bucket != g->second.waiting.end()) {
        std::vector<ScheduleWatch*>& watches = bucket->second;
        auto it = std::find(watches.begin(), watches.end(), watch);
        if (it != watches.end()) {
          *it = watches.back();
          watches.pop_back();
          erased = true;
          --streams_;
        }
        if (watches.empty()) g->second.waiting.erase(bucket);
      }
      if (g->second.waiting.empty()) generations_.erase(g);
    }
  }
  if (erased) watch->Unref();
}

int ScheduleFeed::subscribers() const {
  absl::MutexLock lock(&mu_);
  return streams_;
}

std::vector<ScheduleWatch*> ScheduleFeed::RefAll(
    const GenerationStreams& streams) {
  std::vector<ScheduleWatch*> all;
  for (const auto& [step, watches] : streams.waiting) {
    for (ScheduleWatch* w : watches) {
      w->Ref();
      all.push_back(w);
    }
  }
  return all;
}

void ScheduleFeed::Shutdown() {
  std::vector<ScheduleWatch*> watches;
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return;
    stopped_ = true;
    for (const auto& [number, streams] : generations_) {
      std::vector<ScheduleWatch*> some = RefAll(streams);
      watches.insert(watches.end(), some.begin(), some.end());
    }
  }
  log_->Wake();
  if (pusher_.joinable()) pusher_.join();
  for (ScheduleWatch* w : watches) {
    w->End(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        "coordinator is shutting down"));
    w->Unref();
  }
}

void ScheduleFeed::Run() {
  int64_t floor = std::numeric_limits<int64_t>::min();
  int64_t news_seen = 0;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (stopped_) return;
    }
    const ScheduleLog::FeedState state = log_->AwaitFeedChange(
        floor, news_seen, absl::Now() + options_.poll_interval);
    if (log_->is_shut_down()) return;
    floor = state.floor;
    news_seen = state.news.sequence;
    // A commit rides on the schedule its step made pushable (a commit of s
    // raised the floor to s: s + 1 + push_ahead goes out with it); the
    // streams that wait for no such step get it alone, as does a stream
    // opened since the last wake that may still lack it.
    PushAvailable(floor, state.news);
    PushNews(state.news);
  }
}

void ScheduleFeed::PushAvailable(int64_t floor, const CommitNews& news) {
  const int push_ahead =
      std::clamp(options_.push_ahead, 0, log_->options().read_ahead);
  const int64_t limit = floor + 1 + push_ahead;
  // The generations streams are open for (usually one; two around a change).
  std::vector<int64_t> numbers;
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return;
    for (const auto& [number, streams] : generations_) {
      if (!streams.ended) numbers.push_back(number);
    }
  }
  for (const int64_t number : numbers) PushGeneration(number, limit, news);
}

void ScheduleFeed::PushNews(const CommitNews& news) {
  std::vector<ScheduleWatch*> targets;
  std::vector<int64_t> ended;
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return;
    auto g = generations_.find(news.generation);
    // Only a new commit, or a stream opened since the last look, can lack it.
    const bool look = news.sequence != news_pushed_ || subscribed_;
    news_pushed_ = news.sequence;
    subscribed_ = false;
    if (look && g != generations_.end() && !g->second.ended) {
      for (const auto& [step, watches] : g->second.waiting) {
        for (ScheduleWatch* w : watches) {
          if (w->commit_step() >= news.step) continue;
          w->set_commit_step(news.step);
          w->Ref();
          targets.push_back(w);
        }
      }
    }
    for (const auto& [number, streams] : generations_) {
      if (number <= news.ended_generation && !streams.ended) {
        ended.push_back(number);
      }
    }
  }
  if (!targets.empty()) {
    std::shared_ptr<const grpc::ByteBuffer> message = CommitMessage(news);
    for (ScheduleWatch* w : targets) {
      if (message != nullptr) w->Push(message, /*last=*/false);
      w->Unref();
    }
  }
  // After the commit: the streams end behind it.
  for (const int64_t number : ended) EndGeneration(number, EndedWhy(number));
}

void ScheduleFeed::EndStreamOf(int64_t worker_id, int64_t generation,
                               const grpc::Status& status) {
  std::vector<ScheduleWatch*> targets;
  {
    absl::MutexLock lock(&mu_);
    auto g = generations_.find(generation);
    if (g == generations_.end()) return;
    for (ScheduleWatch* w : RefAll(g->second)) {
      if (w->worker_id() == worker_id) {
        targets.push_back(w);
      } else {
        w->Unref();
      }
    }
  }
  for (ScheduleWatch* w : targets) {
    w->End(status, /*drop_queued=*/false);
    w->Unref();
  }
}

void ScheduleFeed::EndGeneration(int64_t number, const std::string& why) {
  std::vector<ScheduleWatch*> ended;
  {
    absl::MutexLock lock(&mu_);
    auto g = generations_.find(number);
    if (g == generations_.end()) return;
    g->second.ended = true;
    ended = RefAll(g->second);
  }
  for (ScheduleWatch* w : ended) {
    w->End(grpc::Status(grpc::StatusCode::ABORTED, why),
           /*drop_queued=*/false);
    w->Unref();
  }
}

void ScheduleFeed::PushGeneration(int64_t number, int64_t limit,
                                  const CommitNews& news) {
  while (true) {
    // The earliest step a stream of this generation waits for.
    int64_t step;
    GenerationContext generation;
    {
      absl::MutexLock lock(&mu_);
      if (stopped_) return;
      auto g = generations_.find(number);
      if (g == generations_.end() || g->second.ended ||
          g->second.waiting.empty()) {
        return;
      }
      step = g->second.waiting.begin()->first;
      generation = g->second.context;
    }
    // A later generation began: this one's streams end now, whatever step
    // they wait for.
    const int64_t current = log_->generation();
    if (number < current) {
      EndGeneration(number,
                    absl::StrCat("generation ", number, " ended (generation ",
                                 current, " began): re-form"));
      return;
    }
    if (step > limit) return;
    // Within the read-ahead window: seals (and persists) without waiting.
    absl::StatusOr<ScheduleRead> read =
        log_->GetSchedule(step, generation, absl::Now());
    if (!read.ok()) {
      if (read.status().code() == absl::StatusCode::kAborted) {
        // The generation ended: its workers re-form and open new streams.
        EndGeneration(number, std::string(read.status().message()));
        return;
      }
      // No model yet, a shutdown, or a failed persist: the next wake retries.
      if (read.status().code() != absl::StatusCode::kFailedPrecondition &&
          read.status().code() != absl::StatusCode::kUnavailable) {
        std::cerr << "hsdp-coordinator: pushing step " << step << ": "
                  << read.status() << "\n";
      }
      return;
    }
    // Serialized once: every stream writes these bytes (those still lacking
    // the latest commit, the same with the commit).
    WatchSchedulesResponse response;
    response.set_step(step);
    if (read->drained) {
      response.set_drained(true);
    } else {
      response.set_schedule(read->sealed->bytes);
    }
    std::shared_ptr<const grpc::ByteBuffer> message = Serialize(response);
    std::shared_ptr<const grpc::ByteBuffer> with_commit;
    const bool has_news = news.generation == number && news.step >= 0;
    if (has_news) {
      SetCommit(news, &response);
      with_commit = Serialize(response);
    }
    if (message == nullptr || (has_news && with_commit == nullptr)) {
      std::cerr << "hsdp-coordinator: pushing step " << step
                << ": cannot serialize it\n";
      return;
    }
    const int64_t next = read->drained ? kNoStep : step + 1;
    std::vector<ScheduleWatch*> targets;
    // Per target: it gets the commit with the step.
    std::vector<bool> commit;
    {
      absl::MutexLock lock(&mu_);
      auto g = generations_.find(number);
      if (g == generations_.end()) return;
      auto bucket = g->second.waiting.find(step);
      if (bucket == g->second.waiting.end()) continue;
      targets = std::move(bucket->second);
      g->second.waiting.erase(bucket);
      std::vector<ScheduleWatch*>& moved = g->second.waiting[next];
      for (ScheduleWatch* w : targets) {
        w->Ref();
        w->set_next_step(next);
        moved.push_back(w);
        commit.push_back(has_news && w->commit_step() < news.step);
        if (commit.back()) w->set_commit_step(news.step);
      }
    }
    for (size_t i = 0; i < targets.size(); ++i) {
      targets[i]->Push(commit[i] ? with_commit : message,
                       /*last=*/read->drained);
      targets[i]->Unref();
    }
  }
}

}  // namespace hsdp::coordinator
