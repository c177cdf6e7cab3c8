// hsdpctl trace: steps' timelines from every rank as Chrome trace JSON.
#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "coordinator/ctl/command.h"

namespace hsdp::ctl {
namespace {

struct TraceOptions {
  std::string steps;  // "A..B", "A", or empty: the first unsealed step
  std::string output = "trace.json";
  double wait_seconds = 300;
  bool fetch_only = false;
};

// Parses "A..B" or "A" into (first, last); empty gives (0, 0): the first
// unsealed step.
absl::StatusOr<std::pair<int64_t, int64_t>> ParseStepRange(
    const std::string& text) {
  if (text.empty()) return std::make_pair<int64_t, int64_t>(0, 0);
  const size_t dots = text.find("..");
  int64_t first = 0;
  int64_t last = 0;
  const bool ok = dots == std::string::npos
                      ? absl::SimpleAtoi(text, &first) && (last = first, true)
                      : absl::SimpleAtoi(text.substr(0, dots), &first) &&
                            absl::SimpleAtoi(text.substr(dots + 2), &last);
  if (!ok || first < 0 || last < first) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--steps '", text, "': expected A..B with 0 <= A <= B, or A"));
  }
  return std::make_pair(first, last);
}

// Asks the workers to trace the steps (unless fetch_only), waits until every
// rank sent them, and writes the Chrome trace JSON.
absl::Status Trace(ControlClient& client, const GlobalOptions& g,
                   const TraceOptions& o, std::ostream& out) {
  HSDP_ASSIGN_OR_RETURN(auto range, ParseStepRange(o.steps));
  if (!o.fetch_only) {
    hsdp::v1::StartTraceRequest start;
    start.set_first_step(range.first);
    start.set_last_step(range.second);
    hsdp::v1::StartTraceResponse started;
    HSDP_RETURN_IF_ERROR(
        client.Call(&ControlService::Stub::StartTrace, start, &started));
    range = {started.first_step(), started.last_step()};
    if (!g.json) {
      out << "tracing steps " << range.first << ".." << range.second << "\n";
    }
  }
  hsdp::v1::GetTraceRequest request;
  request.set_first_step(range.first);
  request.set_last_step(range.second);
  hsdp::v1::GetTraceResponse trace;
  const absl::Time deadline = absl::Now() + absl::Seconds(o.wait_seconds);
  while (true) {
    HSDP_RETURN_IF_ERROR(
        client.Call(&ControlService::Stub::GetTrace, request, &trace));
    if (trace.complete() || o.fetch_only || absl::Now() >= deadline) break;
    absl::SleepFor(absl::Milliseconds(200));
  }
  std::ofstream file(o.output, std::ios::binary | std::ios::trunc);
  file << trace.chrome_trace_json();
  file.close();
  if (!file) {
    return absl::UnavailableError(
        absl::StrCat("cannot write the trace to ", o.output));
  }
  if (g.json) {
    hsdp::v1::GetTraceResponse summary = trace;
    summary.clear_chrome_trace_json();
    out << ToJson(summary) << "\n";
  } else {
    out << "wrote " << o.output << ": steps " << range.first << ".."
        << range.second << ", " << trace.rank_steps_reported() << "/"
        << trace.rank_steps_expected() << " rank-steps, clocks aligned within "
        << absl::StrFormat("%.3f", trace.max_clock_error_nanos() * 2 / 1e6)
        << " ms\n";
  }
  if (!trace.complete()) {
    return absl::DeadlineExceededError(
        absl::StrCat("only ", trace.rank_steps_reported(), " of ",
                     trace.rank_steps_expected(),
                     " rank-steps arrived (partial trace in ", o.output, ")"));
  }
  return absl::OkStatus();
}

}  // namespace

void AddTraceCommand(CLI::App& app, std::vector<Command>& commands) {
  CLI::App* trace = app.add_subcommand(
      "trace",
      "Record steps' timelines on every rank; write Chrome trace JSON");
  auto to = std::make_shared<TraceOptions>();
  trace->add_option("--steps", to->steps,
                    "A..B or A (default: the next unsealed step)");
  trace->add_option("-o,--output", to->output, "Output file (trace.json)");
  trace->add_option("--wait", to->wait_seconds,
                    "Seconds to wait for every rank's spans (300)");
  trace->add_flag("--fetch-only", to->fetch_only,
                  "Fetch steps traced before; request nothing");
  commands.push_back(
      {trace, [to](ControlClient& client, const GlobalOptions& g,
                   std::ostream& out) { return Trace(client, g, *to, out); }});
}

}  // namespace hsdp::ctl
