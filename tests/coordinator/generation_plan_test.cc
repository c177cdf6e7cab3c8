// PlanGeneration: who trains where, and who heals whom, from the live workers.
#include "coordinator/core/generation_plan.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace hsdp::coordinator {
namespace {

using hsdp::v1::GenerationRole;
constexpr GenerationRole kTrain = hsdp::v1::GENERATION_ROLE_TRAIN;
constexpr GenerationRole kSource = hsdp::v1::GENERATION_ROLE_HEAL_SOURCE;
constexpr GenerationRole kTarget = hsdp::v1::GENERATION_ROLE_HEAL_TARGET;

// A member of the ended generation at `rank` holding its shard's state.
FormationCandidate Holder(int64_t id, int rank, int shard) {
  FormationCandidate c;
  c.worker_id = id;
  c.holder_shard = rank % shard;
  c.previous_replica = rank / shard;
  c.previous_rank = rank;
  return c;
}
// A worker without the state (standby or joining).
FormationCandidate Fresh(int64_t id) {
  FormationCandidate c;
  c.worker_id = id;
  return c;
}

FormationInput Input(int shard, int max_replicas, bool state,
                     std::vector<FormationCandidate> candidates,
                     int min_replicas = 1) {
  FormationInput input;
  input.shard = shard;
  input.max_replicas = max_replicas;
  input.min_replicas = min_replicas;
  input.state_exists = state;
  input.candidates = std::move(candidates);
  return input;
}

std::vector<int> Ranks(const google::protobuf::RepeatedField<int32_t>& r) {
  return std::vector<int>(r.begin(), r.end());
}

TEST(GenerationPlanTest, SurvivingWholeGroupsKeepTogetherAndComeFirst) {
  // 3x2; rank 1 (group 0) was lost: groups 1 and 2 survive whole, worker 10
  // (rank 0) is a surplus holder.
  const GenerationPlan plan = PlanGeneration(
      Input(2, 3, true,
            {Holder(10, 0, 2), Holder(12, 2, 2), Holder(13, 3, 2),
             Holder(14, 4, 2), Holder(15, 5, 2)}));
  ASSERT_EQ(plan.outcome, FormationOutcome::kFormed);
  EXPECT_EQ(plan.replicas, 2);
  EXPECT_EQ(plan.members, (std::vector<int64_t>{12, 13, 14, 15}));
  EXPECT_EQ(plan.roles,
            (std::vector<GenerationRole>{kTrain, kTrain, kTrain, kTrain}));
  EXPECT_TRUE(plan.heal_plans.empty());
  EXPECT_EQ(plan.standby, (std::vector<int64_t>{10}));
}

TEST(GenerationPlanTest, IncompleteGroupsAreFilledWithWorkersToHeal) {
  // 2x3: group 1 lost ranks 3 and 5; two fresh workers complete it.
  const GenerationPlan plan =
      PlanGeneration(Input(3, 2, true,
                           {Holder(1, 0, 3), Holder(2, 1, 3), Holder(3, 2, 3),
                            Holder(5, 4, 3), Fresh(20), Fresh(21), Fresh(22)}));
  ASSERT_EQ(plan.outcome, FormationOutcome::kFormed);
  EXPECT_EQ(plan.replicas, 2);
  // Group 0 whole; group 1: holder 5 keeps shard 1, 20 and 21 heal 0 and 2.
  EXPECT_EQ(plan.members, (std::vector<int64_t>{1, 2, 3, 20, 5, 21}));
  // Shard 1 needs no healing: its holders just train.
  EXPECT_EQ(plan.roles,
            (std::vector<GenerationRole>{kSource, kTrain, kSource, kTarget,
                                         kTrain, kTarget}));
  ASSERT_EQ(plan.heal_plans.size(), 2u);
  EXPECT_EQ(plan.heal_plans[0].shard_index(), 0);
  EXPECT_EQ(Ranks(plan.heal_plans[0].source_ranks()), (std::vector<int>{0}));
  EXPECT_EQ(Ranks(plan.heal_plans[0].target_ranks()), (std::vector<int>{3}));
  EXPECT_EQ(plan.heal_plans[1].shard_index(), 2);
  EXPECT_EQ(Ranks(plan.heal_plans[1].source_ranks()), (std::vector<int>{2}));
  EXPECT_EQ(Ranks(plan.heal_plans[1].target_ranks()), (std::vector<int>{5}));
  EXPECT_EQ(plan.standby, (std::vector<int64_t>{22}));
}

// Workers to heal go back to their last shard index where they can (their
// engines are cut for it), although standby workers come before joiners; one
// never placed takes what is left.
TEST(GenerationPlanTest, WorkersToHealGoBackToTheirLastShard) {
  FormationCandidate standby = Fresh(30);  // was at shard 1, holds no state
  standby.last_shard = 1;
  const GenerationPlan plan = PlanGeneration(Input(
      2, 2, true, {Holder(1, 0, 2), Holder(2, 1, 2), standby, Fresh(20)}));
  ASSERT_EQ(plan.outcome, FormationOutcome::kFormed);
  EXPECT_EQ(plan.members, (std::vector<int64_t>{1, 2, 20, 30}));
  EXPECT_EQ(plan.roles,
            (std::vector<GenerationRole>{kSource, kSource, kTarget, kTarget}));
}

TEST(GenerationPlanTest, TargetsReadFromEveryHolderOfTheirShard) {
  // 3x1: two holders, one fresh worker: it heals from both.
  const GenerationPlan plan = PlanGeneration(
      Input(1, 3, true, {Holder(1, 0, 1), Holder(2, 1, 1), Fresh(9)}));
  ASSERT_EQ(plan.outcome, FormationOutcome::kFormed);
  EXPECT_EQ(plan.members, (std::vector<int64_t>{1, 2, 9}));
  ASSERT_EQ(plan.heal_plans.size(), 1u);
  EXPECT_EQ(Ranks(plan.heal_plans[0].source_ranks()), (std::vector<int>{0, 1}));
  EXPECT_EQ(Ranks(plan.heal_plans[0].target_ranks()), (std::vector<int>{2}));
}

TEST(GenerationPlanTest, ShardWithoutHolderHasNoLiveCopy) {
  const GenerationPlan plan = PlanGeneration(
      Input(2, 2, true, {Holder(1, 0, 2), Holder(3, 2, 2), Fresh(7)}));
  EXPECT_EQ(plan.outcome, FormationOutcome::kNoLiveCopy);
  EXPECT_EQ(plan.lost_shard, 1);
  EXPECT_NE(plan.message.find("shard 1"), std::string::npos) << plan.message;
  EXPECT_TRUE(plan.members.empty());
}

TEST(GenerationPlanTest, FewerGroupsThanTheMinimumIsNotFormed) {
  const GenerationPlan plan = PlanGeneration(Input(
      2, 2, true, {Holder(1, 0, 2), Holder(2, 1, 2), Holder(3, 2, 2)}, 2));
  EXPECT_EQ(plan.outcome, FormationOutcome::kTooFewReplicas);
  EXPECT_EQ(plan.replicas, 1);
  EXPECT_NE(plan.message.find("at least 2"), std::string::npos) << plan.message;
}

TEST(GenerationPlanTest, WithoutStateAnyWorkerTakesAnyPlace) {
  // No step committed: former members first by rank, then the rest in order;
  // nobody heals.
  FormationCandidate late_member = Holder(4, 3, 2);
  const GenerationPlan plan = PlanGeneration(
      Input(2, 2, false, {Fresh(8), late_member, Holder(1, 0, 2), Fresh(9)}));
  ASSERT_EQ(plan.outcome, FormationOutcome::kFormed);
  EXPECT_EQ(plan.replicas, 2);
  EXPECT_EQ(plan.members, (std::vector<int64_t>{1, 4, 8, 9}));
  for (GenerationRole role : plan.roles) EXPECT_EQ(role, kTrain);
  EXPECT_TRUE(plan.heal_plans.empty());
  // Too few for one group.
  EXPECT_EQ(PlanGeneration(Input(2, 2, false, {Fresh(1)})).outcome,
            FormationOutcome::kTooFewReplicas);
}

TEST(GenerationPlanTest, NeverMoreGroupsThanTheMesh) {
  std::vector<FormationCandidate> many = {Holder(1, 0, 1)};
  for (int64_t id = 10; id < 20; ++id) many.push_back(Fresh(id));
  const GenerationPlan plan = PlanGeneration(Input(1, 3, true, many));
  EXPECT_EQ(plan.replicas, 3);
  EXPECT_EQ(plan.members, (std::vector<int64_t>{1, 10, 11}));
  EXPECT_EQ(plan.standby.size(), 8u);
}

FormationCandidate OnHost(FormationCandidate c, const std::string& host) {
  c.hostname = host;
  return c;
}

TEST(GenerationPlanTest, BeforeACommitEachGroupFillsFromOneHost) {
  const GenerationPlan plan =
      PlanGeneration(Input(2, 2, false,
                           {OnHost(Fresh(1), "a"), OnHost(Fresh(2), "b"),
                            OnHost(Fresh(3), "a"), OnHost(Fresh(4), "b")}));
  ASSERT_EQ(plan.outcome, FormationOutcome::kFormed);
  EXPECT_EQ(plan.members, (std::vector<int64_t>{1, 3, 2, 4}));
}

TEST(GenerationPlanTest, WorkersToHealGoToAGroupOnTheirHost) {
  // Group 0 (host a) survives whole; group 1 lost rank 3 and keeps rank 2 on
  // host b: of the two fresh workers, the one on b heals rank 3.
  const std::vector<FormationCandidate> holders = {
      OnHost(Holder(1, 0, 2), "a"), OnHost(Holder(2, 1, 2), "a"),
      OnHost(Holder(3, 2, 2), "b")};
  std::vector<FormationCandidate> candidates = holders;
  candidates.push_back(OnHost(Fresh(5), "a"));
  candidates.push_back(OnHost(Fresh(6), "b"));
  GenerationPlan plan = PlanGeneration(Input(2, 2, true, candidates));
  ASSERT_EQ(plan.outcome, FormationOutcome::kFormed);
  EXPECT_EQ(plan.members, (std::vector<int64_t>{1, 2, 3, 6}));
  EXPECT_EQ(plan.standby, (std::vector<int64_t>{5}));
  // A worker's last shard index still comes before its host.
  candidates = holders;
  FormationCandidate returning = OnHost(Fresh(5), "a");
  returning.last_shard = 1;
  candidates.push_back(returning);
  candidates.push_back(OnHost(Fresh(6), "b"));
  plan = PlanGeneration(Input(2, 2, true, candidates));
  ASSERT_EQ(plan.outcome, FormationOutcome::kFormed);
  EXPECT_EQ(plan.members, (std::vector<int64_t>{1, 2, 3, 5}));
}

TEST(GenerationPlanTest, ShardGroupsAcrossHostsNamesEachGroupAndItsHosts) {
  EXPECT_TRUE(ShardGroupsAcrossHosts(2, {"a", "a", "b", "b"}).empty());
  // Unknown hosts (empty) are left out; hosts are listed in rank order.
  EXPECT_TRUE(ShardGroupsAcrossHosts(2, {"a", "", "", ""}).empty());
  EXPECT_EQ(ShardGroupsAcrossHosts(3, {"a", "a", "a", "c", "b", "c"}),
            (std::vector<std::string>{"shard group 1 spans hosts c, b (its "
                                      "all-gathers cross the host link)"}));
  // One shard group per rank never spans hosts.
  EXPECT_TRUE(ShardGroupsAcrossHosts(1, {"a", "b"}).empty());
}

}  // namespace
}  // namespace hsdp::coordinator
