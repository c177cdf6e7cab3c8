#include "deploy/launch/progress.h"

#include <algorithm>
#include <fstream>
#include <iostream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "deploy/launch/cluster.h"
#include "deploy/launch/coordinator_status.h"

namespace hsdp::launch {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;
// How often a log or pipe gets a changed progress line.
constexpr auto kLogLineInterval = std::chrono::seconds(5);

// Minimal field extraction from the worker's flat JSON report lines (no
// nesting, no escapes).
std::optional<double> JsonNumber(const std::string& line,
                                 const std::string& key) {
  const std::string needle = absl::StrCat("\"", key, "\":");
  const size_t at = line.find(needle);
  if (at == std::string::npos) return std::nullopt;
  const size_t begin = at + needle.size();
  const size_t end = line.find_first_of(",}", begin);
  double v;
  if (!absl::SimpleAtod(line.substr(begin, end - begin), &v))
    return std::nullopt;
  return v;
}

// One status line: step, generation and mesh (once the coordinator said),
// restarts (when any), mean loss, tokens/s (sum over ranks), step time,
// per-rank peak memory (every byte LibTorch allocated / the process's RSS).
// `reports` are the live incarnations' report files.
std::string ProgressLine(
    int64_t steps, const std::vector<std::string>& reports,
    const std::optional<hsdp::v1::GetStatusResponse>& status, int restarts) {
  double loss = 0, tps = 0, step_s = 0;
  int64_t step = -1;
  int have = 0;
  std::vector<std::string> mem;
  for (size_t r = 0; r < reports.size(); ++r) {
    const std::string line = LastLine(reports[r]);
    auto s = JsonNumber(line, "step");
    if (!s) {
      mem.push_back("-");
      continue;
    }
    ++have;
    step = step < 0 ? static_cast<int64_t>(*s) : std::min<int64_t>(step, *s);
    loss = JsonNumber(line, "loss").value_or(0);
    tps += JsonNumber(line, "tokens_per_second").value_or(0);
    step_s = std::max(step_s, JsonNumber(line, "step_seconds").value_or(0));
    mem.push_back(absl::StrFormat(
        "%.1f/%.0f", JsonNumber(line, "peak_memory_bytes").value_or(0) / kMiB,
        JsonNumber(line, "rss_peak_bytes").value_or(0) / kMiB));
  }
  if (have == 0) return "waiting for workers...";
  std::string job;
  if (status.has_value()) {
    absl::StrAppend(&job, "  gen ", status->generation(), " ", MeshOf(*status));
  }
  if (restarts > 0) absl::StrAppend(&job, "  restarts ", restarts);
  return absl::StrFormat(
      "step %d/%d%s  loss %.4f  %.0f tok/s  step %.3fs  peak MiB "
      "(allocated/rss) %s",
      step + 1, steps, job, loss, tps, step_s, absl::StrJoin(mem, " "));
}

}  // namespace

void ReportScanner::Scan(const std::vector<std::string>& paths) {
  for (const std::string& path : paths) {
    std::ifstream in(path, std::ios::binary);
    if (!in) continue;
    std::streamoff& offset = offsets_[path];
    in.seekg(offset);
    std::string line;
    while (std::getline(in, line)) {
      if (in.eof()) break;  // a line still being written: read it next time
      offset += static_cast<std::streamoff>(line.size()) + 1;
      const std::optional<double> generation = JsonNumber(line, "generation");
      const std::optional<double> step = JsonNumber(line, "step");
      if (!generation.has_value() || !step.has_value()) continue;
      auto [it, added] =
          generations_.try_emplace(static_cast<int64_t>(*generation));
      Generation& g = it->second;
      if (added || *step < g.first_step) {
        g.first_step = static_cast<int64_t>(*step);
      }
      g.world_size = static_cast<int>(
          JsonNumber(line, "world_size").value_or(g.world_size));
      g.files.insert(path);
    }
  }
}

Progress::Progress(bool tty, int shard, int64_t steps,
                   std::vector<std::string> reports)
    : tty_(tty),
      shard_(shard),
      steps_(steps),
      reports_(std::move(reports)),
      all_reports_(reports_),
      last_print_(std::chrono::steady_clock::now()) {}

void Progress::Restarted(int rank, int restart, const std::string& report) {
  reports_[rank] = report;
  all_reports_.push_back(report);
  restarted_reports_[report] = {rank, restart};
}

void Progress::AddEvent(std::string event) {
  events_.push_back(std::move(event));
}

void Progress::SayGenerations() {
  scanner_.Scan(all_reports_);
  for (const auto& [number, g] : scanner_.generations()) {
    if (number <= said_generation_) continue;
    said_generation_ = number;
    std::string line = absl::StrCat("hsdp-launch: generation ", number, ": ",
                                    g.world_size / shard_, "x", shard_,
                                    " from step ", g.first_step);
    if (!events_.empty()) {
      absl::StrAppend(&line, " after ", absl::StrJoin(events_, ", "));
      events_.clear();
    }
    for (const std::string& file : g.files) {
      auto restarted = restarted_reports_.find(file);
      if (restarted == restarted_reports_.end()) continue;
      absl::StrAppend(&line, "; worker ", restarted->second.first,
                      " rejoined (restart ", restarted->second.second, ")");
      restarted_reports_.erase(restarted);
    }
    std::cerr << LineStart() << line << std::endl;
  }
  // A restarted worker whose first report line came after its
  // generation's first line (its heal takes a moment longer).
  for (const auto& [number, g] : scanner_.generations()) {
    for (const std::string& file : g.files) {
      auto restarted = restarted_reports_.find(file);
      if (restarted == restarted_reports_.end()) continue;
      std::cerr << LineStart() << "hsdp-launch: generation " << number
                << ": worker " << restarted->second.first
                << " rejoined (restart " << restarted->second.second << ")"
                << std::endl;
      restarted_reports_.erase(restarted);
    }
  }
}

void Progress::Show(bool final_line,
                    const std::optional<hsdp::v1::GetStatusResponse>& status,
                    int restarts) {
  const std::string line = ProgressLine(steps_, reports_, status, restarts);
  const auto now = std::chrono::steady_clock::now();
  if (tty_) {
    std::cerr << "\r\033[K" << line << (final_line ? "\n" : "") << std::flush;
  } else if (line != last_printed_ &&
             (final_line || now - last_print_ > kLogLineInterval)) {
    // Logs and pipes get a line every few seconds instead of a
    // carriage-return animation.
    std::cerr << line << std::endl;
    last_print_ = now;
    last_printed_ = line;
  }
}

}  // namespace hsdp::launch
