// The worker's gRPC client of the coordinator (CoordinatorService).
//
// Join, a heartbeat on its own thread, schedule fetches with the next step
// prefetched in the background (so no RPC sits on the training critical path),
// step reports, the rendezvous key-value RPCs used by CoordinatorStore, and
// the elastic protocol (worker/agent/ELASTIC.md): AwaitGeneration, CommitStep,
// ReportFailure and a generation watcher that tells the training thread's
// owner, from its own thread, that the generation ended.
//
// What a status code means to the caller (the retry rules):
// - UNAVAILABLE, RESOURCE_EXHAUSTED: retried with exponential backoff until
//   `retry_budget` has passed since the first failure, so a coordinator that
//   comes back on its state directory within the budget loses no step.
// - ABORTED: never retried; it has one meaning: this worker's generation
//   ended — abort the communicators, AwaitGeneration, re-form.
// - DEADLINE_EXCEEDED from a long poll (GetSchedule, AwaitGeneration,
//   CommitStep, store waits): nothing changed yet; polled again until the
//   caller's own bound.
// - NOT_FOUND / FAILED_PRECONDITION on a membership call: the coordinator may
//   have restarted without this worker: the agent re-joins once with its
//   worker id (or, if the coordinator lost its state, with its old rank as
//   the hint) and insists on the same rank and generation; anything else
//   means the communicators are stale and is reported as ABORTED. A worker
//   the coordinator declared lost gets FAILED_PRECONDITION: join again (Join)
//   as a new worker.
//
// Security: every call carries the job token (`authorization: Bearer <job
// token>`, added by a channel interceptor, so calls added later carry it too)
// when one is configured; with a CA the channel is TLS, and with a client
// certificate as well, mutual TLS.
//
// Thread-safety: all public methods are thread-safe. GetSchedule,
// AwaitGeneration and CommitStep belong to the training thread (one caller).
// The heartbeat thread, the watcher thread and at most one prefetch are owned
// by the Agent and stopped by its destructor.
#ifndef HSDP_WORKER_AGENT_AGENT_H_
#define HSDP_WORKER_AGENT_AGENT_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "hsdp/v1/coordinator_service.grpc.pb.h"
#include "worker/agent/clock_offset.h"
#include "worker/agent/report_stream.h"
#include "worker/agent/schedule_stream.h"

namespace hsdp::agent {

struct AgentOptions {
  // host:port of the coordinator.
  std::string coordinator = "localhost:50051";
  std::string job_id;
  std::optional<int> rank_hint;
  std::string hostname;
  // "cpu" or "cuda:N".
  std::string device = "cpu";
  std::string model;
  std::vector<hsdp::v1::UnitInfo> units;
  // The worker's training settings, checked against the job's at Join.
  std::optional<hsdp::v1::TrainingSpec> training;
  // Deadline of one ordinary RPC attempt.
  absl::Duration rpc_timeout = absl::Seconds(10);
  // How long a call keeps retrying transient failures (coordinator down or
  // restarting) before it gives up with UNAVAILABLE naming the coordinator.
  absl::Duration retry_budget = absl::Seconds(60);
  absl::Duration initial_backoff = absl::Milliseconds(100);
  absl::Duration max_backoff = absl::Seconds(2);
  // Deadline of one GetSchedule long-poll attempt (the coordinator holds a call
  // while the step is beyond its read-ahead window).
  absl::Duration schedule_poll_timeout = absl::Seconds(30);
  // Deadline of one AwaitGeneration / CommitStep long-poll attempt.
  absl::Duration long_poll_timeout = absl::Seconds(30);

  // The job token every call carries. Empty: read from the environment
  // (HSDP_JOB_TOKEN_FILE names a file, else HSDP_JOB_TOKEN is the value), so a
  // launcher hands it down without argv; empty there too: calls carry none.
  std::string job_token;
  // TLS: PEM root certificate(s) the coordinator's certificate must chain to.
  // Empty: plaintext.
  std::string tls_ca_pem;
  // Mutual TLS (needs tls_ca_pem): this worker's PEM certificate chain and
  // private key, both or neither.
  std::string tls_client_cert_pem;
  std::string tls_client_key_pem;
  // Take schedules from the coordinator's WatchSchedules push stream
  // (schedule_stream.h) while it serves them; GetSchedule covers the rest and
  // older coordinators.
  bool watch_schedules = true;
  // Send step reports as messages on the coordinator's StreamReports stream
  // (report_stream.h) while it serves it; ReportStep covers the rest (a
  // worker's last report, a broken stream, older coordinators).
  bool stream_reports = true;
  // host:port (or unix:PATH) of this host's relay (hsdp-relay): the schedule
  // and report streams go there, shared with the host's other workers, and
  // every call still goes to the coordinator. Empty: streams go to the
  // coordinator too. The relay is local: plaintext, with the job token.
  std::string relay;
};

// Paths from the worker's command line (empty: not given): --job-token-file,
// --tls-ca, --tls-client-cert, --tls-client-key.
struct AgentSecurityFiles {
  std::string job_token_file;
  std::string tls_ca;
  std::string tls_client_cert;
  std::string tls_client_key;
};

// Reads the files into `options` (job_token, tls_*_pem). NOT_FOUND for an
// unreadable file, INVALID_ARGUMENT for an empty token file, a client
// certificate without its key (or the reverse), or a client certificate
// without a CA.
absl::Status LoadAgentSecurityFiles(const AgentSecurityFiles& files,
                                    AgentOptions* options);

// A channel to `address` as the agent makes them: keepalive, quick reconnects,
// the job token of `options` (or the environment), and TLS when `secure` and
// `options` has a CA. `*setup` gets what is wrong with `options` (TLS files,
// an unreadable token file), OK otherwise; the channel is made either way.
std::shared_ptr<grpc::Channel> MakeCoordinatorChannel(
    const AgentOptions& options, const std::string& address, bool secure,
    absl::Status* setup);

// Converts a gRPC status to an absl::Status with the same code, prefixing
// `what`.
absl::Status FromGrpc(const grpc::Status& status, const std::string& what);

class Agent {
 public:
  explicit Agent(AgentOptions options);
  // Stops the heartbeat and waits for an in-flight prefetch.
  ~Agent();
  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;

