// HealShardState: a target replica that holds nothing (a fresh optimizer) or a
// stale state ends bitwise equal to the sources — parameters, optimizer state
// tensors, step counters — and the next optimizer step gives the same result
// on every replica. Ranks are threads over loopback Gloo.
#include "worker/train/shard_state.h"

#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/torch.h>

#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "tests/worker/comm/comm_test_util.h"
#include "worker/ckpt/state.h"
#include "worker/comm/store/in_memory_store.h"

namespace hsdp::train {
namespace {

using ::hsdp::comm::testing::MakeBackendGroup;
using ::hsdp::comm::testing::RunOnRanks;

constexpr absl::Duration kTimeout = absl::Seconds(60);
constexpr int kWorld = 3;

// One replica: parameter shards (as an engine holds them: leaves, one of them
// strided) and an optimizer over them.
struct Replica {
  std::vector<at::Tensor> params;
  std::unique_ptr<torch::optim::Optimizer> opt;
};

std::vector<at::Tensor> MakeParams(uint64_t seed) {
  torch::manual_seed(seed);
  return {torch::randn({7, 5}).requires_grad_(),
          torch::randn({13}).requires_grad_(),
          torch::randn({3, 2, 2}).requires_grad_(),
          // A shard on dim 1 as the engine holds it: the valid rows of its
          // row frame, moved back to the parameter's orientation (strided).
          torch::randn({4, 6}).narrow(0, 0, 3).t().detach().requires_grad_()};
}

std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(
    const std::string& kind, const std::vector<at::Tensor>& params) {
  if (kind == "sgd") {
    return std::make_unique<torch::optim::SGD>(
        params, torch::optim::SGDOptions(0.1).momentum(0.9));
  }
  return std::make_unique<torch::optim::AdamW>(
      params,
      torch::optim::AdamWOptions(1e-2).amsgrad(kind == "adamw-amsgrad"));
}

// Deterministic gradients for step `step`, then the optimizer step.
void TrainStep(Replica& r, int step) {
  for (size_t i = 0; i < r.params.size(); ++i) {
    r.params[i].mutable_grad() =
        torch::full_like(r.params[i], 0.01 * (step + 1) * (i + 1)) +
        r.params[i].detach() * 0.1;
  }
  r.opt->step();
  r.opt->zero_grad();
}

class ShardStateTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ShardStateTest, TargetsEndBitwiseEqualAndTrainAlike) {
  comm::InMemoryStore store;
  std::vector<std::unique_ptr<comm::Communicator>> comms =
      MakeBackendGroup("gloo", store, "shard-state", kWorld, kTimeout);
  ASSERT_EQ(comms.size(), static_cast<size_t>(kWorld));
  std::vector<Replica> replicas(kWorld);
  for (int r = 0; r < kWorld; ++r) {
    // Sources 0 and 1 trained alike; target 2 is another init, untrained.
    replicas[r].params = MakeParams(r < 2 ? 1 : 99);
    replicas[r].opt = MakeOptimizer(GetParam(), replicas[r].params);
    if (r < 2) {
      for (int s = 0; s < 3; ++s) TrainStep(replicas[r], s);
    }
  }
  const uint32_t want = ShardStateCrc32c(replicas[0].params, *replicas[0].opt);
  EXPECT_EQ(ShardStateCrc32c(replicas[1].params, *replicas[1].opt), want);
  EXPECT_NE(ShardStateCrc32c(replicas[2].params, *replicas[2].opt), want);

  const comm::HealRoles roles{{0, 1}, {2}};
  RunOnRanks(kWorld, [&](int rank) {
    const absl::Status s = HealShardState(
        *comms[rank], roles, replicas[rank].params, *replicas[rank].opt);
    EXPECT_TRUE(s.ok()) << s;
  });
  EXPECT_EQ(ShardStateCrc32c(replicas[2].params, *replicas[2].opt), want);
  const auto target = ckpt::ParamStates(*replicas[2].opt, replicas[2].params);
  const auto source = ckpt::ParamStates(*replicas[0].opt, replicas[0].params);
  ASSERT_EQ(target.size(), source.size());
  for (size_t i = 0; i < target.size(); ++i) {
    EXPECT_TRUE(torch::equal(replicas[2].params[i], replicas[0].params[i]));
    EXPECT_EQ(target[i].present, source[i].present);
    EXPECT_EQ(target[i].step, source[i].step);
    EXPECT_EQ(target[i].amsgrad, source[i].amsgrad);
    ASSERT_EQ(target[i].tensors.size(), source[i].tensors.size());
    for (size_t k = 0; k < target[i].tensors.size(); ++k) {
      EXPECT_TRUE(torch::equal(target[i].tensors[k], source[i].tensors[k]));
    }
  }
  // The healed state is complete: the next step matches bitwise.
  for (Replica& r : replicas) TrainStep(r, 3);
  EXPECT_EQ(ShardStateCrc32c(replicas[2].params, *replicas[2].opt),
            ShardStateCrc32c(replicas[0].params, *replicas[0].opt));
}

INSTANTIATE_TEST_SUITE_P(Optimizers, ShardStateTest,
                         ::testing::Values("adamw", "adamw-amsgrad", "sgd"));

// Sources that never stepped have no optimizer state: a target's stale state
// (from an earlier membership) is dropped, not kept.
TEST(ShardStateStaleTest, StaleStateOfATargetIsDroppedWhenSourcesHaveNone) {
  comm::InMemoryStore store;
  std::vector<std::unique_ptr<comm::Communicator>> comms =
      MakeBackendGroup("gloo", store, "shard-state-stale", 2, kTimeout);
  ASSERT_EQ(comms.size(), 2u);
  std::vector<Replica> replicas(2);
  for (int r = 0; r < 2; ++r) {
    replicas[r].params = MakeParams(r == 0 ? 1 : 2);
    replicas[r].opt = MakeOptimizer("adamw", replicas[r].params);
  }
  TrainStep(replicas[1], 0);  // the target's stale state
  RunOnRanks(2, [&](int rank) {
    EXPECT_TRUE(HealShardState(*comms[rank], comm::HealRoles{{0}, {1}},
                               replicas[rank].params, *replicas[rank].opt)
                    .ok());
  });
  for (const ckpt::ParamState& s :
       ckpt::ParamStates(*replicas[1].opt, replicas[1].params)) {
    EXPECT_FALSE(s.present);
  }
  EXPECT_EQ(ShardStateCrc32c(replicas[1].params, *replicas[1].opt),
            ShardStateCrc32c(replicas[0].params, *replicas[0].opt));
}

}  // namespace
}  // namespace hsdp::train
