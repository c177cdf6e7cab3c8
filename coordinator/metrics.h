// Prometheus metrics of the coordinator, served by prometheus-cpp on their own
// port so a scrape never competes with the gRPC port.
#ifndef HSDP_COORDINATOR_METRICS_H_
#define HSDP_COORDINATOR_METRICS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "hsdp/v1/common.pb.h"

namespace prometheus {
class Exposer;
class Registry;
class Counter;
class Gauge;
class Histogram;
template <typename T>
class Family;
}  // namespace prometheus

namespace hsdp::coordinator {

// Thread-safe: every method may be called from any gRPC handler thread.
// prometheus-cpp metrics are internally atomic; the per-rank gauge cache is
// guarded by mu_.
class Metrics {
 public:
  // listen "" keeps the registry (for tests and Serialize()) but serves
  // nothing.
  static absl::StatusOr<std::unique_ptr<Metrics>> Create(
      const std::string& listen);
  ~Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  // Port the exposer bound (useful with port 0), or 0 when not serving.
  int port() const { return port_; }

  void SetWorkerCounts(int alive, int lost, int finished);
  // Workers out of the current generation.
  void SetElasticWorkerCounts(int standby, int joining, int evicted);
  void SetGeneration(int64_t generation);
  // Replica groups of the current generation.
  void SetReplicas(int replicas);
  void SetCommittedStep(int64_t step);
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

  // Text exposition format, as a scrape would return it.
  std::string Serialize() const;

 private:
  struct RankGauges {
    prometheus::Gauge* step_seconds = nullptr;
    prometheus::Gauge* loss = nullptr;
    prometheus::Gauge* peak_memory = nullptr;
    prometheus::Gauge* last_step = nullptr;
  };

  Metrics();

  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  int port_ = 0;

  prometheus::Gauge* workers_alive_;
  prometheus::Gauge* workers_lost_;
  prometheus::Gauge* workers_finished_;
  prometheus::Gauge* workers_standby_;
  prometheus::Gauge* workers_joining_;
  prometheus::Gauge* workers_evicted_;
  prometheus::Gauge* generation_;
  prometheus::Gauge* replicas_;
  prometheus::Gauge* committed_step_;
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

  mutable absl::Mutex mu_;
  std::vector<RankGauges> ranks_ ABSL_GUARDED_BY(mu_);
};

}  // namespace hsdp::coordinator

#endif  // HSDP_COORDINATOR_METRICS_H_
