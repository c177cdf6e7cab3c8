// Fuzzes the coordinator's gRPC handlers in-process: CoordinatorService (the
// worker API) and ControlService (operators) over a fresh coordinator core per
// input, called directly with mutated requests and credentials. Debian has no
// libprotobuf-mutator, so the structure is our own: the input is a sequence of
// calls, each
//
//   byte 0     which RPC (modulo the RPCs below)
//   byte 1     credentials: 0-1 the right token, 2 none, 3 a wrong one
//   byte 2     bit 0: set the request's job id to the served job's, so calls
//              get past the job check more often than random bytes would
//   bytes 3-4  little-endian length n
//   n bytes    the request message in protobuf wire format (bytes that do not
//              parse leave it empty)
//
// libFuzzer's byte mutations on seeds made of valid calls (tests/fuzz/corpus)
// then mutate fields, sequences and credentials.
//
// Invariants checked besides "no crash": a call refused UNAUTHENTICATED
// changes nothing an operator or worker can observe; a sealed step's bytes
// never change; no handler answers UNKNOWN or INTERNAL.
#include <grpcpp/server_context.h>
#include <grpcpp/test/server_context_test_spouse.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "coordinator/core/kv_store.h"
#include "coordinator/core/membership.h"
#include "coordinator/core/metrics.h"
#include "coordinator/core/report_book.h"
#include "coordinator/core/schedule_log.h"
#include "coordinator/service/control_service.h"
#include "coordinator/service/coordinator_service.h"
#include "hsdp/v1/control_service.pb.h"
#include "hsdp/v1/coordinator_service.pb.h"
#include "tests/fuzz/fuzz_check.h"

namespace hsdp::coordinator {
namespace {

constexpr char kJob[] = "fuzz-job";
constexpr char kJobToken[] = "fuzz-job-token";
constexpr char kControlToken[] = "fuzz-control-token";
constexpr int kWorld = 4;
constexpr size_t kHeaderBytes = 5;

// One coordinator, as CoordinatorServer assembles it, minus gRPC and disk.
struct Coordinator {
  Coordinator() {
    Membership::Options m;
    m.job_id = kJob;
    m.world_size = kWorld;
    m.mesh = MeshShape{2, 2};
    membership = *Membership::Create(m, nullptr);
    ScheduleLog::Options l;
    l.world_size = kWorld;
    l.shard_size = 2;
    l.read_ahead = 2;
    schedule_log = *ScheduleLog::Create(l, hsdp::v1::Policy(), nullptr);
    CoordinatorCore core;
    core.membership = membership.get();
    core.schedule_log = schedule_log.get();
    core.kv_store = &kv_store;
    core.metrics = SharedMetrics();
    core.reports = &reports;
    ServiceContext service;
    service.calls = &calls;
    // Long polls answer at once: a fuzz input must not wait out a window.
    service.max_long_poll = absl::Milliseconds(1);
    worker = std::make_unique<CoordinatorServiceImpl>(core, service, kJobToken);
    control =
        std::make_unique<ControlServiceImpl>(core, service, kControlToken);
  }

  // Metrics are only written by the handlers, never read back: one registry
  // serves every input.
  static Metrics* SharedMetrics() {
    static Metrics* metrics = new Metrics();
    return metrics;
  }

