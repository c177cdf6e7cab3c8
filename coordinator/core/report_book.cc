#include "coordinator/core/report_book.h"

#include <utility>

namespace hsdp::coordinator {

void ReportBook::Record(hsdp::v1::StepReport report) {
  const int64_t worker_id = report.worker_id();
  absl::MutexLock lock(&mu_);
  latest_[worker_id] = std::move(report);
}

bool ReportBook::Latest(int64_t worker_id, hsdp::v1::StepReport* report) const {
  absl::MutexLock lock(&mu_);
  auto it = latest_.find(worker_id);
  if (it == latest_.end()) return false;
  *report = it->second;
  return true;
}

}  // namespace hsdp::coordinator
