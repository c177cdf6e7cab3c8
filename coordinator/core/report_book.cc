#include "coordinator/core/report_book.h"

namespace hsdp::coordinator {

void ReportBook::Record(const hsdp::v1::StepReport& report) {
  absl::MutexLock lock(&mu_);
  latest_[report.worker_id()] = report;
}

bool ReportBook::Latest(int64_t worker_id, hsdp::v1::StepReport* report) const {
  absl::MutexLock lock(&mu_);
  auto it = latest_.find(worker_id);
  if (it == latest_.end()) return false;
  *report = it->second;
  return true;
}

}  // namespace hsdp::coordinator
