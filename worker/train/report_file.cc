#include "worker/train/report_file.h"

#include <cstring>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace hsdp::train {
namespace {

// Reads a "VmHWM:  1234 kB" style line of /proc/self/status; 0 when
// unavailable.
int64_t ProcStatusBytes(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (absl::StartsWith(line, field)) {
      std::istringstream fields(line.substr(std::strlen(field)));
      int64_t kb = 0;
      fields >> kb;
      return kb * 1024;
    }
  }
  return 0;
}

}  // namespace

std::string LossFields(double loss) {
  return absl::StrFormat("\"loss\":%.9g,\"loss_hex\":\"%a\"", loss, loss);
}

absl::Status ReportFile::Open(const std::string& path) {
  if (path.empty()) return absl::OkStatus();
  out_.open(path, std::ios::app);
  if (!out_) {
    return absl::NotFoundError(
        absl::StrCat("cannot open report file '", path, "'"));
  }
  return absl::OkStatus();
}

void ReportFile::WriteLine(const std::string& json) {
  if (!out_.is_open()) return;
  out_ << json << "\n";
  out_.flush();
}

void ReportFile::Write(const StepLine& l) {
  WriteLine(absl::StrFormat(
      "{\"rank\":%d,\"step\":%d,%s,\"step_seconds\":%.6f,"
      "\"tokens_per_second\":%.1f,\"lr\":%.9g,"
      "\"peak_memory_bytes\":%d,\"activation_bytes\":%d,\"rss_bytes\":%d,\"rss_"
      "peak_bytes\":%d,"
      "\"policy_version\":%d,\"reshard_after_forward\":\"%s\","
      "\"microbatches\":%d,"
      "\"all_gather_seconds\":%.6f,\"reduce_scatter_seconds\":%.6f,"
      "\"checkpoint\":%s,\"world_size\":%d,"
      "\"first_sample\":%d,\"sample_count\":%d,\"generation\":%d,"
      "\"first_microbatch\":%d,\"microbatch_count\":%d,"
      "\"commit_seconds\":%.6f%s}",
      l.rank, l.step, LossFields(l.loss), l.step_seconds, l.tokens_per_second,
      l.learning_rate, l.peak_memory_bytes, l.activation_bytes,
      ProcStatusBytes("VmRSS:"), ProcStatusBytes("VmHWM:"), l.policy_version,
      l.reshard_after_forward, l.microbatches, l.all_gather_seconds,
      l.reduce_scatter_seconds, l.checkpoint ? "true" : "false", l.world_size,
      l.first_sample, l.sample_count, l.generation, l.first_microbatch,
      l.microbatch_count, l.commit_seconds,
      l.heal_crc32c.has_value()
          ? absl::StrFormat(",\"heal_crc32c\":\"%08x\"", *l.heal_crc32c)
          : std::string()));
}

void ReportFile::WriteReference(int64_t step, double loss,
                                double step_seconds) {
  WriteLine(
      absl::StrFormat("{\"rank\":-1,\"step\":%d,%s,\"step_seconds\":%.6f}",
                      step, LossFields(loss), step_seconds));
}

}  // namespace hsdp::train
