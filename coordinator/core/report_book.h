// The latest StepReport of every worker, for ListWorkers and the dashboard.
#ifndef HSDP_COORDINATOR_CORE_REPORT_BOOK_H_
#define HSDP_COORDINATOR_CORE_REPORT_BOOK_H_

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "hsdp/v1/coordinator_service.pb.h"

namespace hsdp::coordinator {

// By worker id. Thread-safe.
class ReportBook {
 public:
  ReportBook() = default;
  ReportBook(const ReportBook&) = delete;
  ReportBook& operator=(const ReportBook&) = delete;

  void Record(hsdp::v1::StepReport report) ABSL_LOCKS_EXCLUDED(mu_);
  // False when the worker never reported.
  bool Latest(int64_t worker_id, hsdp::v1::StepReport* report) const
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable absl::Mutex mu_;
  absl::flat_hash_map<int64_t, hsdp::v1::StepReport> latest_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace hsdp::coordinator

#endif  // HSDP_COORDINATOR_CORE_REPORT_BOOK_H_
