// Timeline traces end to end: `hsdpctl trace` against a 2x2 job of real
// worker processes. The file is Chrome trace-event JSON with one process per
// rank; every rank's spans per unit match the step's schedule; spans nest on
// each track; and the ranks' "step" spans, which collectives tie together,
// overlap once aligned on the coordinator's clock (within the stated bound).
#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/e2e/cluster.h"

namespace hsdp::e2e {
namespace {

using google::protobuf::Struct;
using google::protobuf::Value;

constexpr int kWorkers = 4;
// Steps traced.
constexpr int64_t kTraced = 2;

Struct ParseJson(const std::string& json) {
  Struct doc;
  const auto status = google::protobuf::util::JsonStringToMessage(json, &doc);
  EXPECT_TRUE(status.ok()) << status.ToString();
  return doc;
}

const Value& Get(const Value& v, const std::string& name) {
  static const Value kNull;
  const auto& fields = v.struct_value().fields();
  auto it = fields.find(name);
  return it == fields.end() ? kNull : it->second;
}

struct Span {
  int rank;
  int tid;
  std::string name;
  std::string unit;
  int64_t step;
  double begin;
  double end;
};

TEST(TraceE2eTest, HsdpctlTraceWritesAlignedPerRankTimelines) {
  Cluster c("trace");
  c.StartCoordinator(kWorkers, "2x2");
  c.StartWorkers(kWorkers, {}, 60);
  ASSERT_TRUE(c.WaitForSteps(3));

  // A few steps past the sealed one (the read-ahead window seals ahead).
  std::string out;
  int64_t first = -1;
  for (int attempt = 0; attempt < 5 && first < 0; ++attempt) {
    std::string status;
    ASSERT_EQ(c.Ctl({"--json", "status"}, &status), 0) << status;
    const Struct s = ParseJson(status);
    // int64 fields print as JSON strings.
    const int64_t sealed =
        std::stoll(s.fields().at("sealed_step").string_value());
    const int64_t want = sealed + 6;
    const std::string trace_file = c.dir() + "/trace.json";
    if (c.Ctl({"trace", "--steps", absl::StrCat(want, "..", want + kTraced - 1),
               "-o", trace_file, "--wait", "25"},
              &out) == 0) {
      first = want;
    }
  }
  ASSERT_GE(first, 0) << out;
  EXPECT_NE(out.find(absl::StrCat(kWorkers * kTraced, "/", kWorkers * kTraced,
                                  " rank-steps")),
            std::string::npos)
      << out;
  const Struct doc = ParseJson(ReadFile(c.dir() + "/trace.json"));

  // The schedule of the traced steps: reduce-scatters and all-reduces per
  // unit follow its microbatch flags.
  int grad_syncs = 0;
  int all_reduces = 0;
  int microbatches = 0;
  for (int64_t step = first; step < first + kTraced; ++step) {
    std::string sched;
    ASSERT_EQ(
        c.Ctl({"--json", "schedule", "--step", std::to_string(step)}, &sched),
        0)
        << sched;
    const Struct s = ParseJson(sched);
    const Value& schedule = s.fields().at("schedule");
    EXPECT_TRUE(Get(schedule, "trace").bool_value());
    for (const Value& mb :
         Get(schedule, "microbatches").list_value().values()) {
      ++microbatches;
      grad_syncs += Get(mb, "requires_grad_sync").bool_value();
      all_reduces += Get(mb, "requires_all_reduce").bool_value();
    }
  }
  ASSERT_GT(microbatches, 0);

  std::vector<Span> spans;
  std::map<int, std::string> processes;
  for (const Value& e : doc.fields().at("traceEvents").list_value().values()) {
    const std::string ph = Get(e, "ph").string_value();
    const int pid = static_cast<int>(Get(e, "pid").number_value());
    if (ph == "M" && Get(e, "name").string_value() == "process_name") {
      processes[pid] = Get(Get(e, "args"), "name").string_value();
    }
    if (ph != "X") continue;
    const double ts = Get(e, "ts").number_value();
    spans.push_back(
        Span{pid, static_cast<int>(Get(e, "tid").number_value()),
             Get(e, "name").string_value(),
             Get(Get(e, "args"), "unit").string_value(),
             static_cast<int64_t>(Get(Get(e, "args"), "step").number_value()),
             ts, ts + Get(e, "dur").number_value()});
  }
  ASSERT_EQ(processes.size(), static_cast<size_t>(kWorkers));
  for (int r = 0; r < kWorkers; ++r) {
    EXPECT_EQ(processes[r], absl::StrCat("rank ", r));
  }

  // Per rank and unit: counts against the schedule.
  std::map<std::tuple<int, std::string, std::string>, int> count;
  std::set<std::string> units;
  for (const Span& s : spans) {
    ++count[{s.rank, s.unit, s.name}];
    if (!s.unit.empty()) units.insert(s.unit);
  }
  EXPECT_EQ(units.size(), 5u);  // root + 4 blocks (kDims)
  for (int r = 0; r < kWorkers; ++r) {
    for (const std::string& u : units) {
      SCOPED_TRACE(absl::StrCat("rank ", r, " unit ", u));
      EXPECT_EQ((count[{r, u, "forward"}]), microbatches);
      EXPECT_EQ((count[{r, u, "backward"}]), microbatches);
      EXPECT_EQ((count[{r, u, "reduce-scatter"}]), grad_syncs);
      EXPECT_EQ((count[{r, u, "all-reduce"}]), all_reduces);
      EXPECT_EQ((count[{r, u, "all-gather"}]),
                (count[{r, u, "wait all-gather"}]));
      EXPECT_GE((count[{r, u, "all-gather"}]), microbatches);
    }
    EXPECT_EQ((count[{r, "", "step"}]), kTraced);
    EXPECT_EQ((count[{r, "", "optimizer"}]), kTraced);
    EXPECT_EQ((count[{r, "", "schedule fetch"}]), kTraced);
  }

  // Nesting per rank and track (1 ns of slack for the microsecond rounding).
  constexpr double kSlack = 0.001;
  for (size_t i = 0; i < spans.size(); ++i) {
    for (size_t j = i + 1; j < spans.size(); ++j) {
      const Span& a = spans[i];
      const Span& b = spans[j];
      if (a.rank != b.rank || a.tid != b.tid) continue;
      const bool disjoint =
          a.end <= b.begin + kSlack || b.end <= a.begin + kSlack;
      const bool nested =
          (b.begin <= a.begin + kSlack && a.end <= b.end + kSlack) ||
          (a.begin <= b.begin + kSlack && b.end <= a.end + kSlack);
      EXPECT_TRUE(disjoint || nested)
          << "rank " << a.rank << " tid " << a.tid << ": " << a.name << " "
          << a.unit << " [" << a.begin << ", " << a.end << "] and " << b.name
          << " " << b.unit << " [" << b.begin << ", " << b.end << "]";
    }
  }

  // Alignment: a step's collectives tie every rank together, so the ranks'
  // step spans overlap; after alignment they must, within the bound.
  const double bound_us = 2 *
                          doc.fields()
                              .at("otherData")
                              .struct_value()
                              .fields()
                              .at("max_clock_error_nanos")
                              .number_value() /
                          1000.0;
  EXPECT_LT(bound_us, 50'000) << "clock offsets are too uncertain";
  for (int64_t step = first; step < first + kTraced; ++step) {
    double latest_begin = -1e300;
    double earliest_end = 1e300;
    for (const Span& s : spans) {
      if (s.name != "step" || s.step != step) continue;
      latest_begin = std::max(latest_begin, s.begin);
      earliest_end = std::min(earliest_end, s.end);
    }
    EXPECT_LE(latest_begin, earliest_end + bound_us) << "step " << step;
  }
  c.WaitWorkers();
}

}  // namespace
}  // namespace hsdp::e2e
