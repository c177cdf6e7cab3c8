// Reading report files (report_file.h) and comparing a run's with a
// reference's, after checking that the settings which decide the numbers
// agree (hsdp-compare). Torch-free.
#ifndef HSDP_WORKER_TRAIN_REPORT_COMPARE_H_
#define HSDP_WORKER_TRAIN_REPORT_COMPARE_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "hsdp/v1/common.pb.h"
#include "worker/train/report_file.h"

namespace hsdp::train {

// RunSettings and SettingsJson (the writing side) are in report_file.h.
// The object SettingsJson wrote (a parsed "settings" value, re-serialised);
// INVALID_ARGUMENT naming what is missing or malformed.
absl::StatusOr<RunSettings> ParseSettingsJson(absl::string_view json);

// OK when `run` and `reference` decide the same numbers. Memory and speed
// trades (cpu_offload, recompute_units) and --on-nonfinite are not compared,
// nor steps unless a cosine schedule makes every step's learning rate depend
// on them. Otherwise FAILED_PRECONDITION naming the first differing field and
// both values ("microbatch_size differs: the run has 8, the reference has 4").
absl::Status CompareRunSettings(const RunSettings& run,
                                const RunSettings& reference);

// One step of one rank, as a report line holds it.
struct ReportedStep {
  int rank = 0;
  int64_t step = 0;
  // Unset when the line says "loss":null (a non-finite loss). Read from
  // loss_hex when the line has it: exact, where "loss" has 9 digits.
  std::optional<double> loss;
  std::string loss_hex;
};

// The lines of one or more report files: steps per rank (the last line of a
// step wins: a resumed worker trains the steps after its checkpoint again)
// and every settings object they carry.
struct ReportContents {
  // rank -> step -> line; the reference's rank is -1.
  std::map<int, std::map<int64_t, ReportedStep>> steps;
  std::vector<RunSettings> settings;
};

// Reads `path` into `contents`. INVALID_ARGUMENT naming the file and line for
// a line that is not a JSON object with "rank" and "step"; NOT_FOUND for a
// file that cannot be read.
absl::Status ReadReportFile(const std::string& path, ReportContents& contents);

// The comparison of one rank with the reference.
struct RankComparison {
  int rank = 0;
  // Steps both hold.
  int64_t steps_compared = 0;
  // Over the steps compared with a finite loss on both sides.
  double max_abs_diff = 0;
  int64_t max_diff_step = -1;
  // The first step compared whose losses are not bitwise equal; -1: none.
  int64_t first_differing_step = -1;
  // Step 0 compared and bitwise equal.
  bool step0_bitwise_equal = false;
  bool step0_compared = false;
  // Steps the run has that the reference lacks, and the opposite.
  int64_t only_in_run = 0;
  int64_t only_in_reference = 0;
  // Steps where exactly one side's loss is null (non-finite).
  int64_t nonfinite_mismatches = 0;
};

struct Comparison {
  RunSettings reference_settings;
  std::vector<RankComparison> ranks;
  double max_abs_diff = 0;
};

// Compares every rank of `run` with `reference` (one rank -1). Refuses
// (FAILED_PRECONDITION) when either carries no settings, when the reference
// holds other than exactly one reference run, or when any settings object of
// the run differs from the reference's (CompareRunSettings).
absl::StatusOr<Comparison> CompareReports(const ReportContents& run,
                                          const ReportContents& reference);

// The comparison as text: one line per rank, then the overall line.
std::string FormatComparison(const Comparison& comparison);

}  // namespace hsdp::train

#endif  // HSDP_WORKER_TRAIN_REPORT_COMPARE_H_
