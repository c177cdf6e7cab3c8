#include "worker/train/report_compare.h"

#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_util.h"
#include "common/training_spec.h"

namespace hsdp::train {
namespace {

using Json = nlohmann::json;

constexpr char kRunLabel[] = "the run";
constexpr char kReferenceLabel[] = "the reference";
// The rank of reference lines.
constexpr int kReferenceRank = -1;

// An integer member of `object`, or nullopt when absent or not an integer.
std::optional<int64_t> IntField(const Json& object, const char* key) {
  auto it = object.find(key);
  if (it == object.end() || !it->is_number_integer()) return std::nullopt;
  return it->get<int64_t>();
}

absl::Status SameValue(const char* field, int64_t run, int64_t reference) {
  if (run == reference) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat(field, " differs: ", kRunLabel, " has ", run, ", ",
                   kReferenceLabel, " has ", reference));
}

// The training settings that decide the numbers: the rest cleared.
hsdp::v1::TrainingSpec Deciding(const hsdp::v1::TrainingSpec& spec,
                                bool steps_matter) {
  hsdp::v1::TrainingSpec out = spec;
  out.clear_cpu_offload();
  out.clear_recompute_units();
  out.clear_on_nonfinite();
  if (!steps_matter) out.clear_steps();
  return out;
}

std::string StepLabel(int64_t step) {
  return step < 0 ? "none" : absl::StrCat(step);
}

}  // namespace

absl::StatusOr<RunSettings> ParseSettingsJson(absl::string_view json) {
  const Json object = Json::parse(json.begin(), json.end(), nullptr,
                                  /*allow_exceptions=*/false);
  if (object.is_discarded() || !object.is_object()) {
    return absl::InvalidArgumentError("settings: not a JSON object");
  }
  RunSettings s;
  const std::optional<int64_t> world = IntField(object, "world_size");
  const std::optional<int64_t> micro = IntField(object, "microbatches");
  const std::optional<int64_t> global = IntField(object, "global_batch");
  if (!world || !micro || !global) {
    return absl::InvalidArgumentError(
        "settings: world_size, microbatches and global_batch must be "
        "integers");
  }
  s.world_size = static_cast<int>(*world);
  s.microbatches = static_cast<int>(*micro);
  s.global_batch = *global;
  auto training = object.find("training");
  if (training == object.end() || !training->is_object()) {
    return absl::InvalidArgumentError("settings: no training object");
  }
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = true;  // written by a newer hsdp
  const auto parsed = google::protobuf::util::JsonStringToMessage(
      training->dump(), &s.training, options);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("settings.training: ", parsed.ToString()));
  }
  return s;
}

absl::Status CompareRunSettings(const RunSettings& run,
                                const RunSettings& reference) {
  if (absl::Status s =
          SameValue("world_size", run.world_size, reference.world_size);
      !s.ok()) {
    return s;
  }
  if (absl::Status s =
          SameValue("microbatches", run.microbatches, reference.microbatches);
      !s.ok()) {
    return s;
  }
  if (absl::Status s =
          SameValue("global_batch", run.global_batch, reference.global_batch);
      !s.ok()) {
    return s;
  }
  const bool steps_matter = run.training.lr_schedule().cosine() ||
                            reference.training.lr_schedule().cosine();
  return CompareTrainingSpecs(Deciding(run.training, steps_matter),
                              Deciding(reference.training, steps_matter),
                              kRunLabel, kReferenceLabel);
}

absl::Status ReadReportFile(const std::string& path, ReportContents& contents) {
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("cannot read '", path, "'"));
  }
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    if (line.empty()) continue;
    auto bad = [&](const std::string& why) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ":", number, ": ", why));
    };
    const Json object = Json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (object.is_discarded() || !object.is_object()) {
      return bad("not a JSON object");
    }
    const std::optional<int64_t> rank = IntField(object, "rank");
    const std::optional<int64_t> step = IntField(object, "step");
    if (!rank || !step) return bad("no integer \"rank\" and \"step\"");
    ReportedStep reported;
    reported.rank = static_cast<int>(*rank);
    reported.step = *step;
    auto loss = object.find("loss");
    if (loss == object.end() || !(loss->is_number() || loss->is_null())) {
      return bad("\"loss\" is not a number or null");
    }
    if (loss->is_number()) reported.loss = loss->get<double>();
    auto hex = object.find("loss_hex");
    if (hex != object.end() && hex->is_string()) {
      reported.loss_hex = hex->get<std::string>();
      // The exact value: "loss" has 9 significant digits.
      char* end = nullptr;
      const double exact = std::strtod(reported.loss_hex.c_str(), &end);
      if (reported.loss.has_value() && end != reported.loss_hex.c_str() &&
          *end == '\0' && std::isfinite(exact)) {
        reported.loss = exact;
      }
    }
    auto settings = object.find("settings");
    if (settings != object.end()) {
      absl::StatusOr<RunSettings> parsed = ParseSettingsJson(settings->dump());
      if (!parsed.ok()) return bad(std::string(parsed.status().message()));
      contents.settings.push_back(*std::move(parsed));
    }
    contents.steps[reported.rank][reported.step] = std::move(reported);
  }
  return absl::OkStatus();
}

