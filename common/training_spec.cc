#include "common/training_spec.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/message.h>
#include <google/protobuf/text_format.h>
#include <google/protobuf/util/field_comparator.h>
#include <google/protobuf/util/message_differencer.h>

#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"

namespace hsdp {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;
using google::protobuf::util::MessageDifferencer;

// The value of one field of `m` as a short string ("(unset)" when absent).
std::string FieldValue(const Message& m, const FieldDescriptor* field) {
  if (field->is_repeated()) {
    std::string text;
    google::protobuf::TextFormat::PrintFieldValueToString(m, field, -1, &text);
    return text;
  }
  const Reflection* r = m.GetReflection();
  if (!r->HasField(m, field) &&
      field->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
    return "(unset)";
  }
  std::string text;
  google::protobuf::TextFormat::PrintFieldValueToString(m, field, -1, &text);
  return text.empty() ? "\"\"" : text;
}

// Records the first difference as "path: got, want".
class FirstDifference : public MessageDifferencer::Reporter {
 public:
  // A proto3 scalar at its default counts as absent; Value() prints the
  // default for it.
  void ReportAdded(
      const Message& got, const Message& want,
      const std::vector<MessageDifferencer::SpecificField>& path) override {
    Record(path, Value(got, path), Value(want, path));
  }
  void ReportDeleted(
      const Message& got, const Message& want,
      const std::vector<MessageDifferencer::SpecificField>& path) override {
    Record(path, Value(got, path), Value(want, path));
  }
  void ReportModified(
      const Message& got, const Message& want,
      const std::vector<MessageDifferencer::SpecificField>& path) override {
    Record(path, Value(got, path), Value(want, path));
  }

  bool found() const { return found_; }
  const std::string& path() const { return path_; }
  const std::string& got() const { return got_; }
  const std::string& want() const { return want_; }

 private:
  // The value of the last field of `path` in `parent`, the message that holds
  // it (what the differencer passes to a reporter).
  static std::string Value(
      const Message& parent,
      const std::vector<MessageDifferencer::SpecificField>& path) {
    const FieldDescriptor* last = path.back().field;
    if (last == nullptr || last->containing_type() != parent.GetDescriptor())
      return "?";
    if (last->is_map()) return "(map entry)";
    return FieldValue(parent, last);
  }

  void Record(const std::vector<MessageDifferencer::SpecificField>& path,
              std::string got, std::string want) {
    if (found_ || path.empty()) return;
    std::vector<std::string> names;
    for (const auto& f : path) {
      if (f.field != nullptr) names.push_back(f.field->name());
    }
    path_ = absl::StrJoin(names, ".");
    if (path.back().field != nullptr && path.back().field->is_map()) {
      path_ = path.front().field->name();
    }
    got_ = std::move(got);
    want_ = std::move(want);
    found_ = true;
  }

  bool found_ = false;
  std::string path_, got_, want_;
};

}  // namespace

absl::Status CompareTrainingSpecs(const hsdp::v1::TrainingSpec& got,
                                  const hsdp::v1::TrainingSpec& want) {
  return CompareTrainingSpecs(got, want, "this worker", "the job");
}

absl::Status CompareTrainingSpecs(const hsdp::v1::TrainingSpec& got,
                                  const hsdp::v1::TrainingSpec& want,
                                  const std::string& got_label,
                                  const std::string& want_label) {
  MessageDifferencer differencer;
  FirstDifference first;
  differencer.ReportDifferencesTo(&first);
  if (differencer.Compare(got, want)) return absl::OkStatus();
  if (!first.found()) {
    return absl::FailedPreconditionError(
        "training settings differ from the job's");
  }
  if (absl::StartsWith(first.path(), "task_options")) {
    // Name the first key (in order) whose value differs or is on one side.
    const auto& a = got.task_options();
    const auto& b = want.task_options();
    std::set<std::string> keys;
    for (const auto& [k, v] : a) keys.insert(k);
    for (const auto& [k, v] : b) keys.insert(k);
    for (const std::string& k : keys) {
      auto x = a.find(k);
      auto y = b.find(k);
      const std::string vx = x == a.end() ? "(unset)" : x->second;
      const std::string vy = y == b.end() ? "(unset)" : y->second;
      if (vx == vy) continue;
      return absl::FailedPreconditionError(absl::StrCat(
          "training setting task_options.", k, " differs: ", got_label, " has ",
          vx, ", ", want_label, " has ", vy));
    }
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "training setting ", first.path(), " differs: ", got_label, " has ",
      first.got(), ", ", want_label, " has ", first.want()));
}

std::string DescribeTrainingSpec(const hsdp::v1::TrainingSpec& spec) {
  std::string text;
  google::protobuf::TextFormat::Printer printer;
  printer.SetSingleLineMode(false);
  printer.PrintToString(spec, &text);
  return text;
}

}  // namespace hsdp