  // Joins the job as a new worker (with retries): a new worker id. A member
  // of the first generation learns its rank and generation at once; a worker
  // joining a running job (worker_state JOINING) waits in AwaitGeneration.
  // Call again after FAILED_PRECONDITION "declared lost".
  absl::StatusOr<hsdp::v1::JoinResponse> Join();
  // Starts the heartbeat thread (interval from the JoinResponse). Call after
  // Join.
  void StartHeartbeat();
  // Step the worker is on, carried by heartbeats.
  void SetCurrentStep(int64_t step) { current_step_.store(step); }

  // The sealed schedule of `step`: pushed over the schedule stream when it
  // serves it (watch_schedules), else the prefetched answer when there is one,
  // else a direct call; the last two then start fetching `step + 1` in the
  // background unless `step + 1 > last_step`.
  absl::StatusOr<hsdp::v1::GetScheduleResponse> GetSchedule(int64_t step,
                                                            int64_t last_step);
  absl::Status ReportStep(const hsdp::v1::StepReport& report, bool finished);

  // Rendezvous store RPCs, keys scoped by job and generation on the
  // coordinator.
  absl::Status StoreSet(const std::string& key, const std::string& value);
  absl::StatusOr<std::string> StoreGet(const std::string& key,
                                       absl::Duration timeout);
  absl::Status StoreWait(const std::vector<std::string>& keys,
                         absl::Duration timeout);

  // --- Elastic protocol (worker/agent/ELASTIC.md).

  // The next answer about this worker's generation after `known_generation`
  // (its own, or the one it stands by in; -1: none): ENDED, FORMED, STANDBY
  // or EXIT. A call while the generation ends confirms this worker is alive.
  // FORMED makes the new generation the agent's (rank, rendezvous prefix and
  // generation of every later call). Polls until `timeout`
  // (DEADLINE_EXCEEDED: nothing changed). Returns at once an answer the
  // generation watcher already got.
  absl::StatusOr<hsdp::v1::AwaitGenerationResponse> AwaitGeneration(
      int64_t known_generation, absl::Duration timeout);

  // A collective of this worker's generation failed at `step` (-1: outside a
  // step): ends the generation at once. True when this report ended it.
  absl::StatusOr<bool> ReportFailure(int64_t step, const std::string& detail);
  // This worker met an error at `step` that no new generation would get past
  // (a non-finite loss): the coordinator marks the job FAILED with `reason`.
  // True when this report failed the job (false: it had failed already).
  absl::StatusOr<bool> FailJob(int64_t step, const std::string& reason);

  // Votes to commit `step` of this worker's generation, after its backward
  // and collectives and before its optimizer step. Blocks until every member
  // voted: OK means apply the step (reform_after: then AwaitGeneration
  // instead of the next step); ABORTED means the generation ended first:
  // discard the step's gradients, it is trained again. The vote goes as a
  // message on the report stream and the commit comes on the schedule stream
  // while both serve it; otherwise (or when no commit comes) by the
  // CommitStep call, which answers a repeated vote the same.
  absl::StatusOr<hsdp::v1::CommitStepResponse> CommitStep(int64_t step);

  // Starts a thread that long-polls the coordinator while this worker is a
  // member and calls `on_end` (on that thread) once per generation when it
  // ends — before the next one is formed — so the owner can Abort the
  // communicators a training thread may be blocked in. The thread then
  // confirms this worker at once and keeps the answer for AwaitGeneration.
  // `on_end` gets the generation that ended and ABORTED naming it (or the
  // error that stopped the watch, e.g. FAILED_PRECONDITION "declared lost").
  // Call at most once.
  using GenerationEndFn =
      std::function<void(int64_t generation, const absl::Status& why)>;
  void StartGenerationWatch(GenerationEndFn on_end);

