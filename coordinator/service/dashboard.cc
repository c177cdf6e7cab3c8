#include "coordinator/service/dashboard.h"

#include <google/protobuf/util/json_util.h>
#include <unistd.h>

#include <climits>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/policy.h"
#include "coordinator/core/membership.h"
#include "coordinator/core/metrics.h"
#include "coordinator/core/queries.h"
#include "coordinator/core/schedule_log.h"
#include "coordinator/service/dashboard.pb.h"
#include "coordinator/service/web/web_assets.h"
#include "hsdp/mesh.h"

namespace hsdp::coordinator {
namespace {

namespace dash = hsdp::coordinator::dashboard;

constexpr char kJsonContentType[] = "application/json";
constexpr int kStatusOk = 200;
// The page loads nothing but its own files and talks only to this server.
constexpr char kContentSecurityPolicy[] =
    "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'";

std::string ToJson(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  std::string json;
  // Printing a well-formed message cannot fail.
  (void)google::protobuf::util::MessageToJsonString(message, &json, options);
  return json;
}

HttpResponse JsonResponse(int status, const google::protobuf::Message& body) {
  HttpResponse response;
  response.status = status;
  response.content_type = kJsonContentType;
  response.body = ToJson(body);
  response.headers.emplace_back("Cache-Control", "no-store");
  return response;
}

HttpResponse ErrorResponse(const absl::Status& status) {
  dash::ErrorResponse error;
  error.set_code(absl::StatusCodeToString(status.code()));
  error.set_message(std::string(status.message()));
  HttpResponse response = JsonResponse(HttpStatusFor(status.code()), error);
  if (status.code() == absl::StatusCode::kUnauthenticated) {
    response.headers.emplace_back("WWW-Authenticate", "Bearer");
  }
  return response;
}

bool IsWildcardHost(absl::string_view host) {
  return host.empty() || host == "0.0.0.0" || host == "::" || host == "[::]" ||
         host == "*";
}

std::string HostName() {
  char name[HOST_NAME_MAX + 1] = {};
  if (gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') {
    return "localhost";
  }
  return name;
}

// Per unit: memory from the unit list and the mesh, reshard flags from the
// latest sealed schedule, communication time from the workers' latest reports.
void FillUnits(const CoordinatorCore& core,
               const hsdp::v1::ListWorkersResponse& workers,
               const hsdp::v1::GetPolicyResponse& policy,
               dash::DashboardState* state) {
  const UnitList units = core.membership->units();
  const int shard = core.membership->mesh().shard;
  std::shared_ptr<const SealedSchedule> sealed;
  const int64_t sealed_step = core.schedule_log->sealed_step();
  if (sealed_step >= 0) {
    absl::StatusOr<std::shared_ptr<const SealedSchedule>> got =
        core.schedule_log->GetSealed(sealed_step);
    if (got.ok()) sealed = *std::move(got);
  }
  struct CommSum {
    double all_gather = 0;
    double reduce_scatter = 0;
    int reports = 0;
  };
  std::map<int, CommSum> comm;
  for (const hsdp::v1::WorkerInfo& w : workers.workers()) {
    for (const hsdp::v1::UnitCommTime& t : w.last_report().unit_comm()) {
      CommSum& sum = comm[t.unit_index()];
      sum.all_gather += t.all_gather_seconds();
      sum.reduce_scatter += t.reduce_scatter_seconds();
      ++sum.reports;
    }
  }
  const hsdp::v1::Policy resolved = ResolvePolicyDefaults(policy.policy());
  for (size_t i = 0; i < units.size(); ++i) {
    const hsdp::v1::UnitInfo& unit = units[i];
    dash::UnitView* view = state->add_units();
    view->set_index(static_cast<int32_t>(i));
    view->set_name(unit.name());
    view->set_param_count(unit.param_count());
    view->set_param_bytes(unit.param_bytes());
    view->set_shard_bytes(ShardedBytes(unit.param_bytes(), shard));
    if (sealed != nullptr &&
        static_cast<int>(i) < sealed->schedule.units_size()) {
      const hsdp::v1::UnitSchedule& s = sealed->schedule.units(i);
      view->set_reshard_after_forward(s.reshard_after_forward());
      view->set_reshard_after_backward(s.reshard_after_backward());
    } else {
      const UnitReshard r = ResolveUnitReshard(resolved, unit.name());
      view->set_reshard_after_forward(r.after_forward);
      view->set_reshard_after_backward(r.after_backward);
    }
    auto it = comm.find(static_cast<int>(i));
    if (it != comm.end()) {
      view->set_all_gather_seconds(it->second.all_gather / it->second.reports);
      view->set_reduce_scatter_seconds(it->second.reduce_scatter /
                                       it->second.reports);
      view->set_comm_reports(it->second.reports);
    }
  }
}

}  // namespace

std::string DashboardUrl(const std::string& listen, int port,
                         const std::string& override_url) {
  if (!override_url.empty()) return override_url;
  // "PORT" alone (civetweb's form for every address) has no host either.
  const size_t colon = listen.rfind(':');
  std::string host = colon == std::string::npos ? "" : listen.substr(0, colon);
  if (IsWildcardHost(host)) host = HostName();
  return absl::StrCat("http://", host, ":", port, "/");
}

int HttpStatusFor(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kOk:
      return kStatusOk;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
      return 400;
    case absl::StatusCode::kUnauthenticated:
      return 401;
    case absl::StatusCode::kPermissionDenied:
      return 403;
    case absl::StatusCode::kNotFound:
      return 404;
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kAlreadyExists:
      return 409;
    case absl::StatusCode::kUnavailable:
      return 503;
    default:
      return 500;
  }
}

