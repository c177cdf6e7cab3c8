#include "worker/fsdp/trace_recorder.h"

#include <utility>

#include "absl/time/clock.h"

namespace hsdp::fsdp {

int64_t TraceRecorder::NowNanos() { return absl::GetCurrentTimeNanos(); }

void TraceRecorder::Add(RecordedSpan span) {
  absl::MutexLock lock(&mu_);
  if (spans_.size() >= kMaxSpans) {
    ++dropped_;
    return;
  }
  spans_.push_back(std::move(span));
}

std::vector<RecordedSpan> TraceRecorder::Take() {
  absl::MutexLock lock(&mu_);
  std::vector<RecordedSpan> out;
  out.swap(spans_);
  return out;
}

int64_t TraceRecorder::dropped() const {
  absl::MutexLock lock(&mu_);
  return dropped_;
}

}  // namespace hsdp::fsdp
