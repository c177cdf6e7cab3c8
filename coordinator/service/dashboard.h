// The live dashboard on the metrics port: one page (HTML, JS and CSS compiled
// into the binary, so it works with no internet access) and its JSON API.
//
//   GET  /                       the page
//   GET  /api/state?since=STEP   status, workers, policy, units, steps > STEP
//   POST /api/policy             body: a Policy (JSON, or text format), header
//                                `Authorization: Bearer <control token>`
//   GET  /api/trace[?first=A&last=B]
//                                steps A..B of the collected traces (hsdpctl
//                                trace) as Chrome trace JSON, the same file
//                                `hsdpctl trace` writes; without a range the
//                                newest traced steps (at most
//                                kDashboardTraceSteps); 404 when none
//
// Reads are open, like /metrics on the same port. A policy change goes through
// ApplyPolicy, the code path of ControlService.SetPolicy: validated, applied
// from the first unsealed step, answered with the version and that step; a
// missing or wrong token is 401 and changes nothing.
#ifndef HSDP_COORDINATOR_SERVICE_DASHBOARD_H_
#define HSDP_COORDINATOR_SERVICE_DASHBOARD_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "coordinator/core/coordinator_core.h"
#include "coordinator/service/bearer_auth.h"
#include "coordinator/service/http_server.h"

namespace hsdp::coordinator {

// The URL to show for a dashboard bound to `listen` ("HOST:PORT") on `port`:
// `override_url` when set; else http://HOST:PORT/, with this machine's host
// name for a wildcard host (0.0.0.0, ::, empty), which no browser can open.
std::string DashboardUrl(const std::string& listen, int port,
                         const std::string& override_url);

// HTTP status for a canonical code (INVALID_ARGUMENT 400, UNAUTHENTICATED 401,
// PERMISSION_DENIED 403, NOT_FOUND 404, FAILED_PRECONDITION/ABORTED 409,
// UNAVAILABLE 503, others 500).
int HttpStatusFor(absl::StatusCode code);

// Most steps the page's timeline shows when no range is asked for.
inline constexpr int64_t kDashboardTraceSteps = 4;

// Thread-safe: all state lives in the (thread-safe) core components; the token
// is immutable.
class Dashboard {
 public:
  // An empty `control_token` lets anyone change the policy, as it does for
  // ControlService.
  Dashboard(CoordinatorCore core, const std::string& control_token);
  Dashboard(const Dashboard&) = delete;
  Dashboard& operator=(const Dashboard&) = delete;

  // Serves the page and the API on `server`, which must not outlive this.
  void Register(HttpServer& server) const;

  HttpResponse GetState(const HttpRequest& request) const;
  HttpResponse PostPolicy(const HttpRequest& request) const;
  HttpResponse GetTrace(const HttpRequest& request) const;

 private:
  const CoordinatorCore core_;
  const BearerAuth token_;
};

}  // namespace hsdp::coordinator

#endif  // HSDP_COORDINATOR_SERVICE_DASHBOARD_H_