  std::unique_ptr<Membership> membership;
  std::unique_ptr<ScheduleLog> schedule_log;
  KvStore kv_store;
  ReportBook reports;
  CallTracker calls;
  std::unique_ptr<CoordinatorServiceImpl> worker;
  std::unique_ptr<ControlServiceImpl> control;
};

// What a refused call must leave as it was.
std::string Observable(Coordinator& c) {
  grpc::ServerContext context;
  grpc::testing::ServerContextTestSpouse spouse(&context);
  spouse.AddClientMetadata("authorization",
                           absl::StrCat("Bearer ", kControlToken));
  hsdp::v1::GetStatusResponse status;
  FUZZ_CHECK(c.control
                 ->GetStatus(&context,
                             &hsdp::v1::GetStatusRequest::default_instance(),
                             &status)
                 .ok());
  hsdp::v1::ListWorkersResponse workers;
  FUZZ_CHECK(
      c.control
          ->ListWorkers(&context,
                        &hsdp::v1::ListWorkersRequest::default_instance(),
                        &workers)
          .ok());
  for (auto& w : *workers.mutable_workers()) w.clear_heartbeat_age_ms();
  hsdp::v1::GetPolicyResponse policy;
  FUZZ_CHECK(c.control
                 ->GetPolicy(&context,
                             &hsdp::v1::GetPolicyRequest::default_instance(),
                             &policy)
                 .ok());
  std::string steps;
  for (const WorkerSnapshot& w : c.membership->Workers()) {
    absl::StrAppend(&steps, w.rank, ":", w.step, ",");
  }
  const int64_t generation = c.membership->generation();
  return absl::StrCat(status.SerializeAsString(), "|",
                      workers.SerializeAsString(), "|",
                      policy.SerializeAsString(), "|", steps, "|",
                      c.kv_store.KeyCount(kJob, generation), ":",
                      c.kv_store.ByteCount(kJob, generation), "|",
                      c.schedule_log->min_completed_step());
}

// Parses `bytes` into `request` and applies the job-id fix-up.
template <typename Request>
Request Parse(const std::string& bytes, bool fix_job) {
  Request request;
  if (!request.ParseFromString(bytes)) request.Clear();
  if constexpr (std::is_same_v<Request, hsdp::v1::ReportStepRequest> ||
                std::is_same_v<Request, hsdp::v1::JoinRequest> ||
                std::is_same_v<Request, hsdp::v1::HeartbeatRequest> ||
                std::is_same_v<Request, hsdp::v1::GetScheduleRequest> ||
                std::is_same_v<Request, hsdp::v1::StoreSetRequest> ||
                std::is_same_v<Request, hsdp::v1::StoreGetRequest> ||
                std::is_same_v<Request, hsdp::v1::StoreWaitRequest>) {
    if (fix_job) request.set_job_id(kJob);
  }
  return request;
}

// Sealed bytes seen so far in this input, by step.
using SealedSeen = std::map<int64_t, std::string>;

void CheckSealed(SealedSeen* seen, const hsdp::v1::StepSchedule& schedule) {
  const std::string bytes = schedule.SerializeAsString();
  auto [it, inserted] = seen->emplace(schedule.step(), bytes);
  FUZZ_CHECK(inserted || it->second == bytes);
}

// Runs one call; returns its status.
grpc::Status Call(Coordinator& c, uint8_t rpc, const std::string& bytes,
                  bool fix_job, grpc::ServerContext* ctx, SealedSeen* sealed) {
  using namespace hsdp::v1;  // NOLINT: the request/response types below
  switch (rpc % 14) {
    case 0: {
      const auto req = Parse<JoinRequest>(bytes, fix_job);
      JoinResponse r;
      return c.worker->Join(ctx, &req, &r);
    }
    case 1: {
      const auto req = Parse<HeartbeatRequest>(bytes, fix_job);
      HeartbeatResponse r;
      return c.worker->Heartbeat(ctx, &req, &r);
    }
    case 2: {
      const auto req = Parse<GetScheduleRequest>(bytes, fix_job);
      GetScheduleResponse r;
      grpc::Status s = c.worker->GetSchedule(ctx, &req, &r);
      if (s.ok() && r.has_schedule()) CheckSealed(sealed, r.schedule());
      return s;
    }
    case 3: {
      const auto req = Parse<ReportStepRequest>(bytes, fix_job);
      ReportStepResponse r;
      return c.worker->ReportStep(ctx, &req, &r);
    }
    case 4: {
      const auto req = Parse<StoreSetRequest>(bytes, fix_job);
      StoreSetResponse r;
      return c.worker->StoreSet(ctx, &req, &r);
    }
    case 5: {
      const auto req = Parse<StoreGetRequest>(bytes, fix_job);
      StoreGetResponse r;
      return c.worker->StoreGet(ctx, &req, &r);
    }
    case 6: {
      const auto req = Parse<StoreWaitRequest>(bytes, fix_job);
      StoreWaitResponse r;
      return c.worker->StoreWait(ctx, &req, &r);
    }
    case 7: {
      const auto req = Parse<SetPolicyRequest>(bytes, fix_job);
      SetPolicyResponse r;
      return c.control->SetPolicy(ctx, &req, &r);
    }
    case 8: {
      const auto req = Parse<ControlServiceGetScheduleRequest>(bytes, fix_job);
      ControlServiceGetScheduleResponse r;
      grpc::Status s = c.control->GetSchedule(ctx, &req, &r);
      if (s.ok()) CheckSealed(sealed, r.schedule());
      return s;
    }
    case 9: {
      const RequestCheckpointRequest req;
      RequestCheckpointResponse r;
      return c.control->RequestCheckpoint(ctx, &req, &r);
    }
    case 10: {
      const DrainRequest req;
      DrainResponse r;
      return c.control->Drain(ctx, &req, &r);
    }
    case 11: {
      const GetStatusRequest req;
      GetStatusResponse r;
      return c.control->GetStatus(ctx, &req, &r);
    }
    case 12: {
      const ListWorkersRequest req;
      ListWorkersResponse r;
      return c.control->ListWorkers(ctx, &req, &r);
    }
    default: {
      // Not an RPC: the server's periodic sweep, between calls.
      c.worker->Tick();
      return grpc::Status::OK;
    }
  }
}

bool IsControl(uint8_t rpc) {
  const int r = rpc % 14;
  return r >= 7 && r <= 12;
}

}  // namespace
}  // namespace hsdp::coordinator

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using hsdp::coordinator::kHeaderBytes;
  hsdp::coordinator::Coordinator c;
  hsdp::coordinator::SealedSeen sealed;
  size_t pos = 0;
  while (size - pos >= kHeaderBytes) {
    const uint8_t rpc = data[pos];
    const uint8_t credentials = data[pos + 1] & 3;
    const bool fix_job = (data[pos + 2] & 1) != 0;
    size_t n = data[pos + 3] | (static_cast<size_t>(data[pos + 4]) << 8);
    pos += kHeaderBytes;
    n = std::min(n, size - pos);
    const std::string bytes(reinterpret_cast<const char*>(data + pos), n);
    pos += n;

    grpc::ServerContext context;
    grpc::testing::ServerContextTestSpouse spouse(&context);
    const bool control = hsdp::coordinator::IsControl(rpc);
    const char* token = control ? hsdp::coordinator::kControlToken
                                : hsdp::coordinator::kJobToken;
    if (credentials < 2) {
      spouse.AddClientMetadata("authorization", absl::StrCat("Bearer ", token));
    } else if (credentials == 3) {
      // The other service's token: right format, wrong secret.
      spouse.AddClientMetadata(
          "authorization",
          absl::StrCat("Bearer ", control ? hsdp::coordinator::kJobToken
                                          : hsdp::coordinator::kControlToken));
    }
    const bool authenticated = credentials < 2;
    const std::string before =
        authenticated ? "" : hsdp::coordinator::Observable(c);
    const grpc::Status status =
        hsdp::coordinator::Call(c, rpc, bytes, fix_job, &context, &sealed);
    FUZZ_CHECK(status.error_code() != grpc::StatusCode::UNKNOWN);
    FUZZ_CHECK(status.error_code() != grpc::StatusCode::INTERNAL);
    if (!authenticated && rpc % 14 != 13) {
      FUZZ_CHECK(status.error_code() == grpc::StatusCode::UNAUTHENTICATED);
      FUZZ_CHECK(hsdp::coordinator::Observable(c) == before);
    }
  }
  return 0;
}
