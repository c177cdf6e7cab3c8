// The job's recent steps as the workers reported them, one point per step
// across ranks, kept in a bounded window for the dashboard's charts.
#ifndef HSDP_COORDINATOR_CORE_STEP_HISTORY_H_
#define HSDP_COORDINATOR_CORE_STEP_HISTORY_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "hsdp/v1/common.pb.h"

namespace hsdp::coordinator {

// One step over the ranks that reported it so far.
struct StepSample {
  int64_t step = 0;
  // Mean of the ranks' losses (each rank reports the loss of its own batch).
  double loss = 0;
  // The slowest rank's step time: the step took that long for the job.
  double step_seconds = 0;
  // Sum over ranks.
  double tokens_per_second = 0;
  // Largest over ranks.
  int64_t peak_memory_bytes = 0;
  int ranks = 0;
};

// Thread-safe. Memory is bounded by `capacity` points, each with a bit per
// rank: the oldest steps are dropped first.
class StepHistory {
 public:
  static constexpr size_t kDefaultCapacity = 2048;

  explicit StepHistory(size_t capacity = kDefaultCapacity);
  StepHistory(const StepHistory&) = delete;
  StepHistory& operator=(const StepHistory&) = delete;

  // Adds a rank's report to its step. A rank's second report of the same step
  // (a step trained again after a membership change) is ignored: the first
  // counts. Reports of steps older than the window, or from a negative rank,
  // are ignored.
  void Record(const hsdp::v1::StepReport& report) ABSL_LOCKS_EXCLUDED(mu_);

  // The points with step > `after_step`, in step order.
  std::vector<StepSample> Since(int64_t after_step) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // The most steps kept.
  size_t capacity() const { return capacity_; }

 private:
  struct Entry {
    StepSample point;
    double loss_sum = 0;
    std::vector<bool> seen;  // by rank
  };

  const size_t capacity_;
  mutable absl::Mutex mu_;
  std::deque<Entry> entries_ ABSL_GUARDED_BY(mu_);  // ascending steps
};

}  // namespace hsdp::coordinator

#endif  // HSDP_COORDINATOR_CORE_STEP_HISTORY_H_
