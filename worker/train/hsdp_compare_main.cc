// hsdp-compare: a run's report files against a --reference run's.
//
//   hsdp-compare [--tolerance X] RUN... REFERENCE.jsonl
//
// RUN is a report file or a directory of them (*.jsonl; files holding only
// reference lines are skipped). Prints, per rank, the max |Δloss| and its
// step, the first step whose loss is not bitwise equal, and whether step 0 is
// bitwise equal. Refuses (exit 2) when the settings that decide the numbers
// differ, naming the field; exit 1 when --tolerance is given and exceeded (or
// a loss is non-finite on one side only).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <filesystem>
#include <iostream>
#include <string>
#include <system_error>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "worker/train/report_compare.h"

namespace {

using hsdp::train::ReportContents;

constexpr int kExitBeyondTolerance = 1;
constexpr int kExitRefused = 2;
constexpr char kProgram[] = "hsdp-compare";

bool OnlyReferenceLines(const ReportContents& c) {
  return !c.steps.empty() && c.steps.size() == 1 && c.steps.begin()->first < 0;
}

// Adds `path`'s lines to `run`.
absl::Status AddFile(const std::string& path, ReportContents& run) {
  ReportContents file;
  if (absl::Status s = hsdp::train::ReadReportFile(path, file); !s.ok()) {
    return s;
  }
  if (OnlyReferenceLines(file)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " holds a reference run: name it last"));
  }
  for (auto& [rank, steps] : file.steps) {
    for (auto& [step, line] : steps) run.steps[rank][step] = line;
  }
  run.settings.insert(run.settings.end(), file.settings.begin(),
                      file.settings.end());
  return absl::OkStatus();
}

// A directory's *.jsonl files, but the reference and other reference runs.
absl::Status AddDirectory(const std::filesystem::path& dir,
                          const std::filesystem::path& reference,
                          ReportContents& run) {
  std::error_code ec;
  std::vector<std::filesystem::path> files;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    if (entry.is_regular_file() &&
        absl::EndsWith(entry.path().filename().string(), ".jsonl")) {
      files.push_back(entry.path());
    }
  }
  if (ec) {
    return absl::NotFoundError(
        absl::StrCat("cannot list '", dir.string(), "': ", ec.message()));
  }
  std::sort(files.begin(), files.end());
  int added = 0;
  for (const std::filesystem::path& f : files) {
    if (std::filesystem::equivalent(f, reference, ec)) continue;
    ReportContents file;
    if (absl::Status s = hsdp::train::ReadReportFile(f.string(), file);
        !s.ok()) {
      return s;
    }
    if (OnlyReferenceLines(file)) continue;
    if (absl::Status s = AddFile(f.string(), run); !s.ok()) return s;
    ++added;
  }
  if (added == 0) {
    return absl::NotFoundError(
        absl::StrCat("no report files (*.jsonl) of a run in ", dir.string()));
  }
  return absl::OkStatus();
}

int Refuse(const std::string& message) {
  std::cerr << kProgram << ": " << message << std::endl;
  return kExitRefused;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> paths;
  double tolerance = -1;
  CLI::App app{
      "hsdp-compare: compares a run's report files (or a directory of them) "
      "with a --reference run's report file, after checking that the "
      "settings which decide the numbers agree"};
  app.add_option("paths", paths, "RUN... REFERENCE.jsonl")
      ->required()
      ->expected(2, -1);
  app.add_option("--tolerance", tolerance,
                 "exit 1 when some |dloss| exceeds this");
  CLI11_PARSE(app, argc, argv);

  const std::filesystem::path reference_path = paths.back();
  paths.pop_back();
  ReportContents reference, run;
  if (absl::Status s =
          hsdp::train::ReadReportFile(reference_path.string(), reference);
      !s.ok()) {
    return Refuse(std::string(s.message()));
  }
  for (const std::string& p : paths) {
    std::error_code ec;
    const absl::Status s = std::filesystem::is_directory(p, ec)
                               ? AddDirectory(p, reference_path, run)
                               : AddFile(p, run);
    if (!s.ok()) return Refuse(std::string(s.message()));
  }
  absl::StatusOr<hsdp::train::Comparison> comparison =
      hsdp::train::CompareReports(run, reference);
  if (!comparison.ok()) {
    return Refuse(absl::StrCat("refused: ", comparison.status().message()));
  }
  std::cout << hsdp::train::FormatComparison(*comparison);
  if (tolerance >= 0 && comparison->max_abs_diff > tolerance) {
    std::cerr << kProgram << ": max |dloss| " << comparison->max_abs_diff
              << " exceeds --tolerance " << tolerance << std::endl;
    return kExitBeyondTolerance;
  }
  if (tolerance >= 0) {
    for (const hsdp::train::RankComparison& c : comparison->ranks) {
      if (c.nonfinite_mismatches > 0) {
        std::cerr << kProgram << ": rank " << c.rank
                  << " has a non-finite loss where the reference has none, "
                     "or the opposite"
                  << std::endl;
        return kExitBeyondTolerance;
      }
    }
  }
  return 0;
}
