// The per-step report file (--report-file): JSON lines, one object per step,
// appended and flushed as each step ends (the launcher and tests tail it).
// Fields are listed in worker/README.md. Every line is valid JSON: a
// non-finite loss is written "loss":null (its bits stay in loss_hex).
//
// The first line a process writes, and the first after any change of them,
// ends with "settings":{...}: the settings that decide the numbers (world
// size, microbatches per rank, global batch in samples, and the training
// settings as hsdp.v1.TrainingSpec JSON: task name and version, task options,
// seed, steps, microbatch size, optimizer, schedule, dtypes, clipping), so a
// run and its reference can be checked against each other (hsdp-compare).
#ifndef HSDP_WORKER_TRAIN_REPORT_FILE_H_
#define HSDP_WORKER_TRAIN_REPORT_FILE_H_

#include <cstdint>
#include <fstream>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "hsdp/v1/common.pb.h"

namespace hsdp::train {

// The settings that decide a run's numbers.
struct RunSettings {
  int world_size = 0;
  // Microbatches per rank per step.
  int microbatches = 0;
  // Samples per step over every rank (world × microbatches × microbatch size
  // in a run that keeps its mesh).
  int64_t global_batch = 0;
  hsdp::v1::TrainingSpec training;
};

// One JSON object, on one line.
std::string SettingsJson(const RunSettings& settings);

// One step of a sharded run, as the report file shows it.
struct StepLine {
  int rank = 0;
  int64_t step = 0;
  double loss = 0;
  double step_seconds = 0;
  double tokens_per_second = 0;
  double learning_rate = 0;
  // Every byte LibTorch allocated at the step's peak (parameter state,
  // gathered units, activations, temporaries, the batch): fsdp::
  // MeasuredPeakBytes.
  int64_t peak_memory_bytes = 0;
  int64_t activation_bytes = 0;
  // This rank's share of the training state: its parameter shards, their
  // reduced gradients and the optimizer's state (AdamW: two more copies).
  int64_t parameter_state_bytes = 0;
  // The most gathered (unsharded) parameter bytes alive at once.
  int64_t gathered_peak_bytes = 0;
  int64_t policy_version = 0;
  // One character per unit: '1' reshards after forward.
  std::string reshard_after_forward;
  int microbatches = 0;
  double all_gather_seconds = 0;
  double reduce_scatter_seconds = 0;
  // All-gathers this rank issued in the step: over its shard group, and over
  // its host group (hierarchical reshard).
  int64_t all_gathers = 0;
  int64_t host_all_gathers = 0;
  bool checkpoint = false;
  int world_size = 0;
  // Global sample indices this rank trained: [first, first + count).
  int64_t first_sample = 0;
  int64_t sample_count = 0;
  // The sample ledger of a committed step: the membership generation it
  // committed in and the global microbatches this rank trained, [first,
  // first + count) (samples [first * microbatch_size, ...)); zero-weight
  // padding is not listed.
  int64_t generation = 0;
  int64_t first_microbatch = 0;
  int64_t microbatch_count = 0;
  // Set on the first step after this rank took part in a heal (as source or
  // target): the CRC32C of its shard state right after the heal, equal on
  // every replica of its shard index when the heal copied bitwise.
  std::optional<uint32_t> heal_crc32c;
  // Time in the commit vote (CommitStep, until every rank voted).
  double commit_seconds = 0;
  // Set on a step skipped for a non-finite loss or gradient norm: why.
  std::string nonfinite;
};

// One step of the single-process reference.
struct ReferenceLine {
  int64_t step = 0;
  double loss = 0;
  double step_seconds = 0;
  // As StepLine::nonfinite.
  std::string nonfinite;
};

// Thread-compatible. Writing to a closed file (no path) does nothing.
class ReportFile {
 public:
  // Appends to `path`; an empty path writes nothing.
  absl::Status Open(const std::string& path);
  // The next line written carries `settings` unless it equals the settings
  // written last.
  void SetSettings(const RunSettings& settings);
  void Write(const StepLine& line);
  // A reference step: {"rank":-1,"step":...,"loss":...,"step_seconds":...}.
  void WriteReference(const ReferenceLine& line);

 private:
  // `fields` without the closing brace.
  void WriteLine(std::string fields);
  std::ofstream out_;
  std::string pending_settings_;
  std::string written_settings_;
};

// "loss":...,"loss_hex":"..." — the loss also as a C99 hex float, so tests
// compare bits; "loss":null when it is not finite.
std::string LossFields(double loss);

}  // namespace hsdp::train

#endif  // HSDP_WORKER_TRAIN_REPORT_FILE_H_
