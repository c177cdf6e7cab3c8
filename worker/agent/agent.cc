#include "worker/agent/agent.h"

#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>
#include <grpcpp/support/client_interceptor.h>

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/file_util.h"
#include "common/status_util.h"
#include "common/token.h"
#include "worker/agent/agent_internal.h"

namespace hsdp::agent {
namespace {

// Extra time on a store call's RPC deadline beyond the store timeout itself, so
// the coordinator's own DEADLINE_EXCEEDED (which names the key) arrives before
// the transport's.
constexpr absl::Duration kStoreDeadlineSlack = absl::Seconds(5);
// Default heartbeat period when the coordinator does not say.
constexpr int kDefaultHeartbeatMs = 1000;
// gRPC keepalive on the channel: notice a dead coordinator within seconds even
// on idle channels.
constexpr int kKeepaliveTimeMs = 10000;
constexpr int kKeepaliveTimeoutMs = 5000;
// After the coordinator's connection drops, the channel re-resolves its name
// before connecting again; gRPC's DNS resolver allows that only once per 30 s
// by default, longer than a heartbeat timeout, so a restarted coordinator
// would see none of its workers in time and declare them all lost.
constexpr int kMinTimeBetweenResolutionsMs = 500;
// What the coordinator says of a worker it gave up (no heartbeat in time).
constexpr char kDeclaredLost[] = "was declared lost";

// Adds `authorization: Bearer <job token>` to the initial metadata of every
// call on the channel.
class BearerInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit BearerInterceptor(const std::string* authorization)
      : authorization_(authorization) {}
  void Intercept(
      grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::
                PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->emplace(kAuthorizationMetadata,
                                                 *authorization_);
    }
    methods->Proceed();
  }

 private:
  const std::string* const authorization_;
};

// Owned by the channel, which may outlive the Agent: it keeps its own copy.
class BearerInterceptorFactory final
    : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit BearerInterceptorFactory(const std::string& token)
      : authorization_(absl::StrCat(kBearerPrefix, token)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo* /*info*/) override {
    return new BearerInterceptor(&authorization_);
  }

 private:
  const std::string authorization_;
};

absl::StatusOr<std::string> ReadPemFile(const std::string& path,
                                        absl::string_view what) {
  absl::StatusOr<std::string> contents = ReadFile(path);
  if (!contents.ok()) return AnnotateStatus(contents.status(), what);
  return contents;
}

absl::Status CheckTlsOptions(const AgentOptions& o) {
  if (o.tls_client_cert_pem.empty() != o.tls_client_key_pem.empty()) {
    return absl::InvalidArgumentError(
        "a TLS client certificate and its key go together");
  }
  if (!o.tls_client_cert_pem.empty() && o.tls_ca_pem.empty()) {
    return absl::InvalidArgumentError(
        "a TLS client certificate needs the CA of the coordinator (--tls-ca)");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status LoadAgentSecurityFiles(const AgentSecurityFiles& files,
                                    AgentOptions* options) {
  if (!files.job_token_file.empty()) {
    absl::StatusOr<std::string> token = ReadTokenFile(files.job_token_file);
    if (!token.ok()) return token.status();
    options->job_token = *std::move(token);
  }
  const std::pair<const std::string*, std::string*> pems[] = {
      {&files.tls_ca, &options->tls_ca_pem},
      {&files.tls_client_cert, &options->tls_client_cert_pem},
      {&files.tls_client_key, &options->tls_client_key_pem}};
  for (const auto& [path, pem] : pems) {
    if (path->empty()) continue;
    absl::StatusOr<std::string> contents = ReadPemFile(*path, "TLS file");
    if (!contents.ok()) return contents.status();
    *pem = *std::move(contents);
  }
  return CheckTlsOptions(*options);
}

absl::Status FromGrpc(const grpc::Status& status, const std::string& what) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      absl::StrCat(what, ": ", status.error_message()));
}

