#include "worker/train/report_file.h"

#include <google/protobuf/util/json_util.h>

#include <cmath>
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

// `text` as a JSON string literal.
std::string JsonString(const std::string& text) {
  std::string out = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += absl::StrFormat("\\u%04x", static_cast<int>(c));
    } else {
      out += c;
    }
  }
  return out + "\"";
}

std::string NonFiniteField(const std::string& nonfinite) {
  return nonfinite.empty()
             ? std::string()
             : absl::StrCat(",\"nonfinite\":", JsonString(nonfinite),
                            ",\"skipped\":true");
}

}  // namespace

std::string SettingsJson(const RunSettings& s) {
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  std::string training;
  if (!google::protobuf::util::MessageToJsonString(s.training, &training,
                                                   options)
           .ok()) {
    training = "{}";  // a TrainingSpec always prints
  }
  return absl::StrCat(
      "{\"world_size\":", s.world_size, ",\"microbatches\":", s.microbatches,
      ",\"global_batch\":", s.global_batch, ",\"training\":", training, "}");
}

std::string LossFields(double loss) {
  if (!std::isfinite(loss)) {
    return absl::StrFormat("\"loss\":null,\"loss_hex\":\"%a\"", loss);
  }
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

void ReportFile::SetSettings(const RunSettings& settings) {
  std::string json = SettingsJson(settings);
  pending_settings_ = json == written_settings_ ? std::string() : json;
}

void ReportFile::WriteLine(std::string fields) {
  if (!out_.is_open()) return;
  if (!pending_settings_.empty()) {
    absl::StrAppend(&fields, ",\"settings\":", pending_settings_);
    written_settings_ = std::move(pending_settings_);
    pending_settings_.clear();
  }
  out_ << fields << "}\n";
  out_.flush();
}

void ReportFile::Write(const StepLine& l) {
  WriteLine(absl::StrFormat(
      "{\"rank\":%d,\"step\":%d,%s,\"step_seconds\":%.6f,"
      "\"tokens_per_second\":%.1f,\"lr\":%.9g,"
      "\"peak_memory_bytes\":%d,\"activation_bytes\":%d,"
      "\"parameter_state_bytes\":%d,\"gathered_peak_bytes\":%d,"
      "\"rss_bytes\":%d,\"rss_peak_bytes\":%d,"
      "\"policy_version\":%d,\"reshard_after_forward\":\"%s\","
      "\"microbatches\":%d,"
      "\"all_gather_seconds\":%.6f,\"reduce_scatter_seconds\":%.6f,"
      "\"all_gathers\":%d,\"host_all_gathers\":%d,"
      "\"checkpoint\":%s,\"world_size\":%d,"
      "\"first_sample\":%d,\"sample_count\":%d,\"generation\":%d,"
      "\"first_microbatch\":%d,\"microbatch_count\":%d,"
      "\"commit_seconds\":%.6f%s%s",
      l.rank, l.step, LossFields(l.loss), l.step_seconds, l.tokens_per_second,
      l.learning_rate, l.peak_memory_bytes, l.activation_bytes,
      l.parameter_state_bytes, l.gathered_peak_bytes, ProcStatusBytes("VmRSS:"),
      ProcStatusBytes("VmHWM:"), l.policy_version, l.reshard_after_forward,
      l.microbatches, l.all_gather_seconds, l.reduce_scatter_seconds,
      l.all_gathers, l.host_all_gathers, l.checkpoint ? "true" : "false",
      l.world_size, l.first_sample, l.sample_count, l.generation,
      l.first_microbatch, l.microbatch_count, l.commit_seconds,
      l.heal_crc32c.has_value()
          ? absl::StrFormat(",\"heal_crc32c\":\"%08x\"", *l.heal_crc32c)
          : std::string(),
      NonFiniteField(l.nonfinite)));
}

void ReportFile::WriteReference(const ReferenceLine& l) {
  WriteLine(absl::StrFormat(
      "{\"rank\":-1,\"step\":%d,%s,\"step_seconds\":%.6f%s", l.step,
      LossFields(l.loss), l.step_seconds, NonFiniteField(l.nonfinite)));
}

}  // namespace hsdp::train
