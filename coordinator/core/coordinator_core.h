// The coordinator's core: the components every front end (the worker and
// control gRPC services, the dashboard, /metrics) works on, owned by the
// server. Front ends hold a copy of this struct of pointers; the components
// are thread-safe, so the struct needs no lock of its own. No gRPC here: the
// front ends in coordinator/service/ adapt the core to the wire.
#ifndef HSDP_COORDINATOR_CORE_COORDINATOR_CORE_H_
#define HSDP_COORDINATOR_CORE_COORDINATOR_CORE_H_

#include <string>

namespace hsdp::coordinator {

class KvStore;
class Membership;
class Metrics;
class ReportBook;
class ScheduleLog;
class TraceCollector;

struct CoordinatorCore {
  Membership* membership = nullptr;
  ScheduleLog* schedule_log = nullptr;
  KvStore* kv_store = nullptr;
  Metrics* metrics = nullptr;
  ReportBook* reports = nullptr;
  // Collects the spans of traced steps (hsdpctl trace); null: dropped.
  TraceCollector* traces = nullptr;
  // Where the dashboard is served ("" when it is not), for GetStatus.
  std::string dashboard_url;
};

}  // namespace hsdp::coordinator

#endif  // HSDP_COORDINATOR_CORE_COORDINATOR_CORE_H_
