#include "worker/relay/host_relay.h"

#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/status_util.h"
#include "common/token.h"

namespace hsdp::relay {
namespace {

// How often a waiting local stream looks whether its worker went away.
constexpr absl::Duration kPoll = absl::Milliseconds(100);
// How long the upstream report stream may stay idle before an empty message
// probes it: the synchronous client learns that the coordinator ended the
// stream (a refused message) only when it writes, and a worker may be waiting
// for a commit its refused vote will never bring.
constexpr absl::Duration kProbeInterval = absl::Seconds(1);
// The coordinator's report-stream marker: "2" counts votes, "3" takes
// relayed messages. Local workers send no relayed messages, so they are
// told at most "2".
constexpr char kReportStreamKey[] = "hsdp-report-stream";
constexpr char kLocalMarkerMax[] = "2";
constexpr char kRelayedVersion[] = "3";

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()),
                      std::string(s.message()));
}

absl::Status FromGrpc(const grpc::Status& s, absl::string_view what) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat(what, ": ", s.error_message()));
}

// A message that carries a step (a schedule, or the drained answer), as
// opposed to a commit alone.
bool HasStep(const hsdp::v1::WatchSchedulesResponse& m) {
  return !m.schedule().empty() || m.drained();
}

hsdp::v1::WatchSchedulesResponse CommitOnly(
    const hsdp::v1::CommitStepResponse& commit) {
  hsdp::v1::WatchSchedulesResponse m;
  *m.mutable_committed() = commit;
  return m;
}

}  // namespace

// One generation's upstream schedule stream and what it brought.
struct HostRelay::Feed {
  int64_t from_step = 0;
  grpc::ClientContext context;
  std::thread reader;
  // Guarded by the relay's mu_.
  std::deque<hsdp::v1::WatchSchedulesResponse> log;
  size_t log_base = 0;  // index of log.front() among all messages received
  std::optional<hsdp::v1::CommitStepResponse> latest_commit;
  bool ended = false;
  grpc::Status end_status;
};

// A local report stream, while it is open (guarded by the relay's mu_).
struct HostRelay::LocalReader {
  grpc::ServerContext* context = nullptr;
  absl::Status failed;
};

// A local stream that closed its side waits here until the upstream stream
// that carried its messages was closed and recorded.
struct HostRelay::Barrier {
  bool done = false;
  absl::Status status;
};

struct HostRelay::Queued {
  hsdp::v1::StreamReportsRequest message;
  std::shared_ptr<Barrier> barrier;  // set: a barrier, not a message
};

HostRelay::HostRelay(std::shared_ptr<grpc::Channel> upstream, Options options)
    : options_(std::move(options)),
      stub_(hsdp::v1::CoordinatorService::NewStub(std::move(upstream))) {
  uplink_ = std::thread([this] { RunUplink(); });
}

HostRelay::~HostRelay() { Stop(); }

void HostRelay::Stop() {
  std::vector<std::shared_ptr<Feed>> feeds;
  {
    absl::MutexLock lock(&mu_);
    if (stop_) return;
    stop_ = true;
    for (auto& [key, feed] : feeds_) feeds.push_back(feed);
    feeds.insert(feeds.end(), retired_.begin(), retired_.end());
    feeds_.clear();
    retired_.clear();
    for (LocalReader* r : readers_) r->context->TryCancel();
  }
  for (auto& feed : feeds) feed->context.TryCancel();
  if (uplink_.joinable()) uplink_.join();
  for (auto& feed : feeds) {
    if (feed->reader.joinable()) feed->reader.join();
  }
}

HostRelay::Stats HostRelay::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

absl::Status HostRelay::CheckToken(const grpc::ServerContext& context) const {
  if (options_.job_token.empty()) return absl::OkStatus();
  const auto& metadata = context.client_metadata();
  auto it = metadata.find(kAuthorizationMetadata);
  const std::string expected = absl::StrCat(kBearerPrefix, options_.job_token);
  if (it == metadata.end() ||
      !ConstantTimeEquals(
          absl::string_view(it->second.data(), it->second.size()), expected)) {
    return absl::UnauthenticatedError(
        "authorization: the relay takes streams that carry the job token "
        "(Bearer)");
  }
  return absl::OkStatus();
}

// ---- Schedules down -------------------------------------------------------

