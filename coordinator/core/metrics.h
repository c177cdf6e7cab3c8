// What the coordinator observes of its job: Prometheus metrics (served as
// /metrics on the metrics port, apart from the gRPC port so a scrape never
// competes with workers) and the recent steps the dashboard charts.
#ifndef HSDP_COORDINATOR_CORE_METRICS_H_
#define HSDP_COORDINATOR_CORE_METRICS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/core/step_history.h"
#include "hsdp/v1/common.pb.h"

namespace prometheus {
class Counter;
class Registry;
class Counter;
class Gauge;
class Histogram;
class Summary;
template <typename T>
class Family;
}  // namespace prometheus

namespace hsdp::coordinator {

// Thread-safe: every method may be called from any gRPC or HTTP handler
// thread. prometheus-cpp metrics are internally atomic; the per-rank gauge
// cache is guarded by mu_; the history locks itself.
class Metrics {
 public:
  Metrics();
  ~Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  void SetWorkerCounts(int alive, int lost, int finished);
  // Workers out of the current generation.
  void SetElasticWorkerCounts(int standby, int joining, int evicted);
  void SetGeneration(int64_t generation);
  // Replica groups of the current generation.
  void SetReplicas(int replicas);
  void SetCommittedStep(int64_t step);
  // A commit vote arrived: on a report stream, or by a CommitStep call (each
  // call counts, a long poll repeated after its deadline too).
  void RecordVote(bool streamed);
  // `count` workers' messages came relayed by a host relay inside another.
  void RecordRelayed(int count);
  // A generation ended; `cause` is the FailureCause name (UNSPECIFIED: it
  // grew).
  void RecordGenerationEnd(const std::string& cause);
  // What one failure cost: detection (failure -> generation ended),
  // re-forming (ended -> next formed), recovery (formed -> its first committed
  // step: rendezvous, heal, the step); their sum is the time lost.
  void ObserveFailureCost(double detect_seconds, double reform_seconds,
                          double recover_seconds);
  void SetSealedStep(int64_t step);
  void SetPolicyVersion(int64_t version);
  void ObserveScheduleLatency(double seconds);
  void RecordReport(const hsdp::v1::StepReport& report)
      ABSL_LOCKS_EXCLUDED(mu_);

  // The job's metrics in the text exposition format (without the scrape
  // counters Scrape() adds).
  std::string Serialize() const;

  // One scrape's body: what prometheus-cpp's Exposer serves on /metrics — its
  // exposer_* families (bytes sent, scrapes, request latency in microseconds),
  // then the job's — and it counts this scrape in those families, as the
  // Exposer does.
  std::string Scrape();
  // Content-Type of Scrape()'s body.
  static constexpr char kScrapeContentType[] = "text/plain; charset=utf-8";

  // The registry Serialize() reads (tests compare against prometheus-cpp's
  // own exposer serving it).
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

  // Every report's step, across ranks, for the dashboard's charts.
  const StepHistory& history() const { return history_; }

 private:
  struct RankGauges {
    prometheus::Gauge* step_seconds = nullptr;
    prometheus::Gauge* loss = nullptr;
    prometheus::Gauge* peak_memory = nullptr;
    prometheus::Gauge* last_step = nullptr;
  };

  std::shared_ptr<prometheus::Registry> registry_;
  // The scrape counters, in their own registry as in prometheus-cpp's Exposer.
  std::shared_ptr<prometheus::Registry> scrape_registry_;
  prometheus::Counter* scrape_bytes_;
  prometheus::Counter* scrapes_;
  prometheus::Summary* scrape_latency_us_;

  prometheus::Gauge* workers_alive_;
  prometheus::Gauge* workers_lost_;
  prometheus::Gauge* workers_finished_;
  prometheus::Gauge* workers_standby_;
  prometheus::Gauge* workers_joining_;
  prometheus::Gauge* workers_evicted_;
  prometheus::Gauge* generation_;
  prometheus::Gauge* replicas_;
  prometheus::Gauge* committed_step_;
  prometheus::Counter* votes_streamed_;
  prometheus::Counter* votes_by_call_;
  prometheus::Counter* relayed_;
  prometheus::Family<prometheus::Counter>* generation_ends_family_;
  prometheus::Histogram* failure_detect_;
  prometheus::Histogram* failure_reform_;
  prometheus::Histogram* failure_recover_;
  prometheus::Histogram* failure_lost_;
  prometheus::Gauge* sealed_step_;
  prometheus::Gauge* policy_version_;
  prometheus::Histogram* schedule_latency_;
  prometheus::Family<prometheus::Gauge>* step_seconds_family_;
  prometheus::Family<prometheus::Gauge>* loss_family_;
  prometheus::Family<prometheus::Gauge>* peak_memory_family_;
  prometheus::Family<prometheus::Gauge>* last_step_family_;

  StepHistory history_;

  mutable absl::Mutex mu_;
  std::vector<RankGauges> ranks_ ABSL_GUARDED_BY(mu_);
};

}  // namespace hsdp::coordinator

#endif  // HSDP_COORDINATOR_CORE_METRICS_H_
