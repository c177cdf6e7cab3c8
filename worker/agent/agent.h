// The worker's gRPC client of the coordinator (CoordinatorService).
//
// Join, a heartbeat on its own thread, schedule fetches with the next step
// prefetched in the background (so no RPC sits on the training critical path),
// step reports, and the rendezvous key-value RPCs used by CoordinatorStore.
//
// Coordinator restarts: every call retries UNAVAILABLE (and the other transient
// codes listed in agent.cc) with exponential backoff until `retry_budget` has
// passed since the first failure, so a coordinator that comes back on its state
// directory within the budget loses no step. If the restarted coordinator no
// longer knows this worker (NOT_FOUND / FAILED_PRECONDITION on a membership
// call) the agent re-joins with its old rank as the hint and insists on the
// same generation: anything else means the communicators are stale, which is
// reported, not hidden.
//
// Security: every call carries the job token (`authorization: Bearer <job
// token>`, added by a channel interceptor, so calls added later carry it too)
// when one is configured; with a CA the channel is TLS, and with a client
// certificate as well, mutual TLS.
//
// Thread-safety: all public methods are thread-safe. The heartbeat thread and
// at most one prefetch are owned by the Agent and stopped by its destructor.
#ifndef HSDP_WORKER_AGENT_AGENT_H_
#define HSDP_WORKER_AGENT_AGENT_H_

#include <atomic>
#include <cstdint>
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

  // Joins the job (with retries). On success the agent knows its rank and
  // generation.
  absl::StatusOr<hsdp::v1::JoinResponse> Join();
  // Starts the heartbeat thread (interval from the JoinResponse). Call after
  // Join.
  void StartHeartbeat();
  // Step the worker is on, carried by heartbeats.
  void SetCurrentStep(int64_t step) { current_step_.store(step); }

  // The sealed schedule of `step`: the prefetched answer when there is one,
  // else a direct call. Then starts fetching `step + 1` in the background
  // unless `step + 1 > last_step`.
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

  int rank() const;
  int64_t generation() const;
  hsdp::v1::JoinResponse join_response() const;
  // Non-OK once a heartbeat saw a different generation (a worker was lost): the
  // job's collectives can no longer complete and the trainer should stop with
  // this error.
  absl::Status membership_status() const;

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
  hsdp::v1::JoinRequest MakeJoinRequest(std::optional<int> rank_hint) const;
  // Re-joins after a coordinator restart forgot this worker; same rank and
  // generation required. `seen_epoch` is join_epoch_ when the failing call
  // started: if another thread re-joined since, this is a no-op (two Joins for
  // one rank would be refused as a duplicate).
  absl::Status Rejoin(int64_t seen_epoch);
  int64_t join_epoch() const;
  void HeartbeatLoop();

  const AgentOptions options_;
  // Not OK when the options cannot make a channel (bad TLS settings, an
  // unreadable token file): every call returns it. Written only by the
  // constructor.
  absl::Status setup_;
  std::unique_ptr<hsdp::v1::CoordinatorService::Stub> stub_;
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

  // Prefetch of the next schedule; touched only by the thread calling
  // GetSchedule (documented single-consumer use), so it needs no lock.
  int64_t prefetch_step_ = -1;
  std::future<absl::StatusOr<hsdp::v1::GetScheduleResponse>> prefetch_;

  std::thread heartbeat_;
};

}  // namespace hsdp::agent

#endif  // HSDP_WORKER_AGENT_AGENT_H_