Dashboard::Dashboard(CoordinatorCore core, const std::string& control_token)
    : core_(std::move(core)), token_(control_token, "control token") {}

void Dashboard::Register(HttpServer& server) const {
  for (const WebAsset& asset : WebAssets()) {
    server.Handle("GET", asset.path, [&asset](const HttpRequest&) {
      HttpResponse response;
      response.content_type = asset.content_type;
      response.body = std::string(asset.body);
      response.headers.emplace_back("Content-Security-Policy",
                                    kContentSecurityPolicy);
      response.headers.emplace_back("X-Content-Type-Options", "nosniff");
      return response;
    });
  }
  server.Handle("GET", "/api/state",
                [this](const HttpRequest& r) { return GetState(r); });
  server.Handle("POST", "/api/policy",
                [this](const HttpRequest& r) { return PostPolicy(r); });
  server.Handle("GET", "/api/trace",
                [this](const HttpRequest& r) { return GetTrace(r); });
}

HttpResponse Dashboard::GetTrace(const HttpRequest& request) const {
  absl::StatusOr<TraceCollector*> traces = CollectorOf(core_);
  if (!traces.ok()) return ErrorResponse(traces.status());
  const std::string first_text = QueryParam(request.query, "first");
  const std::string last_text = QueryParam(request.query, "last");
  int64_t first = 0;
  int64_t last = 0;
  if (first_text.empty() && last_text.empty()) {
    const std::optional<std::pair<int64_t, int64_t>> latest =
        (*traces)->LatestRange(kDashboardTraceSteps);
    if (!latest.has_value()) {
      return ErrorResponse(absl::NotFoundError(
          "no step has been traced yet: hsdpctl trace --steps A..B"));
    }
    std::tie(first, last) = *latest;
  } else if (!absl::SimpleAtoi(first_text, &first) ||
             !absl::SimpleAtoi(last_text, &last)) {
    return ErrorResponse(absl::InvalidArgumentError(
        absl::StrCat("first, last: '", first_text, "', '", last_text,
                     "' are not both steps")));
  }
  absl::StatusOr<RenderedTrace> trace = RenderTrace(core_, first, last);
  if (!trace.ok()) return ErrorResponse(trace.status());
  HttpResponse response;
  response.status = kStatusOk;
  response.content_type = kJsonContentType;
  response.body = std::move(trace->chrome_json);
  response.headers.emplace_back("Cache-Control", "no-store");
  return response;
}

HttpResponse Dashboard::GetState(const HttpRequest& request) const {
  int64_t since = -1;
  const std::string since_text = QueryParam(request.query, "since");
  if (!since_text.empty() && !absl::SimpleAtoi(since_text, &since)) {
    return ErrorResponse(absl::InvalidArgumentError(
        absl::StrCat("since: '", since_text, "' is not a step")));
  }
  dash::DashboardState state;
  FillStatus(core_, state.mutable_status());
  hsdp::v1::ListWorkersResponse workers;
  FillWorkers(core_, &workers);
  FillPolicy(core_, state.mutable_policy());
  state.set_policy_text(DescribePolicy(state.policy().policy()));
  for (const PolicyInfo& info : core_.schedule_log->PolicyHistory()) {
    dash::PolicyMark* mark = state.add_policy_history();
    mark->set_version(info.version);
    mark->set_effective_step(info.effective_step);
  }
  FillUnits(core_, workers, state.policy(), &state);
  *state.mutable_workers() = std::move(*workers.mutable_workers());
  for (const StepSample& p : core_.metrics->history().Since(since)) {
    dash::StepPoint* point = state.add_history();
    point->set_step(p.step);
    point->set_loss(p.loss);
    point->set_step_seconds(p.step_seconds);
    point->set_tokens_per_second(p.tokens_per_second);
    point->set_peak_memory_bytes(p.peak_memory_bytes);
    point->set_ranks(p.ranks);
  }
  state.set_token_required(token_.enabled());
  state.set_history_capacity(
      static_cast<int32_t>(core_.metrics->history().capacity()));
  return JsonResponse(kStatusOk, state);
}

HttpResponse Dashboard::PostPolicy(const HttpRequest& request) const {
  // First, so an unauthenticated request reads or changes nothing.
  absl::Status auth = token_.Check(
      request.authorization.empty()
          ? std::nullopt
          : std::optional<absl::string_view>(request.authorization));
  if (!auth.ok()) return ErrorResponse(auth);
  // An empty Policy is valid (all defaults): refuse an empty body rather than
  // reset every field because a request lost its body.
  if (request.body.find_first_not_of(" \t\r\n") == std::string::npos) {
    return ErrorResponse(absl::InvalidArgumentError(
        "policy: empty request body (send the whole policy as JSON)"));
  }
  absl::StatusOr<hsdp::v1::Policy> policy = ParsePolicy(request.body);
  if (!policy.ok()) return ErrorResponse(policy.status());
  absl::StatusOr<PolicyInfo> applied = ApplyPolicy(core_, *policy);
  if (!applied.ok()) return ErrorResponse(applied.status());
  hsdp::v1::SetPolicyResponse response;
  response.set_policy_version(applied->version);
  response.set_effective_step(applied->effective_step);
  return JsonResponse(kStatusOk, response);
}

}  // namespace hsdp::coordinator
