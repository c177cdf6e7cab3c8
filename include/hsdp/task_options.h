// Typed settings of a user's task (--task-option NAME=VALUE), declared with
// their types, defaults and help, so that the worker binary's --help lists
// them and a misspelt or mistyped one is refused by name.
//
//   TaskOptionSpec Options() {
//     TaskOptionSpec spec;
//     spec.Int("channels", 8, "width of every block", 1, 4096)
//         .Bool("bias", false, "linear layers with bias");
//     return spec;
//   }
//   ...
//   absl::StatusOr<TaskOptionValues> v = Options().Parse(args.options);
//   if (!v.ok()) return v.status();  // "--task-option chanels: ..."
//   const int64_t channels = v->GetInt("channels");
//
// WorkerMain (worker_main.h) does the parsing for a task registered with a
// TaskDefinition. Thread-compatible.
#ifndef HSDP_TASK_OPTIONS_H_
#define HSDP_TASK_OPTIONS_H_

#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "hsdp/task.h"

namespace hsdp::train {

enum class TaskOptionType { kInt, kDouble, kBool, kString };

// One declared option.
struct TaskOptionInfo {
  std::string name;
  TaskOptionType type = TaskOptionType::kString;
  // Canonical text of the default ("8", "0.5", "true", "tiny").
  std::string default_value;
  std::string help;
  // kInt and kDouble: the accepted range, inclusive.
  double min = -std::numeric_limits<double>::infinity();
  double max = std::numeric_limits<double>::infinity();
};

class TaskOptionValues;

// The options a task declares, in declaration order. Each adder returns
// *this for chaining; declaring a name twice keeps the first declaration.
class TaskOptionSpec {
 public:
  TaskOptionSpec& Int(const std::string& name, int64_t default_value,
                      const std::string& help,
                      int64_t min = std::numeric_limits<int64_t>::min(),
                      int64_t max = std::numeric_limits<int64_t>::max());
  TaskOptionSpec& Double(const std::string& name, double default_value,
                         const std::string& help,
                         double min = -std::numeric_limits<double>::infinity(),
                         double max = std::numeric_limits<double>::infinity());
  TaskOptionSpec& Bool(const std::string& name, bool default_value,
                       const std::string& help);
  TaskOptionSpec& String(const std::string& name,
                         const std::string& default_value,
                         const std::string& help);

  const std::vector<TaskOptionInfo>& options() const { return options_; }

  // The values of `given` (--task-option NAME=VALUE), every declared option
  // with its default where not given. INVALID_ARGUMENT naming the option for
  // an undeclared name ("--task-option depth: not an option of this task (it
  // has channels, blocks)") or a value not of its type or out of its range
  // ("--task-option channels=eight: want an integer in [1, 4096]").
  absl::StatusOr<TaskOptionValues> Parse(
      const std::map<std::string, std::string>& given) const;

  // One line per option: "  channels=INT (default 8): width of every block".
  std::string Help() const;

 private:
  TaskOptionSpec& Add(TaskOptionInfo option);

  std::vector<TaskOptionInfo> options_;
};

// Parsed options: every declared one, in canonical text (so ranks that spell
// a value differently report the same settings).
class TaskOptionValues {
 public:
  // The value of a declared option of that type; an undeclared name or
  // another type gives 0, false or "" (a programming error the task's tests
  // catch: Has() says whether the name is declared).
  int64_t GetInt(absl::string_view name) const;
  double GetDouble(absl::string_view name) const;
  bool GetBool(absl::string_view name) const;
  std::string GetString(absl::string_view name) const;
  bool Has(absl::string_view name) const;

  // NAME -> canonical value, for TaskArgs::options (reported to the
  // coordinator with the job's settings).
  const std::map<std::string, std::string>& AsMap() const { return text_; }

 private:
  friend class TaskOptionSpec;
  std::map<std::string, std::string> text_;
  std::map<std::string, TaskOptionType> types_;
};

// A user's task as WorkerMain runs it with typed options: its --help shows
// `description` and `options` next to the runner's own flags, and none of the
// built-in GPT's (--model, --dims, --vocab-size, --data, --units).
struct TaskDefinition {
  // The task's name in --help ("resnet").
  std::string name;
  // One paragraph for --help.
  std::string description;
  TaskOptionSpec options;
  // Builds the task from parsed options; INVALID_ARGUMENT for combinations
  // the types cannot express (e.g. "--task-option groups=4: must divide
  // channels=6").
  std::function<absl::StatusOr<std::unique_ptr<Task>>(const TaskOptionValues&)>
      make;
};

}  // namespace hsdp::train

#endif  // HSDP_TASK_OPTIONS_H_
