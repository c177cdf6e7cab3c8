#include "hsdp/task_options.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace hsdp::train {
namespace {

const char* TypeName(TaskOptionType type) {
  switch (type) {
    case TaskOptionType::kInt:
      return "INT";
    case TaskOptionType::kDouble:
      return "NUMBER";
    case TaskOptionType::kBool:
      return "true|false";
    case TaskOptionType::kString:
      return "TEXT";
  }
  return "TEXT";
}

// Shortest text that reads back as `v`.
std::string DoubleText(double v) {
  for (int precision = 6; precision < 17; ++precision) {
    std::string text = absl::StrFormat("%.*g", precision, v);
    double back = 0;
    if (absl::SimpleAtod(text, &back) && back == v) return text;
  }
  return absl::StrFormat("%.17g", v);
}

bool Bounded(const TaskOptionInfo& o) {
  return std::isfinite(o.min) || std::isfinite(o.max);
}

std::string RangeText(const TaskOptionInfo& o) {
  const auto bound = [&](double b) {
    return o.type == TaskOptionType::kInt
               ? absl::StrCat(static_cast<int64_t>(b))
               : DoubleText(b);
  };
  if (std::isfinite(o.min) && std::isfinite(o.max)) {
    return absl::StrCat(" in [", bound(o.min), ", ", bound(o.max), "]");
  }
  if (std::isfinite(o.min)) return absl::StrCat(" >= ", bound(o.min));
  if (std::isfinite(o.max)) return absl::StrCat(" <= ", bound(o.max));
  return "";
}

// `text` as option `o`'s type, canonical; nullopt when it is not one.
std::optional<std::string> Canonical(const TaskOptionInfo& o,
                                     const std::string& text) {
  switch (o.type) {
    case TaskOptionType::kInt: {
      int64_t v = 0;
      if (!absl::SimpleAtoi(text, &v) || v < o.min || v > o.max) {
        return std::nullopt;
      }
      return absl::StrCat(v);
    }
    case TaskOptionType::kDouble: {
      double v = 0;
      if (!absl::SimpleAtod(text, &v) || !std::isfinite(v) || v < o.min ||
          v > o.max) {
        return std::nullopt;
      }
      return DoubleText(v);
    }
    case TaskOptionType::kBool: {
      bool v = false;
      if (!absl::SimpleAtob(text, &v)) return std::nullopt;
      return v ? "true" : "false";
    }
    case TaskOptionType::kString:
      return text;
  }
  return std::nullopt;
}

std::string Want(const TaskOptionInfo& o) {
  switch (o.type) {
    case TaskOptionType::kInt:
      return absl::StrCat("want an integer", RangeText(o));
    case TaskOptionType::kDouble:
      return absl::StrCat("want a finite number", RangeText(o));
    case TaskOptionType::kBool:
      return "want true or false";
    case TaskOptionType::kString:
      return "want text";
  }
  return "";
}

}  // namespace

TaskOptionSpec& TaskOptionSpec::Add(TaskOptionInfo option) {
  if (std::none_of(
          options_.begin(), options_.end(),
          [&](const TaskOptionInfo& o) { return o.name == option.name; })) {
    options_.push_back(std::move(option));
  }
  return *this;
}

TaskOptionSpec& TaskOptionSpec::Int(const std::string& name,
                                    int64_t default_value,
                                    const std::string& help, int64_t min,
                                    int64_t max) {
  TaskOptionInfo o{name, TaskOptionType::kInt, absl::StrCat(default_value),
                   help};
  // The limits of int64_t stand for "no bound".
  if (min != std::numeric_limits<int64_t>::min()) {
    o.min = static_cast<double>(min);
  }
  if (max != std::numeric_limits<int64_t>::max()) {
    o.max = static_cast<double>(max);
  }
  return Add(std::move(o));
}

TaskOptionSpec& TaskOptionSpec::Double(const std::string& name,
                                       double default_value,
                                       const std::string& help, double min,
                                       double max) {
  return Add(TaskOptionInfo{name, TaskOptionType::kDouble,
                            DoubleText(default_value), help, min, max});
}

TaskOptionSpec& TaskOptionSpec::Bool(const std::string& name,
                                     bool default_value,
                                     const std::string& help) {
  return Add(TaskOptionInfo{name, TaskOptionType::kBool,
                            default_value ? "true" : "false", help});
}

TaskOptionSpec& TaskOptionSpec::String(const std::string& name,
                                       const std::string& default_value,
                                       const std::string& help) {
  return Add(
      TaskOptionInfo{name, TaskOptionType::kString, default_value, help});
}

absl::StatusOr<TaskOptionValues> TaskOptionSpec::Parse(
    const std::map<std::string, std::string>& given) const {
  TaskOptionValues values;
  for (const TaskOptionInfo& o : options_) {
    values.text_[o.name] = o.default_value;
    values.types_[o.name] = o.type;
  }
  for (const auto& [name, text] : given) {
    auto it = std::find_if(
        options_.begin(), options_.end(),
        [&name = name](const TaskOptionInfo& o) { return o.name == name; });
    if (it == options_.end()) {
      std::vector<std::string> names;
      for (const TaskOptionInfo& o : options_) names.push_back(o.name);
      return absl::InvalidArgumentError(absl::StrCat(
          "--task-option ", name, ": not an option of this task (",
          names.empty() ? "it has none"
                        : absl::StrCat("it has ", absl::StrJoin(names, ", ")),
          ")"));
    }
    std::optional<std::string> canonical = Canonical(*it, text);
    if (!canonical.has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--task-option ", name, "=", text, ": ", Want(*it)));
    }
    values.text_[name] = *std::move(canonical);
  }
  return values;
}

std::string TaskOptionSpec::Help() const {
  std::string text;
  for (const TaskOptionInfo& o : options_) {
    absl::StrAppend(&text, "  ", o.name, "=", TypeName(o.type),
                    Bounded(o) ? RangeText(o) : "", " (default ",
                    o.default_value.empty() ? "\"\"" : o.default_value,
                    "): ", o.help, "\n");
  }
  return text;
}

int64_t TaskOptionValues::GetInt(absl::string_view name) const {
  auto type = types_.find(std::string(name));
  int64_t v = 0;
  if (type == types_.end() || type->second != TaskOptionType::kInt ||
      !absl::SimpleAtoi(text_.at(std::string(name)), &v)) {
    return 0;
  }
  return v;
}

double TaskOptionValues::GetDouble(absl::string_view name) const {
  auto type = types_.find(std::string(name));
  double v = 0;
  if (type == types_.end() || type->second != TaskOptionType::kDouble ||
      !absl::SimpleAtod(text_.at(std::string(name)), &v)) {
    return 0;
  }
  return v;
}

bool TaskOptionValues::GetBool(absl::string_view name) const {
  auto type = types_.find(std::string(name));
  return type != types_.end() && type->second == TaskOptionType::kBool &&
         text_.at(std::string(name)) == "true";
}

std::string TaskOptionValues::GetString(absl::string_view name) const {
  auto type = types_.find(std::string(name));
  if (type == types_.end() || type->second != TaskOptionType::kString) {
    return "";
  }
  return text_.at(std::string(name));
}

bool TaskOptionValues::Has(absl::string_view name) const {
  return types_.count(std::string(name)) > 0;
}

}  // namespace hsdp::train
