#include "coordinator/core/metrics.h"

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/metric_family.h>
#include <prometheus/registry.h>
#include <prometheus/summary.h>
#include <prometheus/text_serializer.h>

#include <chrono>
#include <string>
#include <vector>

namespace hsdp::coordinator {
namespace {

// Schedule latency buckets in seconds: 50 us .. 1 s, the range a loopback/DC
// read spans; long polls that waited for the read-ahead window land in the top
// buckets.
const prometheus::Histogram::BucketBoundaries& LatencyBuckets() {
  static const auto* buckets = new prometheus::Histogram::BucketBoundaries{
      50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3,
      5e-3,  10e-3,  25e-3,  100e-3, 1.0};
  return *buckets;
}

prometheus::Gauge* WorkerGauge(prometheus::Family<prometheus::Gauge>& family,
                               const std::string& state) {
  return &family.Add({{"state", state}});
}

// Failure cost buckets in seconds: a collective noticing a dead peer (ms)
// up to heartbeat timeouts and long heals (minutes).
const prometheus::Histogram::BucketBoundaries& FailureBuckets() {
  static const auto* buckets = new prometheus::Histogram::BucketBoundaries{
      0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300};
  return *buckets;
}

// The quantiles (and allowed errors) prometheus-cpp's Exposer reports for its
// request latency.
const prometheus::Summary::Quantiles& ScrapeLatencyQuantiles() {
  static const auto* quantiles = new prometheus::Summary::Quantiles{
      {0.5, 0.05}, {0.9, 0.01}, {0.99, 0.001}};
  return *quantiles;
}

}  // namespace

Metrics::Metrics()
    : registry_(std::make_shared<prometheus::Registry>()),
      scrape_registry_(std::make_shared<prometheus::Registry>()) {
  // Names and help texts as prometheus-cpp's Exposer registers them, so a
  // dashboard built on the Exposer's /metrics keeps working.
  scrape_bytes_ = &prometheus::BuildCounter()
                       .Name("exposer_transferred_bytes_total")
                       .Help("Transferred bytes to metrics services")
                       .Register(*scrape_registry_)
                       .Add({});
  scrapes_ = &prometheus::BuildCounter()
                  .Name("exposer_scrapes_total")
                  .Help("Number of times metrics were scraped")
                  .Register(*scrape_registry_)
                  .Add({});
  scrape_latency_us_ =
      &prometheus::BuildSummary()
           .Name("exposer_request_latencies")
           .Help("Latencies of serving scrape requests, in microseconds")
           .Register(*scrape_registry_)
           .Add({}, ScrapeLatencyQuantiles());
  auto& workers = prometheus::BuildGauge()
                      .Name("hsdp_workers")
                      .Help("Workers of the job by state")
                      .Register(*registry_);
  workers_alive_ = WorkerGauge(workers, "alive");
  workers_lost_ = WorkerGauge(workers, "lost");
  workers_finished_ = WorkerGauge(workers, "finished");
  workers_standby_ = WorkerGauge(workers, "standby");
  workers_joining_ = WorkerGauge(workers, "joining");
  workers_evicted_ = WorkerGauge(workers, "evicted");
  replicas_ = &prometheus::BuildGauge()
                   .Name("hsdp_replicas")
                   .Help("Replica groups of the current generation")
                   .Register(*registry_)
                   .Add({});
  committed_step_ = &prometheus::BuildGauge()
                         .Name("hsdp_committed_step")
                         .Help("Last step every member committed (-1: none)")
                         .Register(*registry_)
                         .Add({});
  committed_step_->Set(-1);
  auto& votes = prometheus::BuildCounter()
                    .Name("hsdp_commit_votes_total")
                    .Help(
                        "Commit votes received, by how they came: on a "
                        "report stream, or by a CommitStep call")
                    .Register(*registry_);
  votes_streamed_ = &votes.Add({{"via", "stream"}});
  votes_by_call_ = &votes.Add({{"via", "call"}});
  relayed_ = &prometheus::BuildCounter()
                  .Name("hsdp_relayed_messages_total")
                  .Help(
                      "Workers' report-stream messages that a host relay "
                      "carried inside another worker's message")
                  .Register(*registry_)
                  .Add({});
  generation_ends_family_ =
      &prometheus::BuildCounter()
           .Name("hsdp_generation_ends_total")
           .Help("Generations ended, by cause (UNSPECIFIED: the job grew)")
           .Register(*registry_);
  auto& failure = prometheus::BuildHistogram()
                      .Name("hsdp_failure_seconds")
                      .Help(
                          "What a failure cost, by phase: detect (failure "
                          "-> generation ended), reform (-> next formed), "
                          "recover (-> its first committed step), lost "
                          "(the sum)")
                      .Register(*registry_);
  failure_detect_ = &failure.Add({{"phase", "detect"}}, FailureBuckets());
  failure_reform_ = &failure.Add({{"phase", "reform"}}, FailureBuckets());
  failure_recover_ = &failure.Add({{"phase", "recover"}}, FailureBuckets());
  failure_lost_ = &failure.Add({{"phase", "lost"}}, FailureBuckets());
  generation_ = &prometheus::BuildGauge()
                     .Name("hsdp_generation")
                     .Help("Membership generation")
                     .Register(*registry_)
                     .Add({});
  sealed_step_ = &prometheus::BuildGauge()
                      .Name("hsdp_sealed_step")
                      .Help("Highest sealed step (-1: none)")
                      .Register(*registry_)
                      .Add({});
  sealed_step_->Set(-1);
  policy_version_ = &prometheus::BuildGauge()
                         .Name("hsdp_policy_version")
                         .Help("Version of the current policy")
                         .Register(*registry_)
                         .Add({});
  schedule_latency_ =
      &prometheus::BuildHistogram()
           .Name("hsdp_get_schedule_seconds")
           .Help("Server-side latency of CoordinatorService.GetSchedule")
           .Register(*registry_)
           .Add({}, LatencyBuckets());
  step_seconds_family_ = &prometheus::BuildGauge()
                              .Name("hsdp_rank_step_seconds")
                              .Help("Step time of the rank's latest report")
                              .Register(*registry_);
  loss_family_ = &prometheus::BuildGauge()
                      .Name("hsdp_rank_loss")
                      .Help("Loss of the rank's latest report")
                      .Register(*registry_);
  peak_memory_family_ = &prometheus::BuildGauge()
                             .Name("hsdp_rank_peak_memory_bytes")
                             .Help("Peak memory of the rank's latest report")
                             .Register(*registry_);
  last_step_family_ = &prometheus::BuildGauge()
                           .Name("hsdp_rank_reported_step")
                           .Help("Step of the rank's latest report")
                           .Register(*registry_);
}

Metrics::~Metrics() = default;

void Metrics::SetWorkerCounts(int alive, int lost, int finished) {
  workers_alive_->Set(alive);
  workers_lost_->Set(lost);
  workers_finished_->Set(finished);
}

void Metrics::SetElasticWorkerCounts(int standby, int joining, int evicted) {
  workers_standby_->Set(standby);
  workers_joining_->Set(joining);
  workers_evicted_->Set(evicted);
}

void Metrics::SetReplicas(int replicas) { replicas_->Set(replicas); }

void Metrics::SetCommittedStep(int64_t step) {
  committed_step_->Set(static_cast<double>(step));
}

void Metrics::RecordGenerationEnd(const std::string& cause) {
  // Family::Add returns the existing counter for known labels; the family
  // itself is thread-safe.
  generation_ends_family_->Add({{"cause", cause}}).Increment();
}

void Metrics::RecordVote(bool streamed) {
  (streamed ? votes_streamed_ : votes_by_call_)->Increment();
}

void Metrics::RecordRelayed(int count) {
  relayed_->Increment(static_cast<double>(count));
}

void Metrics::ObserveFailureCost(double detect_seconds, double reform_seconds,
                                 double recover_seconds) {
  failure_detect_->Observe(detect_seconds);
  failure_reform_->Observe(reform_seconds);
  failure_recover_->Observe(recover_seconds);
  failure_lost_->Observe(detect_seconds + reform_seconds + recover_seconds);
}

void Metrics::SetGeneration(int64_t generation) {
  generation_->Set(static_cast<double>(generation));
}

void Metrics::SetSealedStep(int64_t step) {
  sealed_step_->Set(static_cast<double>(step));
}

void Metrics::SetPolicyVersion(int64_t version) {
  policy_version_->Set(static_cast<double>(version));
}

void Metrics::ObserveScheduleLatency(double seconds) {
  schedule_latency_->Observe(seconds);
}

void Metrics::RecordReport(const hsdp::v1::StepReport& report) {
  if (report.rank() < 0) return;
  // Copy the gauge pointers out under the lock: ranks_ may be resized by
  // another report, but the gauges themselves live as long as the registry and
  // are atomic.
  RankGauges gauges;
  {
    absl::MutexLock lock(&mu_);
    const size_t rank = static_cast<size_t>(report.rank());
    if (ranks_.size() <= rank) ranks_.resize(rank + 1);
    RankGauges& slot = ranks_[rank];
    if (slot.loss == nullptr) {
      const prometheus::Labels labels{{"rank", std::to_string(rank)}};
      slot.step_seconds = &step_seconds_family_->Add(labels);
      slot.loss = &loss_family_->Add(labels);
      slot.peak_memory = &peak_memory_family_->Add(labels);
      slot.last_step = &last_step_family_->Add(labels);
    }
    gauges = slot;
  }
  gauges.step_seconds->Set(report.step_seconds());
  gauges.loss->Set(report.loss());
  gauges.peak_memory->Set(static_cast<double>(report.peak_memory_bytes()));
  gauges.last_step->Set(static_cast<double>(report.step()));
  history_.Record(report);
}

std::string Metrics::Serialize() const {
  prometheus::TextSerializer serializer;
  return serializer.Serialize(registry_->Collect());
}

std::string Metrics::Scrape() {
  const auto start = std::chrono::steady_clock::now();
  std::vector<prometheus::MetricFamily> families = scrape_registry_->Collect();
  std::vector<prometheus::MetricFamily> job = registry_->Collect();
  families.insert(families.end(), std::make_move_iterator(job.begin()),
                  std::make_move_iterator(job.end()));
  std::string body = prometheus::TextSerializer().Serialize(families);
  // Counted after the body is built, as the Exposer does: a scrape reports the
  // scrapes before it.
  scrape_latency_us_->Observe(
      static_cast<double>(std::chrono::duration_cast<std::chrono::microseconds>(
                              std::chrono::steady_clock::now() - start)
                              .count()));
  scrape_bytes_->Increment(static_cast<double>(body.size()));
  scrapes_->Increment();
  return body;
}

}  // namespace hsdp::coordinator
