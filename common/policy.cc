#include "common/policy.h"

#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/file_util.h"
#include "common/status_util.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/message.h"
#include "google/protobuf/text_format.h"
#include "google/protobuf/util/json_util.h"

namespace hsdp {
namespace {

using hsdp::v1::AllReduceMode;
using hsdp::v1::GradSyncMode;
using hsdp::v1::Policy;

// How many unit names an "override matches no unit" error lists before eliding.
constexpr size_t kUnitNamesInError = 8;

// Collects the first text-format error as "line L:C: message" (1-based).
class FirstErrorCollector : public google::protobuf::io::ErrorCollector {
 public:
  void AddError(int line, google::protobuf::io::ColumnNumber column,
                const std::string& message) override {
    if (first_.empty()) {
      first_ = absl::StrCat("line ", line + 1, ":", column + 1, ": ", message);
    }
  }
  const std::string& first() const { return first_; }

 private:
  std::string first_;
};

absl::Status FieldError(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("policy.", field, ": ", what));
}

absl::Status CheckRange(absl::string_view field, int64_t value, int64_t max) {
  if (value < 0) return FieldError(field, absl::StrCat(value, " is negative"));
  if (value > max) {
    return FieldError(field, absl::StrCat(value, " exceeds the maximum ", max));
  }
  return absl::OkStatus();
}

std::string UnitNamesForError(const UnitList& units) {
  std::vector<std::string> names;
  for (size_t i = 0; i < units.size() && i < kUnitNamesInError; ++i) {
    names.push_back(units[i].name());
  }
  std::string joined = absl::StrJoin(names, ", ");
  if (units.size() > kUnitNamesInError) {
    absl::StrAppend(&joined, ", ... (", units.size(), " units)");
  }
  return joined;
}

std::string BoolText(bool b) { return b ? "true" : "false"; }

// True when `s` is well-formed UTF-8 (RFC 3629: no overlong forms, no
// surrogates, nothing past U+10FFFF).
bool IsValidUtf8(absl::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    size_t extra;
    unsigned char lo = 0x80, hi = 0xBF;  // bounds of the second byte
    if (c < 0x80) {
      ++i;
      continue;
    } else if (c >= 0xC2 && c <= 0xDF) {
      extra = 1;
    } else if (c >= 0xE0 && c <= 0xEF) {
      extra = 2;
      if (c == 0xE0) lo = 0xA0;  // overlong
      if (c == 0xED) hi = 0x9F;  // surrogates
    } else if (c >= 0xF0 && c <= 0xF4) {
      extra = 3;
      if (c == 0xF0) lo = 0x90;  // overlong
      if (c == 0xF4) hi = 0x8F;  // past U+10FFFF
    } else {
      return false;
    }
    if (s.size() - i <= extra) return false;
    for (size_t k = 1; k <= extra; ++k) {
      const unsigned char b = static_cast<unsigned char>(s[i + k]);
      if (k == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF)) return false;
    }
    i += extra + 1;
  }
  return true;
}