std::shared_ptr<grpc::Channel> MakeCoordinatorChannel(
    const AgentOptions& options, const std::string& address, bool secure,
    absl::Status* setup) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveTimeMs);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kKeepaliveTimeoutMs);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // Reconnect quickly after a coordinator restart instead of gRPC's default 1
  // s..120 s backoff.
  args.SetInt(
      GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS,
      static_cast<int>(absl::ToInt64Milliseconds(options.initial_backoff)));
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS,
              static_cast<int>(absl::ToInt64Milliseconds(options.max_backoff)));
  args.SetInt(GRPC_ARG_DNS_MIN_TIME_BETWEEN_RESOLUTIONS_MS,
              kMinTimeBetweenResolutionsMs);
  std::shared_ptr<grpc::ChannelCredentials> creds;
  *setup = CheckTlsOptions(options);
  if (!secure || options.tls_ca_pem.empty()) {
    creds = grpc::InsecureChannelCredentials();
  } else {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.tls_ca_pem;
    ssl.pem_cert_chain = options.tls_client_cert_pem;
    ssl.pem_private_key = options.tls_client_key_pem;
    creds = grpc::SslCredentials(ssl);
  }
  std::string token = options.job_token;
  if (token.empty()) {
    absl::StatusOr<std::string> from_env =
        ResolveToken("", kJobTokenFileEnv, kJobTokenEnv);
    if (from_env.ok()) {
      token = *std::move(from_env);
    } else if (setup->ok()) {
      *setup = from_env.status();
    }
  }
  std::vector<
      std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>>
      interceptors;
  if (!token.empty()) {
    interceptors.push_back(std::make_unique<BearerInterceptorFactory>(token));
  }
  return grpc::experimental::CreateCustomChannelWithInterceptors(
      address, creds, args, std::move(interceptors));
}

Agent::Agent(AgentOptions options) : options_(std::move(options)) {
  auto channel = MakeCoordinatorChannel(options_, options_.coordinator,
                                        /*secure=*/true, &setup_);
  stub_ = hsdp::v1::CoordinatorService::NewStub(channel);
  // With a relay, both streams go to it (a local address: no TLS, the job
  // token still); every call goes to the coordinator.
  std::shared_ptr<grpc::Channel> streams = channel;
  if (!options_.relay.empty()) {
    absl::Status relay_setup;
    streams = MakeCoordinatorChannel(options_, options_.relay,
                                     /*secure=*/false, &relay_setup);
    relay_stub_ = hsdp::v1::CoordinatorService::NewStub(streams);
  }
  if (options_.stream_reports) {
    report_stream_ = std::make_unique<ReportStream>(streams);
  }
}

Agent::~Agent() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    for (grpc::ClientContext* ctx : in_flight_) ctx->TryCancel();
  }
  if (heartbeat_.joinable()) heartbeat_.join();
  if (watcher_.joinable()) watcher_.join();
  if (prefetch_.valid()) prefetch_.wait();
}

hsdp::v1::JoinRequest Agent::MakeJoinRequest(
    std::optional<int> rank_hint) const {
  hsdp::v1::JoinRequest req;
  req.set_job_id(options_.job_id);
  if (rank_hint) req.set_rank_hint(*rank_hint);
  req.set_hostname(options_.hostname);
  req.set_device(options_.device);
  req.set_model(options_.model);
  for (const auto& u : options_.units) *req.add_units() = u;
  if (options_.training.has_value())
    *req.mutable_training() = *options_.training;
  return req;
}

absl::StatusOr<hsdp::v1::JoinResponse> Agent::Join() {
  const hsdp::v1::JoinRequest req = MakeJoinRequest(options_.rank_hint);
  hsdp::v1::JoinResponse resp;
  absl::Status s = CallWithRetry(
      "Join", options_.rpc_timeout,
      [&](grpc::ClientContext& ctx) { return stub_->Join(&ctx, req, &resp); });
  if (!s.ok()) return s;
  absl::MutexLock lock(&mu_);
  join_ = resp;
  membership_ = absl::OkStatus();
  watched_.reset();
  ++join_epoch_;
  return resp;
}

void Agent::AdoptGenerationLocked(const hsdp::v1::Generation& g) {
  int rank = -1;
  for (int r = 0; r < g.worker_ids_size(); ++r) {
    if (g.worker_ids(r) == join_.worker_id()) rank = r;
  }
  const int shard = std::max(1, g.mesh().shard());
  join_.set_rank(rank);
  join_.set_world_size(g.worker_ids_size());
  *join_.mutable_mesh() = g.mesh();
  join_.set_replicate_index(rank >= 0 ? rank / shard : -1);
  join_.set_shard_index(rank >= 0 ? rank % shard : -1);
  join_.set_generation(g.generation());
  join_.set_rendezvous_prefix(g.rendezvous_prefix());
  join_.set_worker_state(rank >= 0 ? hsdp::v1::WORKER_STATE_ALIVE
                                   : hsdp::v1::WORKER_STATE_STANDBY);
  *join_.mutable_generation_info() = g;
  membership_ = absl::OkStatus();
}

