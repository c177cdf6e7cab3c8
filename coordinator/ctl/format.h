// Plain-text output of hsdpctl: aligned tables and short forms of enums,
// steps, sizes and numbers.
#ifndef HSDP_COORDINATOR_CTL_FORMAT_H_
#define HSDP_COORDINATOR_CTL_FORMAT_H_

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

namespace hsdp::ctl {

// Strips an enum value's type prefix for tables: JOB_STATE_RUNNING -> RUNNING.
std::string ShortEnum(const std::string& name, const std::string& prefix);

// "none" for a negative step.
std::string StepOrNone(int64_t step);

// "12.3MiB"; "-" for none.
std::string FormatBytes(int64_t bytes);

std::string FormatDouble(double value, int precision);

// Left-aligned columns separated by two spaces; a header row and one row per
// entry. Thread-compatible.
class Table {
 public:
  explicit Table(std::vector<std::string> header);
  void Add(std::vector<std::string> row);
  void Print(std::ostream& out) const;

 private:
  std::vector<std::vector<std::string>> rows_;
};

}  // namespace hsdp::ctl

#endif  // HSDP_COORDINATOR_CTL_FORMAT_H_