// The text format parser takes any bytes in a string field ("\377" escapes);
// proto3 strings must be UTF-8, and the JSON printer would not write them
// back as they were. The first field holding invalid UTF-8, by path
// ("overrides[0].unit_glob"), is refused.
absl::Status CheckUtf8(const google::protobuf::Message& message,
                       const std::string& path) {
  const google::protobuf::Reflection* reflection = message.GetReflection();
  std::vector<const google::protobuf::FieldDescriptor*> fields;
  reflection->ListFields(message, &fields);
  for (const google::protobuf::FieldDescriptor* field : fields) {
    const std::string name = absl::StrCat(path, field->name());
    const int count =
        field->is_repeated() ? reflection->FieldSize(message, field) : 1;
    for (int i = 0; i < count; ++i) {
      const std::string at =
          field->is_repeated() ? absl::StrCat(name, "[", i, "]") : name;
      if (field->type() == google::protobuf::FieldDescriptor::TYPE_STRING) {
        const std::string value =
            field->is_repeated()
                ? reflection->GetRepeatedString(message, field, i)
                : reflection->GetString(message, field);
        if (!IsValidUtf8(value)) return FieldError(at, "is not valid UTF-8");
      } else if (field->cpp_type() ==
                 google::protobuf::FieldDescriptor::CPPTYPE_MESSAGE) {
        const google::protobuf::Message& sub =
            field->is_repeated()
                ? reflection->GetRepeatedMessage(message, field, i)
                : reflection->GetMessage(message, field);
        if (absl::Status s = CheckUtf8(sub, absl::StrCat(at, ".")); !s.ok()) {
          return s;
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Policy> ParsePolicy(absl::string_view text) {
  Policy policy;
  const absl::string_view trimmed = absl::StripAsciiWhitespace(text);
  if (!trimmed.empty() && trimmed.front() == '{') {
    google::protobuf::util::JsonParseOptions options;
    options.ignore_unknown_fields = false;
    const auto status = google::protobuf::util::JsonStringToMessage(
        std::string(trimmed), &policy, options);
    if (!status.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("policy JSON: ", std::string(status.message())));
    }
    return policy;
  }
  google::protobuf::TextFormat::Parser parser;
  FirstErrorCollector errors;
  parser.RecordErrorsTo(&errors);
  if (!parser.ParseFromString(std::string(text), &policy)) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy text format: ",
                     errors.first().empty() ? "parse error" : errors.first()));
  }
  if (absl::Status s = CheckUtf8(policy, ""); !s.ok()) return s;
  return policy;
}

absl::StatusOr<Policy> ReadPolicyFile(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFile(path);
  if (!text.ok()) return AnnotateStatus(text.status(), "policy file");
  absl::StatusOr<Policy> policy = ParsePolicy(*text);
  if (!policy.ok()) {
    return absl::Status(policy.status().code(),
                        absl::StrCat(path, ": ", policy.status().message()));
  }
  return policy;
}

absl::Status ValidatePolicy(const Policy& policy, const UnitList& units) {
  if (policy.has_forward_prefetch_depth()) {
    absl::Status s =
        CheckRange("forward_prefetch_depth", policy.forward_prefetch_depth(),
                   kMaxPrefetchDepth);
    if (!s.ok()) return s;
  }
  if (policy.has_backward_prefetch_depth()) {
    absl::Status s =
        CheckRange("backward_prefetch_depth", policy.backward_prefetch_depth(),
                   kMaxPrefetchDepth);
    if (!s.ok()) return s;
  }
  if (absl::Status s =
          CheckRange("microbatches", policy.microbatches(), kMaxMicrobatches);
      !s.ok()) {
    return s;
  }
  if (!hsdp::v1::GradSyncMode_IsValid(policy.grad_sync())) {
    return FieldError("grad_sync",
                      absl::StrCat("unknown value ", policy.grad_sync()));
  }
  if (!hsdp::v1::AllReduceMode_IsValid(policy.all_reduce())) {
    return FieldError("all_reduce",
                      absl::StrCat("unknown value ", policy.all_reduce()));
  }
  if (!hsdp::v1::BatchMode_IsValid(policy.batch_mode())) {
    return FieldError("batch_mode",
                      absl::StrCat("unknown value ", policy.batch_mode()));
  }
  if (policy.checkpoint_interval() < 0) {
    return FieldError(
        "checkpoint_interval",
        absl::StrCat(policy.checkpoint_interval(), " is negative"));
  }
  if (policy.memory_budget_bytes() < 0) {
    return FieldError(
        "memory_budget_bytes",
        absl::StrCat(policy.memory_budget_bytes(), " is negative"));
  }
  if (policy.comm_fusion_bucket_bytes() < 0) {
    return FieldError(
        "comm_fusion_bucket_bytes",
        absl::StrCat(policy.comm_fusion_bucket_bytes(), " is negative"));
  }
  for (int i = 0; i < policy.overrides_size(); ++i) {
    const auto& o = policy.overrides(i);
    const std::string field = absl::StrCat("overrides[", i, "]");
    if (o.unit_glob().empty()) {
      return FieldError(absl::StrCat(field, ".unit_glob"), "is empty");
    }
    if (!o.has_reshard_after_forward() && !o.has_reshard_after_backward()) {
      return FieldError(
          field, absl::StrCat("override \"", o.unit_glob(),
                              "\" sets neither reshard_after_forward nor "
                              "reshard_after_backward"));
    }
    if (units.empty()) continue;
    bool matched = false;
    for (const auto& unit : units) {
      if (GlobMatch(o.unit_glob(), unit.name())) {
        matched = true;
        break;
      }
    }
    if (!matched) {
      return FieldError(
          absl::StrCat(field, ".unit_glob"),
          absl::StrCat("\"", o.unit_glob(), "\" matches no unit (units: ",
                       UnitNamesForError(units), ")"));
    }
  }
  return absl::OkStatus();
}

Policy ResolvePolicyDefaults(const Policy& policy) {
  Policy resolved = policy;
  if (!resolved.has_reshard_after_forward())
    resolved.set_reshard_after_forward(true);
  if (!resolved.has_reshard_after_backward())
    resolved.set_reshard_after_backward(true);
  if (!resolved.has_forward_prefetch_depth()) {
    resolved.set_forward_prefetch_depth(kDefaultPrefetchDepth);
  }
  if (!resolved.has_backward_prefetch_depth()) {
    resolved.set_backward_prefetch_depth(kDefaultPrefetchDepth);
  }
  if (resolved.microbatches() == 0) resolved.set_microbatches(1);
  if (resolved.grad_sync() == hsdp::v1::GRAD_SYNC_MODE_UNSPECIFIED) {
    resolved.set_grad_sync(hsdp::v1::GRAD_SYNC_MODE_LAST_MICROBATCH);
  }
  if (resolved.all_reduce() == hsdp::v1::ALL_REDUCE_MODE_UNSPECIFIED) {
    resolved.set_all_reduce(hsdp::v1::ALL_REDUCE_MODE_LAST_MICROBATCH);
  }
  if (resolved.batch_mode() == hsdp::v1::BATCH_MODE_UNSPECIFIED) {
    resolved.set_batch_mode(hsdp::v1::BATCH_MODE_FIXED);
  }
  return resolved;
}

UnitReshard ResolveUnitReshard(const Policy& policy,
                               absl::string_view unit_name) {
  UnitReshard r;
  r.after_forward = policy.has_reshard_after_forward()
                        ? policy.reshard_after_forward()
                        : true;
  r.after_backward = policy.has_reshard_after_backward()
                         ? policy.reshard_after_backward()
                         : true;
  for (const auto& o : policy.overrides()) {
    if (!GlobMatch(o.unit_glob(), unit_name)) continue;
    if (o.has_reshard_after_forward()) {
      r.after_forward = o.reshard_after_forward();
      r.forward_pinned = true;
    }
    if (o.has_reshard_after_backward())
      r.after_backward = o.reshard_after_backward();
  }
  return r;
}

bool GlobMatch(absl::string_view pattern, absl::string_view name) {
  // Iterative matcher: on a mismatch after a '*', retry with the star absorbing
  // one more character. Linear in practice, O(|p|*|n|) worst case.
  size_t p = 0, n = 0;
  size_t star = absl::string_view::npos, star_n = 0;
  while (n < name.size()) {
    if (p < pattern.size() && (pattern[p] == '?' || pattern[p] == name[n])) {
      ++p;
      ++n;
    } else if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      star_n = n;
    } else if (star != absl::string_view::npos) {
      p = star + 1;
      n = ++star_n;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

std::string PolicyToText(const Policy& policy) {
  std::string out;
  google::protobuf::TextFormat::PrintToString(policy, &out);
  return out;
}

std::string PolicyToJson(const Policy& policy) {
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.preserve_proto_field_names = true;
  std::string out;
  (void)google::protobuf::util::MessageToJsonString(policy, &out, options);
  return out;
}

std::string DescribePolicy(const Policy& policy) {
  const Policy r = ResolvePolicyDefaults(policy);
  auto mark = [](bool is_default) { return is_default ? " (default)" : ""; };
  std::string out;
  absl::StrAppend(
      &out, "reshard_after_forward:   ", BoolText(r.reshard_after_forward()),
      mark(!policy.has_reshard_after_forward()), "\n");
  absl::StrAppend(
      &out, "reshard_after_backward:  ", BoolText(r.reshard_after_backward()),
      mark(!policy.has_reshard_after_backward()), "\n");
  absl::StrAppend(&out, "forward_prefetch_depth:  ", r.forward_prefetch_depth(),
                  mark(!policy.has_forward_prefetch_depth()), "\n");
  absl::StrAppend(&out,
                  "backward_prefetch_depth: ", r.backward_prefetch_depth(),
                  mark(!policy.has_backward_prefetch_depth()), "\n");
  absl::StrAppend(&out, "microbatches:            ", r.microbatches(),
                  mark(policy.microbatches() == 0), "\n");
  absl::StrAppend(
      &out, "grad_sync:               ", GradSyncMode_Name(r.grad_sync()),
      mark(policy.grad_sync() == hsdp::v1::GRAD_SYNC_MODE_UNSPECIFIED), "\n");
  absl::StrAppend(
      &out, "all_reduce:              ", AllReduceMode_Name(r.all_reduce()),
      mark(policy.all_reduce() == hsdp::v1::ALL_REDUCE_MODE_UNSPECIFIED), "\n");
  absl::StrAppend(
      &out, "batch_mode:              ", BatchMode_Name(r.batch_mode()),
      mark(policy.batch_mode() == hsdp::v1::BATCH_MODE_UNSPECIFIED), "\n");
  absl::StrAppend(&out, "checkpoint_interval:     ",
                  r.checkpoint_interval() == 0
                      ? std::string("never")
                      : absl::StrCat(r.checkpoint_interval()),
                  mark(policy.checkpoint_interval() == 0), "\n");
  absl::StrAppend(&out, "memory_budget_bytes:     ",
                  r.memory_budget_bytes() == 0
                      ? std::string("off (manual mode)")
                      : absl::StrCat(r.memory_budget_bytes()),
                  "\n");
  absl::StrAppend(&out, "comm_fusion_bucket_bytes: ",
                  r.comm_fusion_bucket_bytes() == 0
                      ? std::string("off")
                      : absl::StrCat(r.comm_fusion_bucket_bytes()),
                  mark(r.comm_fusion_bucket_bytes() == 0), "\n");
  absl::StrAppend(&out, "reshard_after_forward_within_host: ",
                  BoolText(r.reshard_after_forward_within_host()),
                  mark(!r.reshard_after_forward_within_host()), "\n");
  for (const auto& o : r.overrides()) {
    std::vector<std::string> flags;
    if (o.has_reshard_after_forward()) {
      flags.push_back(absl::StrCat("reshard_after_forward=",
                                   BoolText(o.reshard_after_forward())));
    }
    if (o.has_reshard_after_backward()) {
      flags.push_back(absl::StrCat("reshard_after_backward=",
                                   BoolText(o.reshard_after_backward())));
    }
    absl::StrAppend(&out, "override ", o.unit_glob(), ": ",
                    absl::StrJoin(flags, " "), "\n");
  }
  return out;
}

}  // namespace hsdp
