// Forming a generation: which live workers train, in which replica groups and
// at which ranks, and who heals whom. A pure function of its input, so the
// rules are testable alone; Membership calls it whenever a generation ends
// (and while it waits for enough workers).
//
// Rules, with S the shard degree (it never changes) and R the job's replicas:
// - A "holder" is a worker whose state (parameters and optimizer state of one
//   shard index) is that of the last committed step: a member of the ended
//   generation that trained in it (or healed and then committed a step).
//   Everyone else — standby survivors, joiners — must be healed.
// - Before any step was committed there is no state to lose: every worker
//   builds the initial state itself, so any worker can take any place and
//   nobody is healed.
// - Once a step was committed, every shard index needs a holder; a shard index
//   without one has no live copy: the generation cannot be formed
//   (kNoLiveCopy).
// - The generation has R' complete replica groups, R' the largest value <= R
//   for which the holders and the workers to heal fill every place (each
//   group needs one worker per shard index; a holder only fits its own shard
//   index, a worker to heal fits any). R' < min_replicas is kTooFewReplicas.
// - Groups of the ended generation that survive whole stay together and come
//   first (in their old order); the remaining groups take, per shard index,
//   the remaining holders first (in their old rank order), then workers to
//   heal in the candidates' order. Ranks are replica index * S + shard index.
// - A place filled by choice (any place before a commit; one for a worker to
//   heal after) takes, of the workers its turn allows (those whose last
//   shard index it is, else those never placed, else any), the first one on
//   a host of the group's ranks placed so far, else the first: a shard group
//   is meant to lie inside one host (ShardGroupsAcrossHosts names those that
//   do not).
// - Roles: holders TRAIN; workers placed without the state are HEAL_TARGETs;
//   every holder of a shard index that has targets is a HEAL_SOURCE, and the
//   targets read one part from each of them (see worker/comm/heal.h).
// - Everyone else stands by: holders beyond R' (they go stale once the new
//   generation commits) and workers to heal for whom no group completes.
#ifndef HSDP_COORDINATOR_CORE_GENERATION_PLAN_H_
#define HSDP_COORDINATOR_CORE_GENERATION_PLAN_H_

#include <cstdint>
#include <string>
#include <vector>

#include "hsdp/v1/common.pb.h"

namespace hsdp::coordinator {

struct FormationCandidate {
  int64_t worker_id = 0;
  // Shard index of the state this worker holds (as of the last committed
  // step); -1: none.
  int holder_shard = -1;
  // Replica index and rank in the generation that just ended; -1 when it was
  // not a member.
  int previous_replica = -1;
  int previous_rank = -1;
  // Shard index of its last membership, -1 when none: a worker placed at
  // another shard index must lay its shards out anew (the worker refuses),
  // so it is placed there whenever it can be.
  int last_shard = -1;
  // Its host; empty when unknown.
  std::string hostname;
};

struct FormationInput {
  int shard = 1;
  int max_replicas = 1;
  int min_replicas = 1;
  // A step was committed: workers without the state must be healed, and a
  // shard index nobody holds is lost.
  bool state_exists = false;
  // The live workers to place, in order of preference: members of the ended
  // generation, then standby workers, then joiners.
  std::vector<FormationCandidate> candidates;
};

enum class FormationOutcome { kFormed, kTooFewReplicas, kNoLiveCopy };

// Value type.
struct GenerationPlan {
  FormationOutcome outcome = FormationOutcome::kTooFewReplicas;
  int replicas = 0;
  // By rank (replicas * shard entries) when formed.
  std::vector<int64_t> members;
  std::vector<hsdp::v1::GenerationRole> roles;
  // One per shard index with targets, by shard index.
  std::vector<hsdp::v1::HealPlan> heal_plans;
  // Candidates left out, in candidate order.
  std::vector<int64_t> standby;
  // kNoLiveCopy: the first shard index without a holder.
  int lost_shard = -1;
  // Why it was not formed, for operators.
  std::string message;
};

GenerationPlan PlanGeneration(const FormationInput& input);

// One line per shard group (ranks [k*S, (k+1)*S), S = `shard`) whose workers
// run on more than one host, e.g. "shard group 1 spans hosts a, b (its
// all-gathers cross the host link)", hosts in rank order. Such a generation
// trains, but HSDP keeps each shard group inside one host because its
// all-gathers and reduce-scatters run every unit, every step; only the
// replicate groups are meant to cross hosts. `hosts_by_rank` holds one
// hostname per rank; an empty one (unknown, or a free rank) is left out.
std::vector<std::string> ShardGroupsAcrossHosts(
    int shard, const std::vector<std::string>& hosts_by_rank);

}  // namespace hsdp::coordinator

#endif  // HSDP_COORDINATOR_CORE_GENERATION_PLAN_H_
