#include "worker/train/step_trace.h"

namespace hsdp::train {
namespace {

hsdp::v1::TraceTrack ToProto(fsdp::SpanTrack track) {
  switch (track) {
    case fsdp::SpanTrack::kShardComm:
      return hsdp::v1::TRACE_TRACK_SHARD_COMM;
    case fsdp::SpanTrack::kReplicateComm:
      return hsdp::v1::TRACE_TRACK_REPLICATE_COMM;
    case fsdp::SpanTrack::kCompute:
      break;
  }
  return hsdp::v1::TRACE_TRACK_COMPUTE;
}

}  // namespace

StepTrace::StepTrace(fsdp::Engine& engine, bool enabled)
    : engine_(engine), enabled_(enabled) {
  if (enabled_) engine_.SetTraceRecorder(&recorder_);
}

StepTrace::~StepTrace() {
  if (enabled_) engine_.SetTraceRecorder(nullptr);
}

void StepTrace::Add(const char* name, int64_t begin_nanos, int64_t end_nanos) {
  if (!enabled_) return;
  recorder_.Add(fsdp::RecordedSpan{name, "", fsdp::SpanTrack::kCompute, -1,
                                   begin_nanos, end_nanos});
}

void StepTrace::AttachTo(hsdp::v1::StepReport& report,
                         const std::optional<agent::ClockOffset>& offset) {
  if (!enabled_) return;
  for (fsdp::RecordedSpan& span : recorder_.Take()) {
    hsdp::v1::TraceSpan* out = report.add_trace();
    out->set_name(std::move(span.name));
    out->set_unit(std::move(span.unit));
    out->set_track(ToProto(span.track));
    out->set_microbatch(span.microbatch);
    out->set_begin_unix_nanos(span.begin_ns);
    out->set_end_unix_nanos(span.end_ns);
  }
  report.set_clock_offset_nanos(offset ? offset->offset_nanos : 0);
  report.set_clock_error_nanos(offset ? offset->error_nanos : -1);
}

}  // namespace hsdp::train
