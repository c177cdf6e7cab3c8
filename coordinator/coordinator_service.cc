#include "coordinator/coordinator_service.h"

#include <grpcpp/server_context.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/mesh.h"
#include "common/status_util.h"
#include "common/units.h"
#include "coordinator/grpc_status.h"

namespace hsdp::coordinator {
namespace {

// Workers heartbeat this many times per timeout, so one delayed beat does not
// lose them.
constexpr int kHeartbeatsPerTimeout = 4;
constexpr absl::Duration kMinHeartbeatInterval = absl::Milliseconds(50);

}  // namespace

void ReportBook::Record(const hsdp::v1::StepReport& report) {
  absl::MutexLock lock(&mu_);
  latest_[report.rank()] = report;
}

bool ReportBook::Latest(int rank, hsdp::v1::StepReport* report) const {
  absl::MutexLock lock(&mu_);
  auto it = latest_.find(rank);
  if (it == latest_.end()) return false;
  *report = it->second;
  return true;
}

void RefreshMembershipMetrics(const CoordinatorCore& core) {
  int alive = 0, lost = 0, finished = 0;
  for (const WorkerSnapshot& w : core.membership->Workers()) {
    switch (w.state) {
      case hsdp::v1::WORKER_STATE_ALIVE:
        ++alive;
        break;
      case hsdp::v1::WORKER_STATE_LOST:
        ++lost;
        break;
      case hsdp::v1::WORKER_STATE_FINISHED:
        ++finished;
        break;
      default:
        break;
    }
  }
  core.metrics->SetWorkerCounts(alive, lost, finished);
  core.metrics->SetGeneration(core.membership->generation());
  core.metrics->SetSealedStep(core.schedule_log->sealed_step());
}

absl::Time LongPollDeadline(const grpc::ServerContext& context,
                            absl::Duration max_wait) {
  const absl::Time cap = absl::Now() + max_wait;
  const auto deadline = context.deadline();
  // gRPC reports "no deadline" as the time_point maximum, which absl cannot
  // convert.
  if (deadline == std::chrono::system_clock::time_point::max()) return cap;
  return std::min(cap, absl::FromChrono(deadline));
}

CoordinatorServiceImpl::CoordinatorServiceImpl(CoordinatorCore core,
                                               const std::string& job_token)
    : core_(core), job_auth_(job_token, "job token") {}

grpc::Status CoordinatorServiceImpl::Join(grpc::ServerContext* context,
                                          const hsdp::v1::JoinRequest* request,
                                          hsdp::v1::JoinResponse* response) {
  return Serve(*context, [&]() -> absl::Status {
    HSDP_RETURN_IF_ERROR(core_.membership->CheckJobId(request->job_id()));
    JoinArgs args;
    if (request->has_rank_hint() && request->rank_hint() >= 0)
      args.rank_hint = request->rank_hint();
    args.hostname = request->hostname();
    args.device = request->device();
    args.model = request->model();
    args.units = UnitListFromProto(request->units());
    HSDP_ASSIGN_OR_RETURN(JoinResult joined, core_.membership->Join(args));
    // Every successful join (not only the first) hands the model to the
    // schedule log, so a second worker cannot race to GetSchedule before the
    // first joiner's SetUnits ran. The same list again is a no-op.
    if (!core_.schedule_log->has_units()) {
      absl::Status units =
          core_.schedule_log->SetUnits(core_.membership->units());
      if (!units.ok()) {
        // The units are kept; only a policy override matching none of them is
        // reported.
        std::cerr << "hsdp-coordinator: model of job " << request->job_id()
                  << ": " << units << "\n";
      }
    }
    const absl::Duration interval =
        std::max(kMinHeartbeatInterval,
                 core_.membership->heartbeat_timeout() / kHeartbeatsPerTimeout);
    response->set_rank(joined.rank);
    response->set_world_size(core_.membership->world_size());
    *response->mutable_mesh() = MeshToProto(core_.membership->mesh());
    response->set_replicate_index(joined.coord.replicate_index);
    response->set_shard_index(joined.coord.shard_index);
    response->set_generation(joined.generation);
    response->set_rendezvous_prefix(
        RendezvousPrefix(request->job_id(), joined.generation));
    response->set_heartbeat_interval_ms(
        static_cast<int32_t>(absl::ToInt64Milliseconds(interval)));
    response->set_last_checkpoint_step(
        core_.schedule_log->last_checkpoint_step());
    RefreshMembershipMetrics(core_);
    return absl::OkStatus();
  });
}

grpc::Status CoordinatorServiceImpl::Heartbeat(
    grpc::ServerContext* context, const hsdp::v1::HeartbeatRequest* request,
    hsdp::v1::HeartbeatResponse* response) {
  return Serve(*context, [&]() -> absl::Status {
    HSDP_RETURN_IF_ERROR(core_.membership->CheckJobId(request->job_id()));
    HSDP_RETURN_IF_ERROR(
        core_.membership->Heartbeat(request->rank(), request->step()));
    if (request->step() > 0) {
      // A worker on step s has completed s - 1. Feeding that to the read-ahead
      // window matters after a coordinator restart: completed steps are not
      // persisted, so without it the first unsealed step would wait for
      // reports that workers only send after getting it.
      hsdp::v1::StepReport progress;
      progress.set_rank(request->rank());
      progress.set_step(request->step() - 1);
      HSDP_RETURN_IF_ERROR(core_.schedule_log->RecordReport(progress));
    }
    // A generation different from the request's tells the worker to
    // re-rendezvous.
    response->set_generation(core_.membership->generation());
    response->set_job_state(core_.membership->job_state());
    return absl::OkStatus();
  });
}

grpc::Status CoordinatorServiceImpl::GetSchedule(
    grpc::ServerContext* context, const hsdp::v1::GetScheduleRequest* request,
    hsdp::v1::GetScheduleResponse* response) {
  const absl::Time start = absl::Now();
  grpc::Status status = Serve(*context, [&]() -> absl::Status {
    HSDP_RETURN_IF_ERROR(core_.membership->CheckJobId(request->job_id()));
    HSDP_RETURN_IF_ERROR(core_.membership->CheckMember(request->rank()));
    HSDP_ASSIGN_OR_RETURN(ScheduleRead read,
                          core_.schedule_log->GetSchedule(
                              request->step(), core_.membership->generation(),
                              LongPollDeadline(*context, core_.max_long_poll)));
    if (read.drained) {
      response->set_drained(true);
      return absl::OkStatus();
    }
    // The sealed message is immutable; its copy serializes to the sealed bytes.
    *response->mutable_schedule() = read.sealed->schedule;
    return absl::OkStatus();
  });
  core_.metrics->ObserveScheduleLatency(
      absl::ToDoubleSeconds(absl::Now() - start));
  if (status.ok())
    core_.metrics->SetSealedStep(core_.schedule_log->sealed_step());
  return status;
}

grpc::Status CoordinatorServiceImpl::ReportStep(
    grpc::ServerContext* context, const hsdp::v1::ReportStepRequest* request,
    hsdp::v1::ReportStepResponse* /*response*/) {
  return Serve(*context, [&]() -> absl::Status {
    HSDP_RETURN_IF_ERROR(core_.membership->CheckJobId(request->job_id()));
    const hsdp::v1::StepReport& report = request->report();
    // A report is as good as a heartbeat (and checks the rank holds a live
    // slot).
    HSDP_RETURN_IF_ERROR(
        core_.membership->Heartbeat(report.rank(), report.step()));
    HSDP_RETURN_IF_ERROR(core_.schedule_log->RecordReport(report));
    core_.reports->Record(report);
    core_.metrics->RecordReport(report);
    if (request->finished()) {
      HSDP_RETURN_IF_ERROR(core_.membership->MarkFinished(report.rank()));
      RefreshMembershipMetrics(core_);
    }
    return absl::OkStatus();
  });
}

absl::Status CoordinatorServiceImpl::CheckStoreScope(absl::string_view job_id,
                                                     int64_t generation) const {
  HSDP_RETURN_IF_ERROR(core_.membership->CheckJobId(job_id));
  const int64_t current = core_.membership->generation();
  if (generation != current) {
    return absl::FailedPreconditionError(absl::StrCat(
        "generation ", generation, " is not the current generation ", current,
        ": re-join to rendezvous again"));
  }
  return absl::OkStatus();
}

grpc::Status CoordinatorServiceImpl::StoreSet(
    grpc::ServerContext* context, const hsdp::v1::StoreSetRequest* request,
    hsdp::v1::StoreSetResponse* /*response*/) {
  return Serve(*context, [&]() -> absl::Status {
    HSDP_RETURN_IF_ERROR(
        CheckStoreScope(request->job_id(), request->generation()));
    return core_.kv_store->Set(request->job_id(), request->generation(),
                               request->key(), request->value());
  });
}

namespace {

// The store wait: the request's timeout, but never past the call's own (capped)
// deadline.
absl::Duration StoreTimeout(const grpc::ServerContext& context,
                            absl::Duration max_wait, int32_t timeout_ms) {
  const absl::Duration call_left =
      LongPollDeadline(context, max_wait) - absl::Now();
  return std::min(absl::Milliseconds(timeout_ms), call_left);
}

}  // namespace

grpc::Status CoordinatorServiceImpl::StoreGet(
    grpc::ServerContext* context, const hsdp::v1::StoreGetRequest* request,
    hsdp::v1::StoreGetResponse* response) {
  return Serve(*context, [&]() -> absl::Status {
    HSDP_RETURN_IF_ERROR(
        CheckStoreScope(request->job_id(), request->generation()));
    HSDP_ASSIGN_OR_RETURN(
        std::string value,
        core_.kv_store->Get(request->job_id(), request->generation(),
                            request->key(),
                            StoreTimeout(*context, core_.max_long_poll,
                                         request->timeout_ms())));
    response->set_value(std::move(value));
    return absl::OkStatus();
  });
}

grpc::Status CoordinatorServiceImpl::StoreWait(
    grpc::ServerContext* context, const hsdp::v1::StoreWaitRequest* request,
    hsdp::v1::StoreWaitResponse* /*response*/) {
  return Serve(*context, [&]() -> absl::Status {
    HSDP_RETURN_IF_ERROR(
        CheckStoreScope(request->job_id(), request->generation()));
    const std::vector<std::string> keys(request->keys().begin(),
                                        request->keys().end());
    return core_.kv_store->Wait(
        request->job_id(), request->generation(), keys,
        StoreTimeout(*context, core_.max_long_poll, request->timeout_ms()));
  });
}

void CoordinatorServiceImpl::SweepHeartbeats() {
  const std::vector<int> lost = core_.membership->SweepHeartbeats();
  if (lost.empty()) return;
  const int64_t generation = core_.membership->generation();
  std::cerr << "hsdp-coordinator: lost " << lost.size()
            << " worker(s) (first: rank " << lost.front()
            << "); generation is now " << generation << "\n";
  core_.kv_store->DropGenerationsBefore(core_.membership->job_id(), generation);
  RefreshMembershipMetrics(core_);
}

}  // namespace hsdp::coordinator
