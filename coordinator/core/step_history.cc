#include "coordinator/core/step_history.h"

#include <algorithm>

namespace hsdp::coordinator {

StepHistory::StepHistory(size_t capacity)
    : capacity_(std::max<size_t>(capacity, 1)) {}

void StepHistory::Record(const hsdp::v1::StepReport& report) {
  if (report.rank() < 0) return;
  const size_t rank = static_cast<size_t>(report.rank());
  absl::MutexLock lock(&mu_);
  auto it = std::lower_bound(
      entries_.begin(), entries_.end(), report.step(),
      [](const Entry& e, int64_t step) { return e.point.step < step; });
  if (it == entries_.end() || it->point.step != report.step()) {
    // A step older than everything kept, once the window is full, would be
    // dropped again at once.
    if (it == entries_.begin() && entries_.size() >= capacity_) return;
    Entry entry;
    entry.point.step = report.step();
    it = entries_.insert(it, std::move(entry));
  }
  Entry& e = *it;
  if (e.seen.size() <= rank) e.seen.resize(rank + 1, false);
  if (e.seen[rank]) return;
  e.seen[rank] = true;
  StepSample& p = e.point;
  ++p.ranks;
  e.loss_sum += report.loss();
  p.loss = e.loss_sum / p.ranks;
  p.step_seconds = std::max(p.step_seconds, report.step_seconds());
  p.tokens_per_second += report.tokens_per_second();
  p.peak_memory_bytes =
      std::max(p.peak_memory_bytes, report.peak_memory_bytes());
  while (entries_.size() > capacity_) entries_.pop_front();
}

std::vector<StepSample> StepHistory::Since(int64_t after_step) const {
  absl::MutexLock lock(&mu_);
  auto it = std::upper_bound(
      entries_.begin(), entries_.end(), after_step,
      [](int64_t step, const Entry& e) { return step < e.point.step; });
  std::vector<StepSample> points;
  points.reserve(static_cast<size_t>(entries_.end() - it));
  for (; it != entries_.end(); ++it) points.push_back(it->point);
  return points;
}

}  // namespace hsdp::coordinator