int64_t Agent::join_epoch() const {
  absl::MutexLock lock(&mu_);
  return join_epoch_;
}

absl::Status Agent::Rejoin(int64_t seen_epoch) {
  absl::MutexLock rejoin_lock(&rejoin_mu_);
  int64_t old_generation, old_worker_id;
  int old_rank;
  {
    absl::MutexLock lock(&mu_);
    if (join_epoch_ != seen_epoch) return membership_;
    old_generation = join_.generation();
    old_rank = join_.rank();
    old_worker_id = join_.worker_id();
  }
  // Back as the same worker; a coordinator that lost its state does not know
  // the id (NOT_FOUND): then by rank hint, as a client without ids would.
  hsdp::v1::JoinRequest req = MakeJoinRequest(old_rank);
  req.set_worker_id(old_worker_id);
  hsdp::v1::JoinResponse resp;
  auto join = [&](grpc::ClientContext& ctx) {
    return stub_->Join(&ctx, req, &resp);
  };
  absl::Status s = CallWithRetry("Join (after coordinator restart)",
                                 options_.rpc_timeout, join);
  if (s.code() == absl::StatusCode::kNotFound && old_worker_id != 0) {
    req.clear_worker_id();
    s = CallWithRetry("Join (after coordinator restart)", options_.rpc_timeout,
                      join);
  }
  if (s.code() == absl::StatusCode::kFailedPrecondition &&
      absl::StrContains(s.message(), kDeclaredLost)) {
    // Not a restart that forgot this worker: the coordinator gave it up. The
    // training thread re-forms, and waiting for a generation tells it to join
    // again as a new worker (worker/agent/ELASTIC.md).
    return absl::AbortedError(absl::StrCat(s.message(), ": re-form"));
  }
  if (!s.ok()) return s;
  absl::MutexLock lock(&mu_);
  if (resp.rank() != old_rank || resp.generation() != old_generation) {
    membership_ = absl::AbortedError(absl::StrCat(
        "re-joined the restarted coordinator as rank ", resp.rank(),
        " generation ", resp.generation(), ", was rank ", old_rank,
        " generation ", old_generation, ": re-form"));
    return membership_;
  }
  join_.set_worker_id(resp.worker_id());
  ++join_epoch_;
  return absl::OkStatus();
}

void Agent::StartHeartbeat() {
  if (heartbeat_.joinable()) return;
  heartbeat_ = std::thread([this] { HeartbeatLoop(); });
}

void Agent::HeartbeatLoop() {
  absl::Duration interval;
  {
    absl::MutexLock lock(&mu_);
    const int ms = join_.heartbeat_interval_ms() > 0
                       ? join_.heartbeat_interval_ms()
                       : kDefaultHeartbeatMs;
    interval = absl::Milliseconds(ms);
  }
  while (true) {
    hsdp::v1::HeartbeatRequest req;
    bool member;
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stop_), interval)) return;
      req.set_job_id(options_.job_id);
      req.set_rank(join_.rank());
      req.set_generation(join_.generation());
      req.set_worker_id(join_.worker_id());
      member = join_.rank() >= 0;
    }
    req.set_step(current_step_.load());
    const int64_t epoch = join_epoch();
    // One attempt per period: a missed heartbeat is simply retried next period,
    // so the thread never blocks the destructor for a whole retry budget.
    grpc::ClientContext ctx;
    internal::SetDeadline(ctx, std::min(options_.rpc_timeout, interval * 2));
    // Wait for the connection (within the deadline) rather than fail at once
    // while the channel is reconnecting: a queued call is what makes an idle
    // channel connect again, so the first heartbeat after a coordinator
    // restart goes out as soon as it listens.
    ctx.set_wait_for_ready(true);
    hsdp::v1::HeartbeatResponse resp;
    const int64_t send_nanos = absl::GetCurrentTimeNanos();
    absl::Status s = FromGrpc(stub_->Heartbeat(&ctx, req, &resp), "Heartbeat");
    if (s.ok()) {
      clock_.AddSample(send_nanos, resp.server_time_unix_nanos(),
                       absl::GetCurrentTimeNanos());
    }
    if (s.ok()) {
      absl::MutexLock lock(&mu_);
      if (!membership_.ok() || req.generation() != join_.generation()) {
        // Already told, or the training thread moved on meanwhile.
      } else if (resp.job_state() == hsdp::v1::JOB_STATE_FAILED ||
                 resp.worker_state() == hsdp::v1::WORKER_STATE_EVICTED) {
        membership_ = absl::FailedPreconditionError(absl::StrCat(
            resp.job_state() == hsdp::v1::JOB_STATE_FAILED ? "the job failed"
                                                           : "evicted",
            ": ", resp.message()));
      } else if (member &&
                 (resp.generation() != join_.generation() ||
                  resp.job_state() == hsdp::v1::JOB_STATE_REFORMING)) {
        membership_ = absl::AbortedError(absl::StrCat(
            "generation ", join_.generation(),
            " ended (the job is at generation ", resp.generation(), ", ",
            hsdp::v1::JobState_Name(resp.job_state()), "): re-form"));
      }
    } else if (internal::IsMembershipLoss(s.code())) {
      // Coordinator restarted without this worker: re-join in the background so
      // the training thread's next call finds the membership back.
      Rejoin(epoch).IgnoreError();
    }
  }
}

