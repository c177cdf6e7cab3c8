#include "coordinator/core/generation_plan.h"

#include <algorithm>
#include <map>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace hsdp::coordinator {
namespace {

using hsdp::v1::GenerationRole;

// Places `members` (by rank) and fills the rest of the plan from it.
void Finish(const FormationInput& input, const std::vector<int>& placed,
            const std::vector<bool>& healed, GenerationPlan& plan) {
  const int s = input.shard;
  plan.outcome = FormationOutcome::kFormed;
  std::set<int> used;
  for (size_t rank = 0; rank < placed.size(); ++rank) {
    plan.members.push_back(input.candidates[placed[rank]].worker_id);
    plan.roles.push_back(healed[rank] ? hsdp::v1::GENERATION_ROLE_HEAL_TARGET
                                      : hsdp::v1::GENERATION_ROLE_TRAIN);
    used.insert(placed[rank]);
  }
  for (int index = 0; index < s; ++index) {
    hsdp::v1::HealPlan heal;
    heal.set_shard_index(index);
    for (size_t rank = index; rank < placed.size(); rank += s) {
      if (healed[rank]) {
        heal.add_target_ranks(static_cast<int32_t>(rank));
      } else {
        heal.add_source_ranks(static_cast<int32_t>(rank));
      }
    }
    if (heal.target_ranks().empty()) continue;
    for (int rank : heal.source_ranks()) {
      plan.roles[rank] = hsdp::v1::GENERATION_ROLE_HEAL_SOURCE;
    }
    plan.heal_plans.push_back(std::move(heal));
  }
  for (size_t c = 0; c < input.candidates.size(); ++c) {
    if (used.count(static_cast<int>(c)) == 0) {
      plan.standby.push_back(input.candidates[c].worker_id);
    }
  }
}

// The hosts of the ranks of the group being filled (the last, incomplete
// group of `placed`, candidate indices by rank).
std::vector<std::string> GroupHosts(const FormationInput& input,
                                    const std::vector<int>& placed) {
  std::vector<std::string> hosts;
  const size_t start = placed.size() - placed.size() % input.shard;
  for (size_t rank = start; rank < placed.size(); ++rank) {
    const std::string& host = input.candidates[placed[rank]].hostname;
    if (!host.empty()) hosts.push_back(host);
  }
  return hosts;
}

// The next of `pool` (candidate indices, in preference order) not taken yet
// for shard index `index`: one whose last shard it was, else one never
// placed, else any; within each, one on a host of `group_hosts` first. -1
// when none is left.
int TakeFor(const FormationInput& input, const std::vector<int>& pool,
            int index, const std::vector<std::string>& group_hosts,
            std::set<int>& taken) {
  auto on_group_host = [&](int c) {
    const std::string& host = input.candidates[c].hostname;
    return !host.empty() && std::find(group_hosts.begin(), group_hosts.end(),
                                      host) != group_hosts.end();
  };
  int chosen = -1;
  for (int pass = 0; pass < 3 && chosen < 0; ++pass) {
    for (int c : pool) {
      if (taken.count(c) > 0) continue;
      const int last = input.candidates[c].last_shard;
      if (pass == 2 || (pass == 0 && last == index) ||
          (pass == 1 && last < 0)) {
        if (chosen < 0) chosen = c;
        if (on_group_host(c)) {
          chosen = c;
          break;
        }
      }
    }
  }
  if (chosen >= 0) taken.insert(chosen);
  return chosen;
}

// Before any commit: the first R' * S candidates, in order (members of the
// ended generation by their old rank first), all training.
GenerationPlan PlanWithoutState(const FormationInput& input) {
  GenerationPlan plan;
  const int n = static_cast<int>(input.candidates.size());
  plan.replicas = std::min(input.max_replicas, n / input.shard);
  if (plan.replicas < std::max(1, input.min_replicas)) {
    plan.message = absl::StrCat(n, " live worker(s) make ", plan.replicas,
                                " replica group(s) of ", input.shard,
                                "; the job needs at least ",
                                std::max(1, input.min_replicas));
    return plan;
  }
  std::vector<int> order(n);
  for (int c = 0; c < n; ++c) order[c] = c;
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    const int ra = input.candidates[a].previous_rank;
    const int rb = input.candidates[b].previous_rank;
    // Former members (rank >= 0) first, by rank; the rest keep their order.
    if ((ra >= 0) != (rb >= 0)) return ra >= 0;
    return ra >= 0 && ra < rb;
  });
  // Each at its last shard index where it can be (ranks r with r % S ==
  // index), the former members' order kept otherwise.
  std::vector<int> placed;
  std::set<int> taken;
  for (int r = 0; r < plan.replicas * input.shard; ++r) {
    placed.push_back(TakeFor(input, order, r % input.shard,
                             GroupHosts(input, placed), taken));
  }
  Finish(input, placed, std::vector<bool>(placed.size(), false), plan);
  return plan;
}

}  // namespace

