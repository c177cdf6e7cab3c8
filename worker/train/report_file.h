// The per-step report file (--report-file): JSON lines, one object per step,
// appended and flushed as each step ends (the launcher and tests tail it).
// Fields are listed in worker/README.md.
#ifndef HSDP_WORKER_TRAIN_REPORT_FILE_H_
#define HSDP_WORKER_TRAIN_REPORT_FILE_H_

#include <cstdint>
#include <fstream>
#include <string>

#include "absl/status/status.h"

namespace hsdp::train {

// One step of a sharded run, as the report file shows it.
struct StepLine {
  int rank = 0;
  int64_t step = 0;
  double loss = 0;
  double step_seconds = 0;
  double tokens_per_second = 0;
  double learning_rate = 0;
  int64_t peak_memory_bytes = 0;
  int64_t activation_bytes = 0;
  int64_t policy_version = 0;
  // One character per unit: '1' reshards after forward.
  std::string reshard_after_forward;
  int microbatches = 0;
  double all_gather_seconds = 0;
  double reduce_scatter_seconds = 0;
  bool checkpoint = false;
  int world_size = 0;
  // Global sample indices this rank trained: [first, first + count).
  int64_t first_sample = 0;
  int64_t sample_count = 0;
};

// Thread-compatible. Writing to a closed file (no path) does nothing.
class ReportFile {
 public:
  // Appends to `path`; an empty path writes nothing.
  absl::Status Open(const std::string& path);
  void Write(const StepLine& line);
  // A reference step: {"rank":-1,"step":...,"loss":...,"step_seconds":...}.
  void WriteReference(int64_t step, double loss, double step_seconds);

 private:
  void WriteLine(const std::string& json);
  std::ofstream out_;
};

// "loss":...,"loss_hex":"..." — the loss also as a C99 hex float, so tests
// compare bits.
std::string LossFields(double loss);

}  // namespace hsdp::train

#endif  // HSDP_WORKER_TRAIN_REPORT_FILE_H_
