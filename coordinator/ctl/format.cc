#include "coordinator/ctl/format.h"

#include <algorithm>
#include <sstream>
#include <utility>

namespace hsdp::ctl {

std::string ShortEnum(const std::string& name, const std::string& prefix) {
  return name.rfind(prefix, 0) == 0 ? name.substr(prefix.size()) : name;
}

std::string StepOrNone(int64_t step) {
  return step < 0 ? "none" : std::to_string(step);
}

std::string FormatBytes(int64_t bytes) {
  constexpr double kMiB = 1024.0 * 1024.0;
  if (bytes <= 0) return "-";
  std::ostringstream s;
  s.precision(1);
  s << std::fixed << static_cast<double>(bytes) / kMiB << "MiB";
  return s.str();
}

std::string FormatDouble(double value, int precision) {
  std::ostringstream s;
  s.precision(precision);
  s << std::fixed << value;
  return s.str();
}

Table::Table(std::vector<std::string> header) {
  rows_.push_back(std::move(header));
}

void Table::Add(std::vector<std::string> row) {
  rows_.push_back(std::move(row));
}

void Table::Print(std::ostream& out) const {
  std::vector<size_t> widths;
  for (const auto& row : rows_) {
    widths.resize(std::max(widths.size(), row.size()));
    for (size_t i = 0; i < row.size(); ++i)
      widths[i] = std::max(widths[i], row[i].size());
  }
  for (const auto& row : rows_) {
    std::string line;
    for (size_t i = 0; i < row.size(); ++i) {
      line += row[i];
      if (i + 1 < row.size())
        line += std::string(widths[i] - row[i].size() + 2, ' ');
    }
    out << line << "\n";
  }
}

}  // namespace hsdp::ctl
