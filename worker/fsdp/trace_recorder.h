// Timeline recording for traced steps (hsdpctl trace).
//
// The engine records, per unit, forward and backward compute, the time the
// training thread waits for each collective, and each collective from issue
// to completion; the runner adds the step-level spans (schedule fetch,
// optimizer, checkpoint). With no recorder installed (Engine::SetTraceRecorder
// with null, the default) the engine's only cost is one pointer test per hook.
#ifndef HSDP_WORKER_FSDP_TRACE_RECORDER_H_
#define HSDP_WORKER_FSDP_TRACE_RECORDER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace hsdp::fsdp {

// Collectives of one communicator run one at a time, so each gets its own
// track and its spans never overlap; the two communicators do overlap.
enum class SpanTrack {
  kCompute,        // the training thread (and autograd's, which it waits on)
  kShardComm,      // all-gathers and reduce-scatters in flight
  kReplicateComm,  // HSDP all-reduces in flight
};

struct RecordedSpan {
  std::string name;
  std::string unit;  // empty for spans of the whole step
  SpanTrack track = SpanTrack::kCompute;
  int microbatch = -1;   // -1 for spans of the whole step
  int64_t begin_ns = 0;  // wall clock, ns since the Unix epoch
  int64_t end_ns = 0;
};

// Collects spans. Thread-safe: autograd hooks may run on autograd's thread
// while the training thread waits in backward.
class TraceRecorder {
 public:
  // Bounds a step's spans (a runaway trace must not exhaust memory); spans
  // past it are counted in dropped().
  static constexpr size_t kMaxSpans = 1 << 16;

  TraceRecorder() = default;
  TraceRecorder(const TraceRecorder&) = delete;
  TraceRecorder& operator=(const TraceRecorder&) = delete;

  // The clock spans are measured in.
  static int64_t NowNanos();

  void Add(RecordedSpan span);
  // The spans recorded since the last Take, in the order they were added.
  std::vector<RecordedSpan> Take();
  int64_t dropped() const;

 private:
  mutable absl::Mutex mu_;
  std::vector<RecordedSpan> spans_ ABSL_GUARDED_BY(mu_);
  int64_t dropped_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace hsdp::fsdp

#endif  // HSDP_WORKER_FSDP_TRACE_RECORDER_H_
