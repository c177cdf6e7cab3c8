// Collects the timelines of traced steps (hsdpctl trace) and renders them as
// one Chrome trace-event JSON document.
//
// Workers record spans in their own wall clock and send them with the traced
// step's report, together with their estimate of the coordinator's clock
// relative to theirs (heartbeat round trips). Spans are stored shifted onto
// the coordinator's clock, so two ranks' spans are aligned within the sum of
// their offsets' error bounds.
#ifndef HSDP_COORDINATOR_CORE_TRACE_COLLECTOR_H_
#define HSDP_COORDINATOR_CORE_TRACE_COLLECTOR_H_

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "hsdp/v1/common.pb.h"

namespace hsdp::coordinator {

// Most steps one trace may cover.
inline constexpr int64_t kMaxTraceSteps = 32;
// Most traced steps kept; older ones are dropped first.
inline constexpr size_t kMaxTracedStepsKept = 128;
// Most spans kept per rank and step (a worker's recorder has its own cap).
inline constexpr int kMaxSpansPerRankStep = 1 << 16;

struct RenderedTrace {
  std::string chrome_json;
  // Every expected rank of every step sent its spans.
  bool complete = false;
  int rank_steps_reported = 0;
  int rank_steps_expected = 0;
  // Largest error bound of the clock offsets used.
  int64_t max_clock_error_nanos = 0;
};

// Thread-safe.
class TraceCollector {
 public:
  TraceCollector() = default;
  TraceCollector(const TraceCollector&) = delete;
  TraceCollector& operator=(const TraceCollector&) = delete;

  // Keeps `report`'s spans (a re-sent report of the same rank and step
  // replaces the earlier one).
  void Record(const hsdp::v1::StepReport& report);

  // Steps first..last as Chrome trace-event JSON: one process per rank ("rank
  // r"), threads "compute", "shard comm" and "replicate comm", complete ("X")
  // events in microseconds from the earliest span. `expected_ranks(step)` is
  // the step's world size (0: unknown, e.g. not sealed yet). INVALID_ARGUMENT
  // for an empty or too long range.
  absl::StatusOr<RenderedTrace> Render(
      int64_t first_step, int64_t last_step,
      const std::function<int(int64_t)>& expected_ranks) const;

  // The newest traced steps: the last run of consecutive steps with spans,
  // at most `max_steps` long, ending at the newest; nullopt when none.
  std::optional<std::pair<int64_t, int64_t>> LatestRange(
      int64_t max_steps) const;

 private:
  struct RankSteps {
    std::vector<hsdp::v1::TraceSpan> spans;  // on the coordinator's clock
    int64_t clock_error_nanos = 0;
  };
  mutable absl::Mutex mu_;
  // step -> rank -> spans.
  std::map<int64_t, std::map<int, RankSteps>> steps_ ABSL_GUARDED_BY(mu_);
};

// Checks a trace range: first >= 0, first <= last, at most kMaxTraceSteps.
absl::Status ValidateTraceRange(int64_t first_step, int64_t last_step);

}  // namespace hsdp::coordinator

#endif  // HSDP_COORDINATOR_CORE_TRACE_COLLECTOR_H_
