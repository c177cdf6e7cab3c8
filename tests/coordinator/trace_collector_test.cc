#include "coordinator/core/trace_collector.h"

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>
#include <gtest/gtest.h>

#include <map>
#include <string>

namespace hsdp::coordinator {
namespace {

using google::protobuf::Struct;
using google::protobuf::Value;

hsdp::v1::StepReport Report(int rank, int64_t step, int64_t offset,
                            int64_t error) {
  hsdp::v1::StepReport report;
  report.set_rank(rank);
  report.set_step(step);
  report.set_clock_offset_nanos(offset);
  report.set_clock_error_nanos(error);
  return report;
}

void AddSpan(hsdp::v1::StepReport& report, const std::string& name,
             const std::string& unit, hsdp::v1::TraceTrack track, int64_t begin,
             int64_t end) {
  hsdp::v1::TraceSpan* span = report.add_trace();
  span->set_name(name);
  span->set_unit(unit);
  span->set_track(track);
  span->set_microbatch(0);
  span->set_begin_unix_nanos(begin);
  span->set_end_unix_nanos(end);
}

Struct Parse(const std::string& json) {
  Struct doc;
  const auto status = google::protobuf::util::JsonStringToMessage(json, &doc);
  EXPECT_TRUE(status.ok()) << status.ToString() << "\n" << json;
  return doc;
}

const Value& Field(const Value& v, const std::string& name) {
  return v.struct_value().fields().at(name);
}

TEST(TraceCollectorTest, RendersOneProcessPerRankOnTheCoordinatorsClock) {
  TraceCollector traces;
  // Rank 1's clock runs 5 ms behind the coordinator's: its offset is +5 ms.
  hsdp::v1::StepReport r0 = Report(0, 7, 0, 1000);
  AddSpan(r0, "step", "", hsdp::v1::TRACE_TRACK_COMPUTE, 1'000'000, 9'000'000);
  AddSpan(r0, "forward", "layers.0", hsdp::v1::TRACE_TRACK_COMPUTE, 2'000'000,
          3'000'000);
  AddSpan(r0, "all-gather", "layers.0 \"x\"", hsdp::v1::TRACE_TRACK_SHARD_COMM,
          1'500'000, 2'500'000);
  hsdp::v1::StepReport r1 = Report(1, 7, 5'000'000, 3000);
  AddSpan(r1, "step", "", hsdp::v1::TRACE_TRACK_COMPUTE, -3'000'000, 4'000'000);
  AddSpan(r1, "all-reduce", "root", hsdp::v1::TRACE_TRACK_REPLICATE_COMM, 0,
          1'000);
  traces.Record(r0);
  absl::StatusOr<RenderedTrace> partial =
      traces.Render(7, 7, [](int64_t) { return 2; });
  ASSERT_TRUE(partial.ok());
  EXPECT_FALSE(partial->complete);
  EXPECT_EQ(partial->rank_steps_reported, 1);
  traces.Record(r1);
  absl::StatusOr<RenderedTrace> full =
      traces.Render(7, 7, [](int64_t) { return 2; });
  ASSERT_TRUE(full.ok());
  EXPECT_TRUE(full->complete);
  EXPECT_EQ(full->rank_steps_reported, 2);
  EXPECT_EQ(full->rank_steps_expected, 2);
  EXPECT_EQ(full->max_clock_error_nanos, 3000);

  const Struct doc = Parse(full->chrome_json);
  const auto& events = doc.fields().at("traceEvents").list_value().values();
  std::map<std::string, double> start_of;  // "pid name" -> ts
  std::map<double, std::string> process_names;
  int complete_events = 0;
  for (const Value& e : events) {
    const std::string ph = Field(e, "ph").string_value();
    const std::string name = Field(e, "name").string_value();
    const double pid = Field(e, "pid").number_value();
    if (ph == "M" && name == "process_name") {
      process_names[pid] = Field(Field(e, "args"), "name").string_value();
    }
    if (ph != "X") continue;
    ++complete_events;
    EXPECT_EQ(Field(Field(e, "args"), "step").number_value(), 7);
    start_of[std::to_string(static_cast<int>(pid)) + " " + name] =
        Field(e, "ts").number_value();
    if (name == "all-gather") {
      EXPECT_EQ(Field(e, "tid").number_value(), 1);
      EXPECT_EQ(Field(Field(e, "args"), "unit").string_value(),
                "layers.0 \"x\"");
    }
    if (name == "all-reduce") {
      EXPECT_EQ(Field(e, "tid").number_value(), 2);
    }
  }
  EXPECT_EQ(complete_events, 5);
  EXPECT_EQ(process_names[0], "rank 0");
  EXPECT_EQ(process_names[1], "rank 1");
  // Aligned: rank 1's step began at -3 ms + 5 ms = 2 ms on the coordinator's
  // clock, 1 ms after rank 0's; the origin is rank 0's step start.
  EXPECT_DOUBLE_EQ(start_of["0 step"], 0);
  EXPECT_DOUBLE_EQ(start_of["1 step"], 1000);
  EXPECT_DOUBLE_EQ(start_of["0 forward"], 1000);
}

TEST(TraceCollectorTest, UnsealedStepsAreNotCompleteAndRangesAreChecked) {
  TraceCollector traces;
  absl::StatusOr<RenderedTrace> empty =
      traces.Render(3, 4, [](int64_t) { return 0; });
  ASSERT_TRUE(empty.ok());
  EXPECT_FALSE(empty->complete);
  Parse(empty->chrome_json);
  EXPECT_EQ(traces.Render(4, 3, [](int64_t) { return 1; }).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(traces.Render(-1, 3, [](int64_t) { return 1; }).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(traces.Render(0, kMaxTraceSteps, [](int64_t) { return 1; })
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(TraceCollectorTest, KeepsABoundedNumberOfSteps) {
  TraceCollector traces;
  for (int64_t step = 0; step < static_cast<int64_t>(kMaxTracedStepsKept) + 5;
       ++step) {
    hsdp::v1::StepReport r = Report(0, step, 0, 1);
    AddSpan(r, "step", "", hsdp::v1::TRACE_TRACK_COMPUTE, 0, 1);
    traces.Record(r);
  }
  auto one = [](int64_t) { return 1; };
  EXPECT_FALSE(traces.Render(0, 0, one)->complete);  // dropped
  EXPECT_TRUE(
      traces.Render(kMaxTracedStepsKept + 4, kMaxTracedStepsKept + 4, one)
          ->complete);
}

TEST(TraceCollectorTest, LatestRangeIsTheNewestRunOfConsecutiveSteps) {
  TraceCollector traces;
  EXPECT_FALSE(traces.LatestRange(4).has_value());
  for (int64_t step : {3, 4, 10, 11, 12, 13, 14, 15}) {
    hsdp::v1::StepReport r = Report(0, step, 0, 1);
    AddSpan(r, "step", "", hsdp::v1::TRACE_TRACK_COMPUTE, 0, 1);
    traces.Record(r);
  }
  using Range = std::pair<int64_t, int64_t>;
  EXPECT_EQ(traces.LatestRange(4), Range(12, 15));    // capped
  EXPECT_EQ(traces.LatestRange(100), Range(10, 15));  // stops at the gap
  EXPECT_EQ(traces.LatestRange(1), Range(15, 15));
  EXPECT_FALSE(traces.LatestRange(0).has_value());
}

}  // namespace
}  // namespace hsdp::coordinator