std::shared_ptr<HostRelay::Feed> HostRelay::FeedForLocked(
    const hsdp::v1::WatchSchedulesRequest& request) {
  auto it = feeds_.find({request.job_id(), request.generation()});
  if (it != feeds_.end()) {
    if (!it->second->ended && request.from_step() >= it->second->from_step) {
      return it->second;
    }
    // Ended, or started after the step asked for: a new upstream stream
    // replaces it (the old one's local streams end and reopen).
    it->second->context.TryCancel();
    retired_.push_back(std::move(it->second));
    feeds_.erase(it);
  }
  // Earlier generations' streams end by themselves (ABORTED).
  for (auto i = feeds_.begin(); i != feeds_.end();) {
    if (i->second->ended) {
      retired_.push_back(std::move(i->second));
      i = feeds_.erase(i);
    } else {
      ++i;
    }
  }
  // A retired feed that ended has a finished reader (`ended` is the last
  // thing it sets under mu_): join it now rather than keep its thread until
  // Stop.
  for (auto i = retired_.begin(); i != retired_.end();) {
    if ((*i)->ended) {
      if ((*i)->reader.joinable()) (*i)->reader.join();
      i = retired_.erase(i);
    } else {
      ++i;
    }
  }
  auto feed = std::make_shared<Feed>();
  feed->from_step = request.from_step();
  ++stats_.upstream_watches;
  hsdp::v1::WatchSchedulesRequest upstream = request;
  upstream.set_relay(true);
  feed->reader =
      std::thread([this, feed, upstream] { ReadFeed(feed, upstream); });
  feeds_[{request.job_id(), request.generation()}] = feed;
  return feed;
}

void HostRelay::ReadFeed(std::shared_ptr<Feed> feed,
                         hsdp::v1::WatchSchedulesRequest request) {
  std::unique_ptr<grpc::ClientReader<hsdp::v1::WatchSchedulesResponse>> reader =
      stub_->WatchSchedules(&feed->context, request);
  hsdp::v1::WatchSchedulesResponse message;
  while (reader->Read(&message)) {
    absl::MutexLock lock(&mu_);
    if (message.has_committed() &&
        (!feed->latest_commit.has_value() ||
         message.committed().step() > feed->latest_commit->step())) {
      feed->latest_commit = message.committed();
    }
    feed->log.push_back(std::move(message));
    message.Clear();
    while (feed->log.size() > static_cast<size_t>(options_.keep_messages)) {
      feed->log.pop_front();
      ++feed->log_base;
    }
  }
  const grpc::Status status = reader->Finish();
  absl::MutexLock lock(&mu_);
  feed->ended = true;
  feed->end_status = status;
}

grpc::Status HostRelay::WatchSchedules(
    grpc::ServerContext* context,
    const hsdp::v1::WatchSchedulesRequest* request,
    grpc::ServerWriter<hsdp::v1::WatchSchedulesResponse>* writer) {
  if (absl::Status s = CheckToken(*context); !s.ok()) return ToGrpc(s);
  if (request->worker_id() == 0) {
    return ToGrpc(absl::InvalidArgumentError(
        "WatchSchedulesRequest.worker_id: the relay carries the streams of "
        "workers that joined (worker_id and generation set)"));
  }
  const int64_t from_step = request->from_step();
  std::shared_ptr<Feed> feed;
  size_t cursor = 0;
  int64_t failures = 0;
  std::optional<hsdp::v1::WatchSchedulesResponse> replay;
  {
    absl::MutexLock lock(&mu_);
    if (stop_) {
      return ToGrpc(absl::UnavailableError("the relay is stopping"));
    }
    feed = FeedForLocked(*request);
    failures = failures_;
    ++stats_.local_watches;
    cursor = feed->log_base + feed->log.size();
    for (size_t i = 0; i < feed->log.size(); ++i) {
      const hsdp::v1::WatchSchedulesResponse& m = feed->log[i];
      if (!HasStep(m) || m.step() < from_step) continue;
      if (m.step() > from_step && feed->log_base > 0) {
        // Its step was dropped from the log: GetSchedule serves it.
        return ToGrpc(absl::UnavailableError(
            absl::StrCat("the relay no longer holds step ", from_step)));
      }
      cursor = feed->log_base + i;
      break;
    }
    if (feed->latest_commit.has_value()) {
      replay = CommitOnly(*feed->latest_commit);
    }
  }
  if (replay.has_value() && !writer->Write(*replay)) {
    return WorkerWentAway(*request);
  }
  while (true) {
    std::vector<hsdp::v1::WatchSchedulesResponse> out;
    std::optional<grpc::Status> end;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || failures_ != failures || feed->ended ||
               feed->log_base + feed->log.size() > cursor;
      };
      mu_.AwaitWithTimeout(absl::Condition(&ready), kPoll);
      if (stop_) return ToGrpc(absl::UnavailableError("the relay is stopping"));
      if (failures_ != failures) return ToGrpc(last_failure_);
      if (cursor < feed->log_base) {
        return ToGrpc(absl::UnavailableError(
            "this worker's schedule stream fell behind the relay"));
      }
      for (size_t i = cursor - feed->log_base; i < feed->log.size(); ++i) {
        const hsdp::v1::WatchSchedulesResponse& m = feed->log[i];
        if (!HasStep(m) || m.step() >= from_step) {
          out.push_back(m);
        } else if (m.has_committed()) {
          out.push_back(CommitOnly(m.committed()));
        }
      }
      cursor = feed->log_base + feed->log.size();
      if (out.empty() && feed->ended) end = feed->end_status;
    }
    if (context->IsCancelled()) return WorkerWentAway(*request);
    for (const hsdp::v1::WatchSchedulesResponse& m : out) {
      if (!writer->Write(m)) return WorkerWentAway(*request);
    }
    if (end.has_value()) return *end;
  }
}