absl::StatusOr<hsdp::v1::GetScheduleResponse> Agent::FetchSchedule(
    int64_t step) {
  hsdp::v1::GetScheduleRequest req;
  {
    absl::MutexLock lock(&mu_);
    req.set_rank(join_.rank());
    req.set_worker_id(join_.worker_id());
    req.set_generation(join_.generation());
  }
  req.set_job_id(options_.job_id);
  req.set_step(step);
  hsdp::v1::GetScheduleResponse resp;
  const std::string what = absl::StrCat("GetSchedule(step ", step, ")");
  constexpr int kMaxRejoins = 3;
  for (int rejoins = 0;; ++rejoins) {
    absl::Status s;
    const int64_t epoch = join_epoch();
    // A long-poll attempt that runs out its deadline only means the step was
    // not yet available.
    do {
      s = CallWithRetry(what, options_.schedule_poll_timeout,
                        [&](grpc::ClientContext& ctx) {
                          return stub_->GetSchedule(&ctx, req, &resp);
                        });
    } while (s.code() == absl::StatusCode::kDeadlineExceeded);
    if (s.ok()) return resp;
    if (!internal::IsMembershipLoss(s.code()) || rejoins >= kMaxRejoins)
      return s;
    if (absl::Status r = Rejoin(epoch); !r.ok()) return r;
  }
}

absl::StatusOr<hsdp::v1::GetScheduleResponse> Agent::GetSchedule(
    int64_t step, int64_t last_step) {
  if (options_.watch_schedules) {
    // One stream per generation: a new generation's schedules come on a new
    // stream (the old one ended ABORTED).
    if (schedule_stream_ == nullptr ||
        schedule_stream_->generation() != generation()) {
      schedule_stream_.reset();
      schedule_stream_ = std::make_unique<ScheduleStream>(
          relay_stub_ != nullptr ? relay_stub_.get() : stub_.get(),
          options_.job_id, worker_id(), rank(), generation(), step,
          ScheduleStream::Options{options_.initial_backoff,
                                  options_.max_backoff});
    }
    if (auto pushed =
            schedule_stream_->Take(step, options_.schedule_poll_timeout)) {
      return *std::move(pushed);
    }
  }
  absl::StatusOr<hsdp::v1::GetScheduleResponse> result;
  const int64_t current = generation();
  if (prefetch_.valid() && prefetch_step_ == step &&
      prefetch_generation_ == current) {
    result = prefetch_.get();
  } else {
    if (prefetch_.valid())
      prefetch_.wait();  // a stale prefetch (e.g. after resume): discard
    prefetch_ = {};
    result = FetchSchedule(step);
  }
  prefetch_step_ = -1;
  if (result.ok() && !result->drained() && step + 1 <= last_step) {
    prefetch_step_ = step + 1;
    prefetch_generation_ = current;
    prefetch_ = std::async(std::launch::async, [this, next = step + 1] {
      return FetchSchedule(next);
    });
  }
  return result;
}

