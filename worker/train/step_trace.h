// One traced step on one rank (StepSchedule.trace): installs a recorder in
// the engine for the step, adds the runner's own spans, and hands the spans
// to the step's report with this worker's clock offset to the coordinator.
#ifndef HSDP_WORKER_TRAIN_STEP_TRACE_H_
#define HSDP_WORKER_TRAIN_STEP_TRACE_H_

#include <cstdint>
#include <optional>

#include "hsdp/fully_shard.h"
#include "hsdp/v1/common.pb.h"
#include "worker/agent/clock_offset.h"
#include "worker/fsdp/trace_recorder.h"

namespace hsdp::train {

// Thread-compatible: the training thread only. Does nothing when disabled.
class StepTrace {
 public:
  StepTrace(fsdp::Engine& engine, bool enabled);
  // Takes the recorder out of the engine.
  ~StepTrace();
  StepTrace(const StepTrace&) = delete;
  StepTrace& operator=(const StepTrace&) = delete;

  bool enabled() const { return enabled_; }
  static int64_t Now() { return fsdp::TraceRecorder::NowNanos(); }
  // A span of the whole step on the compute track ("schedule fetch",
  // "optimizer", "checkpoint", "step").
  void Add(const char* name, int64_t begin_nanos, int64_t end_nanos);
  // Moves the spans into `report`, with the clock offset (error -1 when it is
  // not known yet: no heartbeat has answered).
  void AttachTo(hsdp::v1::StepReport& report,
                const std::optional<agent::ClockOffset>& offset);

 private:
  fsdp::Engine& engine_;
  const bool enabled_;
  fsdp::TraceRecorder recorder_;
};

}  // namespace hsdp::train

#endif  // HSDP_WORKER_TRAIN_STEP_TRACE_H_
