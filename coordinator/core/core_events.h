// How the core's components are kept in step with the membership: CoreEvents
// carries Membership's events to the schedule log, the rendezvous store and
// the metrics; RefreshMembershipMetrics pushes the worker counts after calls
// that change them.
#ifndef HSDP_COORDINATOR_CORE_CORE_EVENTS_H_
#define HSDP_COORDINATOR_CORE_CORE_EVENTS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "coordinator/core/coordinator_core.h"
#include "coordinator/core/membership_types.h"

namespace hsdp::coordinator {

// Pushes the worker counts, generation and sealed step into the metrics. Called
// after membership changes (join, sweep, finish), not per report, since it
// walks all workers.
void RefreshMembershipMetrics(const CoordinatorCore& core);

// A generation that ends closes its rendezvous (waiting store calls fail
// ABORTED); a new one starts the schedule log's generation (re-sealing
// uncommitted steps for its world) and drops the old rendezvous keys; commits
// move the read-ahead window and, with ended generations, are news for the
// schedule feed; metrics count failures and the time they cost;
// a shard group that spans hosts is logged and the schedule log plans for
// the inter-host link. Runs under Membership's lock (see
// MembershipListener); thread-safe like the components it calls.
class CoreEvents final : public MembershipListener {
 public:
  explicit CoreEvents(CoordinatorCore core) : core_(core) {}
  CoreEvents(const CoreEvents&) = delete;
  CoreEvents& operator=(const CoreEvents&) = delete;

  void OnGenerationEnded(int64_t generation,
                         hsdp::v1::FailureCause cause) override;
  void OnGenerationFormed(const hsdp::v1::Generation& generation) override;
  void OnShardGroupsAcrossHosts(
      int64_t generation, int host_group_size,
      const std::vector<std::string>& warnings) override;
  int64_t LastCheckpointStep() override;
  void OnStepCommitted(int64_t generation, const CommitResult& commit) override;
  void OnRecovered(const hsdp::v1::FailureRecord& failure) override;

 private:
  const CoordinatorCore core_;
};

}  // namespace hsdp::coordinator

#endif  // HSDP_COORDINATOR_CORE_CORE_EVENTS_H_
