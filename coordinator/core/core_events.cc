#include "coordinator/core/core_events.h"

#include <iostream>
#include <map>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "coordinator/core/kv_store.h"
#include "coordinator/core/membership.h"
#include "coordinator/core/metrics.h"
#include "coordinator/core/schedule_log.h"

namespace hsdp::coordinator {

void RefreshMembershipMetrics(const CoordinatorCore& core) {
  std::map<hsdp::v1::WorkerState, int> counts = core.membership->StateCounts();
  const int alive = counts[hsdp::v1::WORKER_STATE_ALIVE];
  const int lost = counts[hsdp::v1::WORKER_STATE_LOST];
  const int finished = counts[hsdp::v1::WORKER_STATE_FINISHED];
  const int standby = counts[hsdp::v1::WORKER_STATE_STANDBY];
  const int joining = counts[hsdp::v1::WORKER_STATE_JOINING];
  const int evicted = counts[hsdp::v1::WORKER_STATE_EVICTED];
  core.metrics->SetWorkerCounts(alive, lost, finished);
  core.metrics->SetElasticWorkerCounts(standby, joining, evicted);
  core.metrics->SetGeneration(core.membership->generation());
  core.metrics->SetSealedStep(core.schedule_log->sealed_step());
}

void CoreEvents::OnGenerationEnded(int64_t generation,
                                   hsdp::v1::FailureCause cause) {
  core_.kv_store->EndGeneration(core_.membership->job_id(), generation);
  core_.schedule_log->RecordGenerationEnded(generation);
  core_.metrics->RecordGenerationEnd(hsdp::v1::FailureCause_Name(cause));
  std::cerr << "hsdp-coordinator: generation " << generation << " ended ("
            << hsdp::v1::FailureCause_Name(cause) << ")\n";
}

int64_t CoreEvents::LastCheckpointStep() {
  return core_.schedule_log->last_checkpoint_step();
}

void CoreEvents::OnGenerationFormed(const hsdp::v1::Generation& generation) {
  GenerationContext context;
  context.generation = generation.generation();
  context.world_size = generation.worker_ids_size();
  context.start_step = generation.start_step();
  if (absl::Status s = core_.schedule_log->BeginGeneration(context); !s.ok()) {
    std::cerr << "hsdp-coordinator: generation " << generation.generation()
              << " not persisted in the schedule log: " << s << "\n";
  }
  core_.kv_store->DropGenerationsBefore(core_.membership->job_id(),
                                        generation.generation());
  core_.metrics->SetGeneration(generation.generation());
  core_.metrics->SetReplicas(generation.mesh().replicate());
  int heal_targets = 0;
  for (const auto& heal : generation.heal_plans()) {
    heal_targets += heal.target_ranks_size();
  }
  std::cerr << "hsdp-coordinator: generation " << generation.generation()
            << " formed: mesh " << generation.mesh().replicate() << "x"
            << generation.mesh().shard() << ", from step "
            << generation.start_step() << ", " << heal_targets
            << " rank(s) to heal"
            << (generation.restore_from_checkpoint()
                    ? absl::StrCat(", restored from the checkpoint of step ",
                                   generation.start_step() - 1)
                    : std::string())
            << "\n";
}

void CoreEvents::OnShardGroupsAcrossHosts(
    int64_t generation, int host_group_size,
    const std::vector<std::string>& warnings) {
  core_.schedule_log->SetShardGroupsCrossHosts(generation, host_group_size);
  for (const std::string& warning : warnings) {
    std::cerr << "hsdp-coordinator: generation " << generation << ": "
              << warning << "\n";
  }
}

void CoreEvents::OnStepCommitted(int64_t generation,
                                 const CommitResult& commit) {
  core_.schedule_log->RecordCommitted(commit.step, generation,
                                      commit.reform_after);
  core_.metrics->SetCommittedStep(commit.step);
}

void CoreEvents::OnRecovered(const hsdp::v1::FailureRecord& failure) {
  auto seconds = [](int64_t from_ms, int64_t to_ms) {
    return static_cast<double>(to_ms - from_ms) / 1000.0;
  };
  core_.metrics->ObserveFailureCost(
      seconds(failure.failed_unix_ms(), failure.ended_unix_ms()),
      seconds(failure.ended_unix_ms(), failure.formed_unix_ms()),
      seconds(failure.formed_unix_ms(), failure.recovered_unix_ms()));
}

}  // namespace hsdp::coordinator