absl::Status Agent::ReportStep(const hsdp::v1::StepReport& report,
                               bool finished) {
  hsdp::v1::ReportStepRequest req;
  req.set_job_id(options_.job_id);
  *req.mutable_report() = report;
  {
    absl::MutexLock lock(&mu_);
    req.mutable_report()->set_worker_id(join_.worker_id());
    req.mutable_report()->set_generation(join_.generation());
    if (join_.rank() >= 0) req.mutable_report()->set_rank(join_.rank());
  }
  req.set_finished(finished);
  if (report_stream_ != nullptr) {
    if (!finished) {
      if (report_stream_->Send(req).ok()) return absl::OkStatus();
      // Not sent: the call below carries it, retrying and re-joining.
    } else {
      // The last report is acknowledged, after every streamed one.
      report_stream_->Close().IgnoreError();
    }
  }
  hsdp::v1::ReportStepResponse resp;
  const std::string what = absl::StrCat("ReportStep(step ", report.step(), ")");
  const int64_t epoch = join_epoch();
  absl::Status s =
      CallWithRetry(what, options_.rpc_timeout, [&](grpc::ClientContext& ctx) {
        return stub_->ReportStep(&ctx, req, &resp);
      });
  if (internal::IsMembershipLoss(s.code())) {
    if (absl::Status r = Rejoin(epoch); !r.ok()) return r;
    s = CallWithRetry(what, options_.rpc_timeout,
                      [&](grpc::ClientContext& ctx) {
                        return stub_->ReportStep(&ctx, req, &resp);
                      });
  }
  return s;
}

absl::Status Agent::StoreSet(const std::string& key, const std::string& value) {
  hsdp::v1::StoreSetRequest req;
  req.set_job_id(options_.job_id);
  req.set_generation(generation());
  req.set_key(key);
  req.set_value(value);
  hsdp::v1::StoreSetResponse resp;
  return CallWithRetry(absl::StrCat("StoreSet(", key, ")"),
                       options_.rpc_timeout, [&](grpc::ClientContext& ctx) {
                         return stub_->StoreSet(&ctx, req, &resp);
                       });
}

template <typename Request, typename Rpc>
absl::Status Agent::BlockingStoreCall(const std::string& what,
                                      absl::Duration timeout, Request& req,
                                      Rpc rpc) {
  // The coordinator may cap one call's wait below `timeout`: keep asking until
  // ours runs out.
  const absl::Time deadline = absl::Now() + timeout;
  absl::Status s;
  do {
    const absl::Duration left =
        std::max(deadline - absl::Now(), absl::ZeroDuration());
    req.set_timeout_ms(static_cast<int32_t>(absl::ToInt64Milliseconds(left)));
    s = CallWithRetry(what, left + kStoreDeadlineSlack, rpc);
  } while (s.code() == absl::StatusCode::kDeadlineExceeded &&
           absl::Now() < deadline);
  return s;
}

absl::StatusOr<std::string> Agent::StoreGet(const std::string& key,
                                            absl::Duration timeout) {
  hsdp::v1::StoreGetRequest req;
  req.set_job_id(options_.job_id);
  req.set_generation(generation());
  req.set_key(key);
  hsdp::v1::StoreGetResponse resp;
  absl::Status s =
      BlockingStoreCall(absl::StrCat("StoreGet(", key, ")"), timeout, req,
                        [&](grpc::ClientContext& ctx) {
                          return stub_->StoreGet(&ctx, req, &resp);
                        });
  if (!s.ok()) return s;
  return resp.value();
}

absl::Status Agent::StoreWait(const std::vector<std::string>& keys,
                              absl::Duration timeout) {
  hsdp::v1::StoreWaitRequest req;
  req.set_job_id(options_.job_id);
  req.set_generation(generation());
  for (const auto& k : keys) req.add_keys(k);
  hsdp::v1::StoreWaitResponse resp;
  return BlockingStoreCall(
      absl::StrCat("StoreWait(", absl::StrJoin(keys, ","), ")"), timeout, req,
      [&](grpc::ClientContext& ctx) {
        return stub_->StoreWait(&ctx, req, &resp);
      });
}

int Agent::rank() const {
  absl::MutexLock lock(&mu_);
  return join_.rank();
}

int64_t Agent::generation() const {
  absl::MutexLock lock(&mu_);
  return join_.generation();
}

int64_t Agent::worker_id() const {
  absl::MutexLock lock(&mu_);
  return join_.worker_id();
}

hsdp::v1::Generation Agent::generation_info() const {
  absl::MutexLock lock(&mu_);
  return join_.generation_info();
}

hsdp::v1::JoinResponse Agent::join_response() const {
  absl::MutexLock lock(&mu_);
  return join_;
}

absl::Status Agent::membership_status() const {
  absl::MutexLock lock(&mu_);
  return membership_;
}

}  // namespace hsdp::agent