GenerationPlan PlanGeneration(const FormationInput& input) {
  if (!input.state_exists) return PlanWithoutState(input);
  const int s = input.shard;
  GenerationPlan plan;
  // Holders per shard index, by old rank; the others (to heal) in order.
  std::vector<std::vector<int>> holders(s);
  std::vector<int> to_heal;
  for (int c = 0; c < static_cast<int>(input.candidates.size()); ++c) {
    const int h = input.candidates[c].holder_shard;
    if (h >= 0 && h < s) {
      holders[h].push_back(c);
    } else {
      to_heal.push_back(c);
    }
  }
  for (auto& list : holders) {
    std::stable_sort(list.begin(), list.end(), [&](int a, int b) {
      return input.candidates[a].previous_rank <
             input.candidates[b].previous_rank;
    });
  }
  for (int index = 0; index < s; ++index) {
    if (holders[index].empty()) {
      plan.outcome = FormationOutcome::kNoLiveCopy;
      plan.lost_shard = index;
      plan.message = absl::StrCat("no live worker holds the state of shard ",
                                  index, " (every replica of it was lost)");
      return plan;
    }
  }
  // The largest R' the holders and workers to heal can fill.
  int replicas = 0;
  for (int r = 1; r <= input.max_replicas; ++r) {
    size_t missing = 0;
    for (const auto& list : holders) {
      missing += list.size() < static_cast<size_t>(r) ? r - list.size() : 0;
    }
    if (missing > to_heal.size()) break;
    replicas = r;
  }
  plan.replicas = replicas;
  if (replicas < std::max(1, input.min_replicas)) {
    plan.message =
        absl::StrCat("the live workers make ", replicas,
                     " complete replica group(s); the job needs at least ",
                     std::max(1, input.min_replicas));
    return plan;
  }

  // Whole surviving groups first, in their old order.
  std::vector<int> placed;  // candidate index by rank
  std::vector<bool> healed;
  std::set<int> taken;
  std::map<int, std::vector<int>> old_groups;  // old replica -> candidates
  for (int c = 0; c < static_cast<int>(input.candidates.size()); ++c) {
    const FormationCandidate& p = input.candidates[c];
    if (p.previous_replica >= 0 && p.holder_shard >= 0) {
      old_groups[p.previous_replica].push_back(c);
    }
  }
  for (const auto& [replica, members] : old_groups) {
    if (static_cast<int>(placed.size()) / s >= replicas) break;
    std::vector<int> by_shard(s, -1);
    for (int c : members) by_shard[input.candidates[c].holder_shard] = c;
    if (std::count(by_shard.begin(), by_shard.end(), -1) > 0) continue;
    for (int c : by_shard) {
      placed.push_back(c);
      healed.push_back(false);
      taken.insert(c);
    }
  }
  // Then the other groups: remaining holders first, then workers to heal,
  // each at its last shard index where it can be.
  while (static_cast<int>(placed.size()) / s < replicas) {
    for (int index = 0; index < s; ++index) {
      int chosen = -1;
      for (int c : holders[index]) {
        if (taken.count(c) == 0) {
          chosen = c;
          break;
        }
      }
      const bool heal = chosen < 0;
      if (heal) {
        chosen =
            TakeFor(input, to_heal, index, GroupHosts(input, placed), taken);
      } else {
        taken.insert(chosen);
      }
      placed.push_back(chosen);
      healed.push_back(heal);
    }
  }
  Finish(input, placed, healed, plan);
  return plan;
}

std::vector<std::string> ShardGroupsAcrossHosts(
    int shard, const std::vector<std::string>& hosts_by_rank) {
  std::vector<std::string> warnings;
  if (shard < 1) return warnings;
  const int world = static_cast<int>(hosts_by_rank.size());
  for (int group = 0; group * shard < world; ++group) {
    std::vector<std::string> hosts;
    for (int rank = group * shard; rank < std::min(world, (group + 1) * shard);
         ++rank) {
      const std::string& host = hosts_by_rank[rank];
      if (host.empty()) continue;
      if (std::find(hosts.begin(), hosts.end(), host) == hosts.end()) {
        hosts.push_back(host);
      }
    }
    if (hosts.size() < 2) continue;
    warnings.push_back(absl::StrCat("shard group ", group, " spans hosts ",
                                    absl::StrJoin(hosts, ", "),
                                    " (its all-gathers cross the host link)"));
  }
  return warnings;
}

}  // namespace hsdp::coordinator