grpc::Status HostRelay::WorkerWentAway(
    const hsdp::v1::WatchSchedulesRequest& request) {
  // The coordinator would have seen this end on a stream of its own: tell it,
  // so an ending generation does not wait for a worker that is gone.
  hsdp::v1::StreamReportsRequest lost;
  lost.mutable_stream_lost()->set_job_id(request.job_id());
  lost.mutable_stream_lost()->set_worker_id(request.worker_id());
  lost.mutable_stream_lost()->set_generation(request.generation());
  absl::MutexLock lock(&mu_);
  if (!stop_) queue_.push_back(Queued{std::move(lost), nullptr});
  return grpc::Status(grpc::StatusCode::CANCELLED, "the worker went away");
}

// ---- Reports and votes up ---------------------------------------------------

absl::Status HostRelay::OpenUpstreamLocked() {
  if (up_writer_ != nullptr) return absl::OkStatus();
  up_context_ = std::make_unique<grpc::ClientContext>();
  up_response_.Clear();
  up_writer_ = stub_->StreamReports(up_context_.get(), &up_response_);
  up_writer_->WaitForInitialMetadata();
  const auto& metadata = up_context_->GetServerInitialMetadata();
  auto it = metadata.find(kReportStreamKey);
  if (it == metadata.end()) {
    // No marker: the stream failed (e.g. UNIMPLEMENTED by an older
    // coordinator, or unreachable); Finish says why.
    absl::Status s = CloseUpstreamLocked(/*writes_done=*/false);
    return s.ok() ? absl::UnavailableError(
                        "the coordinator's report stream did not open")
                  : s;
  }
  up_marker_ = std::string(it->second.data(), it->second.size());
  absl::MutexLock lock(&mu_);
  ++stats_.upstream_report_streams;
  return absl::OkStatus();
}

absl::Status HostRelay::CloseUpstreamLocked(bool writes_done) {
  if (up_writer_ == nullptr) return absl::OkStatus();
  if (writes_done) up_writer_->WritesDone();
  const grpc::Status status = up_writer_->Finish();
  up_writer_.reset();
  up_context_.reset();
  up_marker_.clear();
  return FromGrpc(status, "the coordinator's report stream");
}

absl::Status HostRelay::WriteLocked(
    std::vector<hsdp::v1::StreamReportsRequest> batch) {
  if (absl::Status s = OpenUpstreamLocked(); !s.ok()) return s;
  const size_t relayed = batch.size();
  std::vector<hsdp::v1::StreamReportsRequest> messages;
  if (up_marker_ >= kRelayedVersion) {
    // One message: the first worker's part, the others relayed.
    messages.push_back(std::move(batch.front()));
    for (size_t i = 1; i < batch.size(); ++i) {
      *messages.front().add_relayed() = std::move(batch[i]);
    }
  } else {
    messages = std::move(batch);  // an older coordinator: one each
  }
  for (const hsdp::v1::StreamReportsRequest& m : messages) {
    HSDP_RETURN_IF_ERROR(WriteOneLocked(m));
  }
  absl::MutexLock lock(&mu_);
  stats_.upstream_messages += static_cast<int64_t>(messages.size());
  stats_.relayed += static_cast<int64_t>(relayed);
  return absl::OkStatus();
}

absl::Status HostRelay::WriteOneLocked(
    const hsdp::v1::StreamReportsRequest& message) {
  if (up_writer_ == nullptr || up_writer_->Write(message)) {
    return absl::OkStatus();
  }
  absl::Status s = CloseUpstreamLocked(/*writes_done=*/false);
  return s.ok()
             ? absl::UnavailableError("the coordinator's report stream ended")
             : s;
}