  int rank() const;
  int64_t generation() const;
  int64_t worker_id() const;
  // The agent's generation (set by Join when a member, and by FORMED answers).
  hsdp::v1::Generation generation_info() const;
  hsdp::v1::JoinResponse join_response() const;
  // Non-OK once a heartbeat saw this worker's generation end (ABORTED: re-form;
  // or FAILED_PRECONDITION when the job failed or the worker was evicted). A
  // trainer that does not re-form stops with this error.
  absl::Status membership_status() const;
  // The coordinator's clock relative to this worker's, from heartbeat round
  // trips (empty before the first heartbeat answered). Aligns trace spans.
  std::optional<ClockOffset> clock_offset() const { return clock_.Estimate(); }

 private:
  // Runs `attempt` (one RPC with a fresh context) until it succeeds, fails
  // permanently, or the retry budget is spent. `attempt_timeout` is each
  // attempt's deadline.
  template <typename Fn>
  absl::Status CallWithRetry(const std::string& what,
                             absl::Duration attempt_timeout, Fn attempt);
  // A store RPC that blocks server-side: repeated until it answers or `timeout`
  // is spent.
  template <typename Request, typename Rpc>
  absl::Status BlockingStoreCall(const std::string& what,
                                 absl::Duration timeout, Request& req, Rpc rpc);
  absl::StatusOr<hsdp::v1::GetScheduleResponse> FetchSchedule(int64_t step);
  // `vote` (job and step set) on the streams: the commit, or nullopt when the
  // streams cannot carry it (then CommitStep's call does).
  std::optional<hsdp::v1::CommitStepResponse> CommitOnStreams(
      hsdp::v1::CommitStepRequest vote);
  hsdp::v1::JoinRequest MakeJoinRequest(std::optional<int> rank_hint) const;
  // Re-joins after a coordinator restart forgot this worker; same rank and
  // generation required. `seen_epoch` is join_epoch_ when the failing call
  // started: if another thread re-joined since, this is a no-op (two Joins for
  // one rank would be refused as a duplicate).
  absl::Status Rejoin(int64_t seen_epoch);
  int64_t join_epoch() const;
  void HeartbeatLoop();
  void WatchLoop(GenerationEndFn on_end);
  // One AwaitGeneration RPC attempt series (retries, no re-poll).
  absl::StatusOr<hsdp::v1::AwaitGenerationResponse> AwaitOnce(
      int64_t known_generation, absl::Duration timeout);
  // Makes `g` the agent's generation (join_ fields). Caller holds mu_.
  void AdoptGenerationLocked(const hsdp::v1::Generation& g)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const AgentOptions options_;
  // Not OK when the options cannot make a channel (bad TLS settings, an
  // unreadable token file): every call returns it. Written only by the
  // constructor.
  absl::Status setup_;
  std::unique_ptr<hsdp::v1::CoordinatorService::Stub> stub_;
  // The relay's, when options_.relay is set: WatchSchedules goes there.
  std::unique_ptr<hsdp::v1::CoordinatorService::Stub> relay_stub_;
  std::atomic<int64_t> current_step_{0};

  mutable absl::Mutex mu_;
  hsdp::v1::JoinResponse join_ ABSL_GUARDED_BY(mu_);
  absl::Status membership_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  // RPC attempts running now (CallWithRetry); cancelled by the destructor.
  absl::flat_hash_set<grpc::ClientContext*> in_flight_ ABSL_GUARDED_BY(mu_);
  // Bumped by every successful (re-)join.
  int64_t join_epoch_ ABSL_GUARDED_BY(mu_) = 0;
  // Serialises re-joins (held across the Join RPC, never together with mu_
  // while waiting).
  absl::Mutex rejoin_mu_;

  // The watcher's latest answer after the agent's generation ended (an
  // outcome other than ENDED), for AwaitGeneration.
  std::optional<hsdp::v1::AwaitGenerationResponse> watched_
      ABSL_GUARDED_BY(mu_);

  // Prefetch of the next schedule; touched only by the thread calling
  // GetSchedule (documented single-consumer use), so it needs no lock. A
  // prefetch of another generation is discarded.
  int64_t prefetch_step_ = -1;
  int64_t prefetch_generation_ = -1;
  std::future<absl::StatusOr<hsdp::v1::GetScheduleResponse>> prefetch_;
  // Opened by the first GetSchedule (watch_schedules); same single consumer.
  std::unique_ptr<ScheduleStream> schedule_stream_;
  // Set when stream_reports; used by the thread calling ReportStep.
  std::unique_ptr<ReportStream> report_stream_;

  ClockOffsetEstimator clock_;

  std::thread heartbeat_;
  std::thread watcher_;
};

}  // namespace hsdp::agent

#endif  // HSDP_WORKER_AGENT_AGENT_H_
