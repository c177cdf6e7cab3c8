// The engine's ways to move a unit's bytes give the same bits: the flat path
// (copy-in to one flat buffer, AllGather / ReduceScatter, copy-out; what NCCL
// takes) and the segments path (AllGatherSegments / ReduceScatterSegments
// straight into parameter storage) over either CPU transport — shared memory
// (what every other CPU test takes) and Gloo TCP (ranks on different hosts).
// FlatOnlyCommunicator hides the segment support of the same communicators;
// GPT training on each mesh must give bitwise identical losses and final
// parameters all three ways, with comm fusion as without.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "hsdp/device_mesh.h"
#include "hsdp/fully_shard.h"
#include "hsdp/models/gpt.h"
#include "tests/worker/fsdp/fsdp_test_util.h"
#include "worker/models/gpt_setup.h"

namespace hsdp::fsdp::testing {
namespace {

constexpr uint64_t kSeed = 17;
constexpr int kGlobalBatch = 8;
constexpr int64_t kFuseAll = int64_t{1} << 30;

// Uneven over 2 and 4 shards: tok_emb and head have 37 rows, qkv 30, fc 18, the
// LayerNorms 10; pos_emb's 6 rows are uneven over 4.
models::GptConfig UnevenGpt() {
  models::GptConfig c;
  c.name = "gpt-custom";
  c.vocab_size = 37;
  c.d_model = 10;
  c.n_layers = 2;
  c.n_heads = 2;
  c.seq_len = 6;
  c.d_ff = 18;
  return c;
}

std::pair<at::Tensor, at::Tensor> GptBatch(const models::GptConfig& config,
                                           int step, int begin, int count) {
  at::Tensor t = torch::empty({count, config.seq_len + 1}, torch::kLong);
  auto acc = t.accessor<int64_t, 2>();
  for (int b = 0; b < count; ++b) {
    for (int64_t i = 0; i <= config.seq_len; ++i) {
      acc[b][i] = ((begin + b) * 31 + i * 7 + step * 13 + (begin + b) * i) %
                  config.vocab_size;
    }
  }
  return {t.narrow(1, 0, config.seq_len).contiguous(),
          t.narrow(1, 1, config.seq_len).contiguous()};
}

struct Policy {
  std::string name;
  RunConfig config;  // only the policy fields, steps, microbatches and lr
};

std::vector<Policy> Policies() {
  std::vector<Policy> out;
  RunConfig base;
  base.steps = 3;
  out.push_back({"default", base});
  {
    RunConfig c = base;
    c.reshard_after_forward = false;
    c.prefetch = 1;
    out.push_back({"keep_after_forward_prefetch1", c});
  }
  {
    RunConfig c = base;
    c.mixed_precision.param_dtype = torch::kBFloat16;
    c.mixed_precision.reduce_dtype = torch::kFloat;
    c.mixed_precision.output_dtype = torch::kFloat;
    out.push_back({"bf16_params_fp32_reduce", c});
  }
  {
    // Gradient accumulation: the first microbatch keeps unsharded grads (no
    // sync), the last reduces; HSDP all-reduce only then.
    RunConfig c = base;
    c.microbatches = 2;
    c.sync_every_microbatch = false;
    c.all_reduce_every_microbatch = false;
    c.reshard_after_backward = false;
    c.prefetch = 2;
    out.push_back({"no_sync_microbatch_prefetch2", c});
  }
  {
    // Comm fusion, every unit in one group; then with the no-sync policy.
    RunConfig c = base;
    c.comm_fusion_bucket_bytes = kFuseAll;
    out.push_back({"fused", c});
    c = out[3].config;
    c.comm_fusion_bucket_bytes = kFuseAll;
    out.push_back({"fused_no_sync_microbatch_prefetch2", c});
  }
  return out;
}

// Policies() pairs that differ in comm fusion only: the same bits.
constexpr std::pair<int, int> kFusedTwins[] = {{0, 4}, {3, 5}};

struct GptRun {
  std::vector<double> losses;  // this rank's loss per step
  StateDict params;            // final full parameters (global rank 0 only)
};

GptRun TrainGpt(const models::GptConfig& model_config, MeshComms comms,
                int dp_rank, int dp_size, const RunConfig& config) {
  GptRun result;
  models::Gpt gpt(model_config, kSeed);
  absl::StatusOr<std::unique_ptr<Engine>> created =
      models::ShardGpt(gpt, comms, EngineOptionsFor(config));
  EXPECT_TRUE(created.ok()) << created.status();
  if (!created.ok()) return result;
  std::unique_ptr<Engine> engine = std::move(*created);
  torch::optim::AdamW optimizer(engine->Parameters(),
                                torch::optim::AdamWOptions(config.lr));
  const hsdp::v1::StepSchedule schedule = PlanSchedule(*engine, config);
  const int local = kGlobalBatch / dp_size;
  const int per_mb = local / config.microbatches;
  for (int step = 0; step < config.steps; ++step) {
    double step_loss = 0;
    for (int mb = 0; mb < config.microbatches; ++mb) {
      absl::Status s = engine->Apply(schedule, mb);
      EXPECT_TRUE(s.ok()) << s;
      // Not a structured binding: the loss lambda captures `targets`.
      const auto batch =
          GptBatch(model_config, step, dp_rank * local + mb * per_mb, per_mb);
      const at::Tensor& tokens = batch.first;
      const at::Tensor& targets = batch.second;
      at::Tensor loss =
          engine->Root().Forward(tokens, [&](const at::Tensor& t) {
            return gpt->Loss(t, targets) /
                   static_cast<double>(config.microbatches);
          });
      loss.backward();
      step_loss += loss.item<double>();
    }
    optimizer.step();
    optimizer.zero_grad();
    result.losses.push_back(step_loss);
  }
  EXPECT_TRUE(engine->status().ok()) << engine->status();
  absl::StatusOr<StateDict> full = FullStateDict(*engine);
  EXPECT_TRUE(full.ok()) << full.status();
  if (full.ok()) result.params = *full;
  gpt->set_block_runner(nullptr);
  return result;
}

// Names every tensor that differs, with its max |a - b| and element count.
std::string DescribeDifferences(const StateDict& a, const StateDict& b) {
  std::ostringstream out;
  for (const auto& [name, t] : a) {
    auto it = b.find(name);
    if (it == b.end()) {
      out << "\n  " << name << ": missing";
      continue;
    }
    if (it->second.sizes() != t.sizes()) {
      out << "\n  " << name << ": shape " << t.sizes() << " vs "
          << it->second.sizes();
      continue;
    }
    if (torch::equal(t, it->second)) continue;
    const at::Tensor diff =
        (t.to(torch::kDouble) - it->second.to(torch::kDouble)).abs();
    out << "\n  " << name << ": max |diff| " << diff.max().item<double>()
        << ", " << diff.ne(0).sum().item<int64_t>() << " of " << t.numel()
        << " elements differ";
  }
  for (const auto& [name, t] : b) {
    if (a.find(name) == a.end()) out << "\n  " << name << ": extra";
  }
  return out.str();
}

class FlatPathTest : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(FlatPathTest, FlatEqualsSegmentsBitwise) {
  const comm::MeshShape shape{std::get<0>(GetParam()), std::get<1>(GetParam())};
  ASSERT_GT(shape.shard, 1) << "both paths are only taken with shard size > 1";
  const models::GptConfig model_config = UnevenGpt();
  const std::vector<Policy> policies = Policies();
  StateDict initial;
  for (const auto& item :
       models::Gpt(model_config, kSeed)->named_parameters()) {
    initial[item.key()] = item.value().detach().clone();
  }
  // [policy][rank]
  std::vector<std::vector<GptRun>> segments(
      policies.size(), std::vector<GptRun>(shape.world_size()));
  std::vector<std::vector<GptRun>> flat = segments, tcp = segments;
  RunOnMesh(shape, [&](RankContext& ctx) {
    // The real communicators take the segments path...
    EXPECT_TRUE(ctx.mesh->shard().SupportsSegments());
    EXPECT_EQ(ctx.mesh->shard().name().rfind("shm+", 0), 0u);
    for (size_t i = 0; i < policies.size(); ++i) {
      segments[i][ctx.rank] = TrainGpt(model_config, ctx.comms(), ctx.rank,
                                       shape.world_size(), policies[i].config);
      // ...the wrapped ones the flat path.
      FlatOnlyCommunicator shard(&ctx.mesh->shard());
      FlatOnlyCommunicator replicate(&ctx.mesh->replicate());
      flat[i][ctx.rank] =
          TrainGpt(model_config, MeshComms{&shard, &replicate}, ctx.rank,
                   shape.world_size(), policies[i].config);
      EXPECT_EQ(shard.segment_calls(), 0) << policies[i].name;
      EXPECT_GT(shard.all_gathers(), 0) << policies[i].name;
      EXPECT_GT(shard.reduce_scatters(), 0) << policies[i].name;
      if (shape.replicate > 1) {
        EXPECT_GT(replicate.all_reduces(), 0);
      }
    }
  });
  // The segments path over Gloo TCP only.
  RunOnMesh(
      shape,
      [&](RankContext& ctx) {
        EXPECT_EQ(ctx.mesh->shard().name(), "gloo:shard");
        for (size_t i = 0; i < policies.size(); ++i) {
          tcp[i][ctx.rank] = TrainGpt(model_config, ctx.comms(), ctx.rank,
                                      shape.world_size(), policies[i].config);
        }
      },
      absl::Seconds(30), /*shared_memory=*/false);
  for (size_t i = 0; i < policies.size(); ++i) {
    SCOPED_TRACE(policies[i].name);
    for (int r = 0; r < shape.world_size(); ++r) {
      const std::vector<double>& seg = segments[i][r].losses;
      const std::vector<double>& fl = flat[i][r].losses;
      const std::vector<double>& tc = tcp[i][r].losses;
      ASSERT_EQ(seg.size(), fl.size());
      ASSERT_EQ(seg.size(), tc.size());
      for (size_t s = 0; s < seg.size(); ++s) {
        // EXPECT_EQ on doubles: exact.
        EXPECT_EQ(fl[s], seg[s])
            << "rank " << r << " step " << s << " diff " << (fl[s] - seg[s]);
        EXPECT_EQ(tc[s], seg[s]) << "Gloo TCP, rank " << r << " step " << s
                                 << " diff " << (tc[s] - seg[s]);
      }
    }
    const StateDict& seg = segments[i][0].params;
    const StateDict& fl = flat[i][0].params;
    const StateDict& tc = tcp[i][0].params;
    ASSERT_FALSE(seg.empty());
    EXPECT_TRUE(BitwiseEqual(fl, seg)) << DescribeDifferences(fl, seg);
    EXPECT_TRUE(BitwiseEqual(tc, seg)) << DescribeDifferences(tc, seg);
    // It trained (else equality would be vacuous).
    EXPECT_GT(MaxAbsDiff(seg, initial), 1e-4);
    EXPECT_NE(segments[i][0].losses.front(), segments[i][0].losses.back());
  }
  // Mixed precision really ran in bf16: not the fp32 run's numbers.
  EXPECT_FALSE(BitwiseEqual(segments[2][0].params, segments[0][0].params));
  // Comm fusion changed no bit on any path (the flat path fuses its
  // reduce-scatters up to two shards, its all-gathers always).
  for (const auto& [plain, fused] : kFusedTwins) {
    SCOPED_TRACE(policies[fused].name);
    for (const auto* path : {&segments, &flat, &tcp}) {
      for (int r = 0; r < shape.world_size(); ++r) {
        EXPECT_EQ((*path)[fused][r].losses, (*path)[plain][r].losses)
            << "rank " << r;
      }
      EXPECT_TRUE(
          BitwiseEqual((*path)[fused][0].params, (*path)[plain][0].params));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Meshes, FlatPathTest,
                         ::testing::Values(std::make_tuple(1, 2),
                                           std::make_tuple(2, 2),
                                           std::make_tuple(1, 4)),
                         [](const auto& info) {
                           return absl::StrCat(std::get<0>(info.param), "x",
                                               std::get<1>(info.param));
                         });

}  // namespace
}  // namespace hsdp::fsdp::testing
