#include "coordinator/core/trace_collector.h"

#include <algorithm>
#include <limits>
#include <tuple>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace hsdp::coordinator {
namespace {

// Chrome trace threads (tids) of a rank's process.
constexpr int kComputeTid = 0;
constexpr int kShardCommTid = 1;
constexpr int kReplicateCommTid = 2;

int TidOf(hsdp::v1::TraceTrack track) {
  switch (track) {
    case hsdp::v1::TRACE_TRACK_SHARD_COMM:
      return kShardCommTid;
    case hsdp::v1::TRACE_TRACK_REPLICATE_COMM:
      return kReplicateCommTid;
    default:
      return kComputeTid;
  }
}

// A JSON string literal (quotes included).
std::string JsonString(absl::string_view s) {
  std::string out = "\"";
  for (const char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          absl::StrAppendFormat(&out, "\\u%04x", static_cast<int>(c));
        } else {
          out += c;
        }
    }
  }
  out += "\"";
  return out;
}

// Microseconds with nanosecond precision, as Chrome's "ts"/"dur" take them.
std::string Micros(int64_t nanos) {
  return absl::StrFormat("%d.%03d", nanos / 1000, nanos % 1000);
}

void AppendMetadata(std::string* out, int pid, int tid, absl::string_view kind,
                    absl::string_view name) {
  absl::StrAppend(out, "{\"ph\":\"M\",\"pid\":", pid, ",\"tid\":", tid,
                  ",\"name\":", JsonString(kind),
                  ",\"args\":{\"name\":", JsonString(name), "}},\n");
}

}  // namespace

absl::Status ValidateTraceRange(int64_t first_step, int64_t last_step) {
  if (first_step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("first_step ", first_step, " is negative"));
  }
  if (last_step < first_step) {
    return absl::InvalidArgumentError(absl::StrCat(
        "last_step ", last_step, " is before first_step ", first_step));
  }
  if (last_step - first_step + 1 > kMaxTraceSteps) {
    return absl::InvalidArgumentError(absl::StrCat("last_step ", last_step,
                                                   ": a trace covers at most ",
                                                   kMaxTraceSteps, " steps"));
  }
  return absl::OkStatus();
}

void TraceCollector::Record(const hsdp::v1::StepReport& report) {
  RankSteps entry;
  entry.clock_error_nanos = report.clock_error_nanos();
  const int n = std::min(report.trace_size(), kMaxSpansPerRankStep);
  entry.spans.reserve(n);
  for (int i = 0; i < n; ++i) {
    hsdp::v1::TraceSpan span = report.trace(i);
    span.set_begin_unix_nanos(span.begin_unix_nanos() +
                              report.clock_offset_nanos());
    span.set_end_unix_nanos(
        std::max(span.end_unix_nanos() + report.clock_offset_nanos(),
                 span.begin_unix_nanos()));
    entry.spans.push_back(std::move(span));
  }
  absl::MutexLock lock(&mu_);
  steps_[report.step()][report.rank()] = std::move(entry);
  while (steps_.size() > kMaxTracedStepsKept) steps_.erase(steps_.begin());
}

std::optional<std::pair<int64_t, int64_t>> TraceCollector::LatestRange(
    int64_t max_steps) const {
  absl::MutexLock lock(&mu_);
  if (steps_.empty() || max_steps < 1) return std::nullopt;
  auto it = steps_.rbegin();
  const int64_t last = it->first;
  int64_t first = last;
  for (++it; it != steps_.rend() && it->first == first - 1 &&
             last - it->first < max_steps;
       ++it) {
    first = it->first;
  }
  return std::make_pair(first, last);
}

absl::StatusOr<RenderedTrace> TraceCollector::Render(
    int64_t first_step, int64_t last_step,
    const std::function<int(int64_t)>& expected_ranks) const {
  if (absl::Status s = ValidateTraceRange(first_step, last_step); !s.ok()) {
    return s;
  }
  RenderedTrace result;
  result.complete = true;
  // (rank, step, span), sorted per rank and track by start so that parents
  // come before the spans they contain.
  struct Event {
    int rank;
    int64_t step;
    const hsdp::v1::TraceSpan* span;
  };
  std::vector<Event> events;
  int64_t origin = std::numeric_limits<int64_t>::max();
  std::map<int, bool> ranks;
  absl::MutexLock lock(&mu_);
  for (int64_t step = first_step; step <= last_step; ++step) {
    const int expected = expected_ranks(step);
    result.rank_steps_expected += expected;
    auto it = steps_.find(step);
    int reported = 0;
    if (it != steps_.end()) {
      for (const auto& [rank, entry] : it->second) {
        ++reported;
        ranks[rank] = true;
        result.max_clock_error_nanos =
            std::max(result.max_clock_error_nanos, entry.clock_error_nanos);
        for (const hsdp::v1::TraceSpan& span : entry.spans) {
          events.push_back(Event{rank, step, &span});
          origin = std::min(origin, span.begin_unix_nanos());
        }
      }
    }
    result.rank_steps_reported += reported;
    if (expected == 0 || reported < expected) result.complete = false;
  }
  std::sort(events.begin(), events.end(), [](const Event& a, const Event& b) {
    const int ta = TidOf(a.span->track());
    const int tb = TidOf(b.span->track());
    return std::make_tuple(a.rank, ta, a.span->begin_unix_nanos(),
                           -a.span->end_unix_nanos()) <
           std::make_tuple(b.rank, tb, b.span->begin_unix_nanos(),
                           -b.span->end_unix_nanos());
  });
  std::string out = "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
  for (const auto& [rank, unused] : ranks) {
    AppendMetadata(&out, rank, kComputeTid, "process_name",
                   absl::StrCat("rank ", rank));
    AppendMetadata(&out, rank, kComputeTid, "thread_name", "compute");
    AppendMetadata(&out, rank, kShardCommTid, "thread_name", "shard comm");
    AppendMetadata(&out, rank, kReplicateCommTid, "thread_name",
                   "replicate comm");
    absl::StrAppend(
        &out, "{\"ph\":\"M\",\"pid\":", rank,
        ",\"name\":\"process_sort_index\",\"args\":{\"sort_index\":", rank,
        "}},\n");
  }
  for (const Event& e : events) {
    const hsdp::v1::TraceSpan& s = *e.span;
    const int tid = TidOf(s.track());
    absl::StrAppend(
        &out, "{\"ph\":\"X\",\"pid\":", e.rank, ",\"tid\":", tid,
        ",\"name\":", JsonString(s.name()),
        ",\"cat\":", tid == kComputeTid ? "\"compute\"" : "\"comm\"",
        ",\"ts\":", Micros(s.begin_unix_nanos() - origin),
        ",\"dur\":", Micros(s.end_unix_nanos() - s.begin_unix_nanos()),
        ",\"args\":{\"step\":", e.step, ",\"unit\":", JsonString(s.unit()),
        ",\"microbatch\":", s.microbatch(), "}},\n");
  }
  // A closing event keeps every element above comma-terminated.
  absl::StrAppend(&out,
                  "{\"ph\":\"M\",\"pid\":0,\"name\":\"trace_origin\",\"args\":{"
                  "\"unix_nanos\":",
                  events.empty() ? 0 : origin, "}}\n],\"otherData\":{",
                  "\"first_step\":", first_step, ",\"last_step\":", last_step,
                  ",\"complete\":", result.complete ? "true" : "false",
                  ",\"max_clock_error_nanos\":", result.max_clock_error_nanos,
                  "}}\n");
  result.chrome_json = std::move(out);
  return result;
}

}  // namespace hsdp::coordinator