void HostRelay::FailLocals(const absl::Status& why) {
  absl::MutexLock lock(&mu_);
  ++failures_;
  last_failure_ = why;
  for (LocalReader* r : readers_) {
    r->failed = why;
    r->context->TryCancel();
  }
}

void HostRelay::RunUplink() {
  while (true) {
    std::vector<hsdp::v1::StreamReportsRequest> batch;
    std::shared_ptr<Barrier> barrier;
    bool idle = false;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || !queue_.empty();
      };
      idle = !mu_.AwaitWithTimeout(absl::Condition(&ready), kProbeInterval);
      // What was queued before Stop still goes up.
      if (stop_ && queue_.empty()) break;
      // Everything queued while the last write was in flight goes together,
      // up to the first barrier (which waits for what came before it).
      while (!queue_.empty()) {
        Queued& q = queue_.front();
        if (q.barrier != nullptr) {
          if (batch.empty()) {
            barrier = std::move(q.barrier);
            queue_.pop_front();
          }
          break;
        }
        batch.push_back(std::move(q.message));
        queue_.pop_front();
      }
    }
    absl::Status failed;
    absl::Status closed;
    {
      absl::MutexLock up(&up_mu_);
      if (!batch.empty()) {
        failed = WriteLocked(std::move(batch));
      } else if (idle) {
        // An empty message records nothing; written to a stream the
        // coordinator ended, it fails and says why.
        failed = WriteOneLocked(hsdp::v1::StreamReportsRequest());
      }
      if (barrier != nullptr)
        closed = CloseUpstreamLocked(/*writes_done=*/true);
    }
    if (barrier != nullptr) {
      absl::MutexLock lock(&mu_);
      barrier->done = true;
      barrier->status = closed;
    }
    if (!failed.ok()) FailLocals(failed);
    if (!closed.ok()) FailLocals(closed);
  }
  absl::MutexLock up(&up_mu_);
  CloseUpstreamLocked(/*writes_done=*/true).IgnoreError();
}

grpc::Status HostRelay::StreamReports(
    grpc::ServerContext* context,
    grpc::ServerReader<hsdp::v1::StreamReportsRequest>* reader,
    hsdp::v1::StreamReportsResponse* /*response*/) {
  if (absl::Status s = CheckToken(*context); !s.ok()) return ToGrpc(s);
  std::string marker;
  {
    absl::MutexLock up(&up_mu_);
    if (absl::Status s = OpenUpstreamLocked(); !s.ok()) return ToGrpc(s);
    marker = std::min<std::string>(up_marker_, kLocalMarkerMax);
  }
  context->AddInitialMetadata(kReportStreamKey, marker);
  reader->SendInitialMetadata();
  LocalReader me;
  me.context = context;
  {
    absl::MutexLock lock(&mu_);
    if (stop_) return ToGrpc(absl::UnavailableError("the relay is stopping"));
    readers_.insert(&me);
  }
  // Leaves the set of open local streams and returns `status`.
  auto leave = [&](const absl::Status& status) {
    absl::MutexLock lock(&mu_);
    readers_.erase(&me);
    return ToGrpc(status);
  };
  hsdp::v1::StreamReportsRequest message;
  while (reader->Read(&message)) {
    if (message.relayed_size() > 0) {
      return leave(absl::InvalidArgumentError(
          "StreamReportsRequest.relayed: a worker sends its own messages "
          "only; the relay adds the relayed ones"));
    }
    absl::MutexLock lock(&mu_);
    if (!me.failed.ok() || stop_) break;
    queue_.push_back(Queued{std::move(message), nullptr});
    message.Clear();
  }
  auto barrier = std::make_shared<Barrier>();
  {
    absl::MutexLock lock(&mu_);
    if (!me.failed.ok()) {
      readers_.erase(&me);
      return ToGrpc(me.failed);
    }
    if (stop_) {
      readers_.erase(&me);
      return ToGrpc(absl::UnavailableError("the relay is stopping"));
    }
    if (context->IsCancelled()) {
      readers_.erase(&me);
      return grpc::Status(grpc::StatusCode::CANCELLED, "the worker went away");
    }
    // The worker closed its side: answer once everything it sent was
    // recorded.
    queue_.push_back(Queued{{}, barrier});
    auto recorded = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return barrier->done || stop_ || !me.failed.ok();
    };
    mu_.Await(absl::Condition(&recorded));
    readers_.erase(&me);
    if (barrier->done) return ToGrpc(barrier->status);
    if (!me.failed.ok()) return ToGrpc(me.failed);
    return ToGrpc(absl::UnavailableError("the relay is stopping"));
  }
}

}  // namespace hsdp::relay