absl::StatusOr<Comparison> CompareReports(const ReportContents& run,
                                          const ReportContents& reference) {
  if (reference.settings.empty()) {
    return absl::FailedPreconditionError(
        "the reference carries no settings (written by an older hsdp?)");
  }
  if (run.settings.empty()) {
    return absl::FailedPreconditionError(
        "the run carries no settings (written by an older hsdp?)");
  }
  if (reference.steps.size() != 1 ||
      reference.steps.begin()->first != kReferenceRank) {
    return absl::FailedPreconditionError(
        "the reference must hold the lines of one --reference run (rank -1)");
  }
  const RunSettings& want = reference.settings.front();
  for (const RunSettings& other : reference.settings) {
    if (absl::Status s = CompareRunSettings(other, want); !s.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the reference holds runs of different settings: ", s.message()));
    }
  }
  for (const RunSettings& got : run.settings) {
    HSDP_RETURN_IF_ERROR(CompareRunSettings(got, want));
  }
  Comparison out;
  out.reference_settings = want;
  const std::map<int64_t, ReportedStep>& ref = reference.steps.begin()->second;
  for (const auto& [rank, steps] : run.steps) {
    RankComparison c;
    c.rank = rank;
    for (const auto& [step, line] : steps) {
      auto it = ref.find(step);
      if (it == ref.end()) {
        ++c.only_in_run;
        continue;
      }
      ++c.steps_compared;
      const ReportedStep& expected = it->second;
      const bool bitwise = line.loss_hex == expected.loss_hex &&
                           line.loss.has_value() == expected.loss.has_value();
      if (!bitwise && c.first_differing_step < 0) {
        c.first_differing_step = step;
      }
      if (step == 0) {
        c.step0_compared = true;
        c.step0_bitwise_equal = bitwise;
      }
      if (line.loss.has_value() != expected.loss.has_value()) {
        ++c.nonfinite_mismatches;
      } else if (line.loss.has_value()) {
        const double diff = std::abs(*line.loss - *expected.loss);
        if (c.max_diff_step < 0 || diff > c.max_abs_diff) {
          c.max_abs_diff = diff;
          c.max_diff_step = step;
        }
      }
    }
    for (const auto& [step, line] : ref) {
      if (steps.count(step) == 0) ++c.only_in_reference;
    }
    out.max_abs_diff = std::max(out.max_abs_diff, c.max_abs_diff);
    out.ranks.push_back(c);
  }
  return out;
}

std::string FormatComparison(const Comparison& comparison) {
  const RunSettings& s = comparison.reference_settings;
  std::string text = absl::StrFormat(
      "settings agree: task %s v%d, world %d x %d microbatches x %d samples "
      "(global batch %d), seed %d\n",
      s.training.task(), s.training.task_version(), s.world_size,
      s.microbatches, s.training.microbatch_size(), s.global_batch,
      s.training.seed());
  bool all_step0 = !comparison.ranks.empty();
  for (const RankComparison& c : comparison.ranks) {
    std::string extra;
    if (c.only_in_run > 0) {
      absl::StrAppend(&extra, ", ", c.only_in_run,
                      " steps not in the reference");
    }
    if (c.only_in_reference > 0) {
      absl::StrAppend(&extra, ", ", c.only_in_reference,
                      " reference steps not in the run");
    }
    if (c.nonfinite_mismatches > 0) {
      absl::StrAppend(&extra, ", ", c.nonfinite_mismatches,
                      " steps non-finite on one side only");
    }
    const char* step0 = !c.step0_compared       ? "not compared"
                        : c.step0_bitwise_equal ? "bitwise equal"
                                                : "differs";
    all_step0 = all_step0 && c.step0_compared && c.step0_bitwise_equal;
    absl::StrAppendFormat(
        &text,
        "rank %d: %d steps, max |dloss| %.3g (step %s), first differing step "
        "%s, step 0 %s%s\n",
        c.rank, c.steps_compared, c.max_abs_diff, StepLabel(c.max_diff_step),
        StepLabel(c.first_differing_step), step0, extra);
  }
  absl::StrAppendFormat(&text, "max |dloss| %.3g over %d ranks; step 0 %s\n",
                        comparison.max_abs_diff, comparison.ranks.size(),
                        all_step0 ? "bitwise equal on every rank"
                                  : "not bitwise equal on every rank");
  return text;
}

}  // namespace hsdp::train
