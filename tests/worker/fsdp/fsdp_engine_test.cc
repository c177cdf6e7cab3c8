// Single-process tests of the engine's pieces: shard layout, fused copy-in/out,
// storage free and process memory, API validation, ignored/frozen parameters,
// mixed-precision accounting.
#include <gtest/gtest.h>
#include <malloc.h>
#include <torch/torch.h>
#include <unistd.h>

#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "hsdp/fully_shard.h"
#include "tests/worker/fsdp/fsdp_test_util.h"
#include "worker/fsdp/collectives.h"
#include "worker/fsdp/sharded_param.h"

namespace hsdp::fsdp::testing {
namespace {

constexpr int64_t kStorageFreed = 0;

std::unique_ptr<ShardedParam> Shard(const at::Tensor& full, int rank,
                                    int size) {
  ShardedParamSpec spec;
  spec.shard_rank = rank;
  spec.shard_size = size;
  at::Tensor param = full.clone().set_requires_grad(true);
  absl::StatusOr<std::unique_ptr<ShardedParam>> p =
      ShardedParam::Create("w", param, spec);
  EXPECT_TRUE(p.ok()) << p.status();
  return std::move(*p);
}

TEST(ShardedParamTest, PaddedDimZeroLayout) {
  const at::Tensor full = torch::arange(33, torch::kFloat).reshape({11, 3});
  const std::vector<int64_t> expected_rows = {3, 3, 3, 2};
  for (int r = 0; r < 4; ++r) {
    std::unique_ptr<ShardedParam> p = Shard(full, r, 4);
    EXPECT_EQ(p->padded_rows_per_rank(), 3);
    EXPECT_EQ(p->valid_rows(), expected_rows[r]);
    EXPECT_EQ(p->row_offset(), 3 * r);
    EXPECT_TRUE(p->sharded().is_leaf());
    EXPECT_TRUE(p->sharded().requires_grad());
    EXPECT_TRUE(
        torch::equal(p->sharded(), full.narrow(0, 3 * r, expected_rows[r])));
    // Padding rows are zero and invisible to the optimizer.
    if (expected_rows[r] < 3) {
      EXPECT_EQ(p->sharded_padded()
                    .narrow(0, expected_rows[r], 1)
                    .abs()
                    .sum()
                    .item<float>(),
                0);
    }
  }
  // Fewer rows than shards: the last rank holds nothing.
  std::unique_ptr<ShardedParam> tiny = Shard(torch::ones({3}), 3, 4);
  EXPECT_EQ(tiny->valid_rows(), 0);
  EXPECT_EQ(tiny->sharded().numel(), 0);
}

TEST(ShardedParamTest, StorageFreedAndReallocatedUnderTheSameTensor) {
  std::unique_ptr<ShardedParam> p = Shard(torch::randn({11, 3}), 1, 2);
  const c10::TensorImpl* impl = p->module_param().unsafeGetTensorImpl();
  EXPECT_EQ(p->module_param().sizes(), (std::vector<int64_t>{11, 3}));
  EXPECT_EQ(static_cast<int64_t>(p->module_param().storage().nbytes()),
            kStorageFreed);
  p->AllocUnsharded();
  EXPECT_EQ(static_cast<int64_t>(p->module_param().storage().nbytes()),
            12 * 3 * 4);
  EXPECT_EQ(p->unsharded_bytes(), 12 * 3 * 4);
  p->FreeUnsharded();
  EXPECT_EQ(static_cast<int64_t>(p->module_param().storage().nbytes()),
            kStorageFreed);
  EXPECT_EQ(p->module_param().unsafeGetTensorImpl(), impl);
  EXPECT_TRUE(p->module_param().requires_grad());
}

TEST(CollectivesTest, CopyInOutAndReduceScatterLayoutRoundTrip) {
  constexpr int kSize = 4;
  const at::Tensor a = torch::randn({11, 3});
  const at::Tensor b = torch::randn({6});
  std::vector<std::vector<std::unique_ptr<ShardedParam>>> ranks(kSize);
  std::vector<at::Tensor> chunks;
  for (int r = 0; r < kSize; ++r) {
    ranks[r].push_back(Shard(a, r, kSize));
    ranks[r].push_back(Shard(b, r, kSize));
    std::vector<ShardedParam*> ps = {ranks[r][0].get(), ranks[r][1].get()};
    EXPECT_EQ(FlatChunkNumel(ps), 3 * 3 + 2);
    chunks.push_back(torch::empty({FlatChunkNumel(ps)}));
    AllGatherCopyIn(ps, chunks.back());
  }
  // What an all-gather would produce, copied out on rank 2.
  std::vector<ShardedParam*> ps = {ranks[2][0].get(), ranks[2][1].get()};
  for (ShardedParam* p : ps) p->AllocUnsharded();
  AllGatherCopyOut(torch::cat(chunks), ps);
  EXPECT_TRUE(torch::equal(ps[0]->module_param(), a));
  EXPECT_TRUE(torch::equal(ps[1]->module_param(), b));
  // Reduce-scatter input: chunk r holds rank r's rows of every gradient, zero
  // padded.
  ps[0]->module_param().mutable_grad() = a * 2;
  ps[1]->module_param().mutable_grad() = b * 3;
  const at::Tensor flat =
      torch::full({kSize * FlatChunkNumel(ps)}, 7.0, torch::kDouble);
  ReduceScatterCopyIn(ps, flat.view({kSize, -1}));
  for (int r = 0; r < kSize; ++r) {
    std::vector<ShardedParam*> rps = {ranks[r][0].get(), ranks[r][1].get()};
    std::vector<at::Tensor> pieces =
        SplitReducedChunk(flat.view({kSize, -1})[r], rps);
    EXPECT_TRUE(torch::equal(
        pieces[0].to(torch::kFloat),
        (a * 2).narrow(0, rps[0]->row_offset(), rps[0]->valid_rows())));
    EXPECT_TRUE(torch::equal(
        pieces[1].to(torch::kFloat),
        (b * 3).narrow(0, rps[1]->row_offset(), rps[1]->valid_rows())));
  }
  EXPECT_EQ(flat.view({kSize, -1})[3][3 * 3 - 3].item<double>(),
            0.0);  // a's padding row
}

int64_t ResidentBytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t size = 0, resident = 0;
  statm >> size >> resident;
  return resident * sysconf(_SC_PAGESIZE);
}

// Sizes for the memory test: blocks of ~3 MB, activations small next to them.
ModelDims BigBlocks() {
  ModelDims dims;
  dims.d_model = 256;
  dims.hidden = 1024;
  dims.heads = 4;
  dims.vocab = 11;
  dims.seq_len = 4;
  return dims;
}

TEST(MemoryTest, ReshardAfterForwardFreesProcessMemory) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  // The sanitizers replace malloc: mallopt does nothing, and ASan keeps freed
  // blocks in quarantine, so process RSS does not follow frees.
  GTEST_SKIP() << "RSS is not measurable under a sanitizer's allocator";
#endif
  // Large blocks straight from mmap and back, so RSS follows frees (no dynamic
  // threshold).
  constexpr int kMmapThreshold = 64 * 1024;
  ASSERT_EQ(mallopt(M_MMAP_THRESHOLD, kMmapThreshold), 1);
  constexpr int kShards =
      2;  // one shard would alias the shard: nothing to free
  RunConfig config;
  config.dims = BigBlocks();
  const StateDict init = MakeInitialState(config.dims, 20);
  int64_t rss_growth[2] = {0, 0};
  int64_t block_bytes = 0;
  RunOnMesh({1, kShards}, [&](RankContext& ctx) {
    // Both ranks share the process: measure between barriers, on rank 0.
    auto barrier = [&] {
      ASSERT_TRUE(ctx.mesh->shard().Barrier()->Wait().ok());
    };
    for (bool reshard : {true, false}) {
      RunConfig c = config;
      c.reshard_after_forward = reshard;
      TinyTransformer model = MakeModel(c.dims, init);
      std::unique_ptr<Engine> engine = MakeEngine(model, ctx.comms(), c);
      std::vector<UnitLayout> units = engine->Units();
      block_bytes = units[1].unsharded_bytes + units[2].unsharded_bytes;
      auto [tokens, targets] = Batch(c.dims, 0, ctx.rank * 2, 2);
      // Warm up first: one-time buffers (BLAS workspaces, pools) must not
      // count below.
      ASSERT_TRUE(engine->Apply(PlanSchedule(*engine, c), 0).ok());
      EngineForward(*engine, model, tokens, false).sum().backward();
      ASSERT_TRUE(engine->Apply(PlanSchedule(*engine, c), 0).ok());
      barrier();
      const int64_t before = ResidentBytes();
      at::Tensor logits = EngineForward(*engine, model, tokens, false);
      barrier();
      if (ctx.rank == 0) rss_growth[reshard ? 0 : 1] = ResidentBytes() - before;
      barrier();
      const EngineStats stats = engine->Stats();
      for (int u = 1; u <= 2; ++u) {
        EXPECT_EQ(stats.units[u].unsharded_bytes_alive,
                  reshard ? 0 : units[u].unsharded_bytes)
            << "unit " << u << " reshard " << reshard;
        EXPECT_EQ(stats.units[u].peak_unsharded_bytes,
                  units[u].unsharded_bytes);
      }
      logits.sum().backward();
      // The last backward reshards whatever the forward kept.
      EXPECT_EQ(engine->Stats().unsharded_bytes_alive, 0);
      EXPECT_GT(engine->Stats().grad_bytes, 0);
    }
  });
  ASSERT_GT(block_bytes, 4 << 20);
  // Keeping the blocks unsharded costs their bytes in RSS (on both ranks);
  // resharding gives them back.
  EXPECT_GT(rss_growth[1] - rss_growth[0], kShards * block_bytes * 8 / 10)
      << "growth with reshard " << rss_growth[0] << ", without "
      << rss_growth[1];
}

TEST(MemoryTest, OneShardAliasesTheShard) {
  RunConfig config;
  const StateDict init = MakeInitialState(config.dims, 24);
  RunOnMesh({1, 1}, [&](RankContext& ctx) {
    TinyTransformer model = MakeModel(config.dims, init);
    std::unique_ptr<Engine> engine = MakeEngine(model, ctx.comms(), config);
    const auto named = engine->NamedParameters();
    const auto module_params = model->named_parameters();
    for (const auto& [name, shard] : named) {
      // The module parameter reads the optimizer's shard in place: no copy.
      EXPECT_EQ(module_params[name].data_ptr(), shard.data_ptr()) << name;
    }
    auto [tokens, targets] = Batch(config.dims, 0, 0, 2);
    EngineForward(*engine, model, tokens, false).sum().backward();
    const EngineStats stats = engine->Stats();
    EXPECT_EQ(stats.peak_unsharded_bytes, 0);
    EXPECT_EQ(stats.peak_comm_buffer_bytes, 0);
    for (const auto& [name, shard] : named) {
      EXPECT_TRUE(shard.grad().defined()) << name;
    }
  });
}

TEST(EngineApiTest, RejectsBadSetUpAndSchedules) {
  RunConfig config;
  const StateDict init = MakeInitialState(config.dims, 21);
  RunOnMesh({1, 1}, [&](RankContext& ctx) {
    TinyTransformer model = MakeModel(config.dims, init);
    absl::StatusOr<std::unique_ptr<Engine>> engine =
        Engine::Create(model.ptr(), ctx.comms(), EngineOptions());
    ASSERT_TRUE(engine.ok());
    Engine& e = **engine;
    EXPECT_EQ(e.Apply(MakeSchedule(3, config), 0).code(),
              absl::StatusCode::kFailedPrecondition);
    ASSERT_TRUE(e.FullyShard({model->blocks[0].ptr()}, "layers.0").ok());
    EXPECT_EQ(
        e.FullyShard({model->blocks[1].ptr()}, "layers.0").status().code(),
        absl::StatusCode::kAlreadyExists);
    torch::nn::Linear stranger(2, 2);
    EXPECT_EQ(e.FullyShard({stranger.ptr()}, "stranger").status().code(),
              absl::StatusCode::kInvalidArgument);
    ASSERT_TRUE(e.FullyShard({model->blocks[1].ptr()}, "layers.1").ok());
    ASSERT_TRUE(e.FullyShardRoot().ok());
    EXPECT_EQ(e.FullyShard({model->blocks[1].ptr()}, "again").status().code(),
              absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(e.Apply(MakeSchedule(2, config), 0).code(),
              absl::StatusCode::kInvalidArgument);
    hsdp::v1::StepSchedule renamed = MakeSchedule(3, config);
    renamed.mutable_units(1)->set_unit_name("layers.7");
    absl::Status s = e.Apply(renamed, 0);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("layers.7"), std::string::npos) << s;
    hsdp::v1::StepSchedule bad_prefetch = MakeSchedule(3, config);
    bad_prefetch.mutable_units(0)->add_forward_prefetch(9);
    EXPECT_EQ(e.Apply(bad_prefetch, 0).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(e.Apply(MakeSchedule(3, config), 1).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(e.Apply(MakeSchedule(3, config), 0).ok());
    EXPECT_TRUE(e.status().ok());
  });
}

// A schedule's post_forward_group_size must divide the shard group, lie
// below it, and match the host group the engine was given: each refusal
// names the field; the engine goes on with a good schedule.
TEST(EngineApiTest, RejectsAHostGroupTheMeshDoesNotHave) {
  RunConfig config;
  const StateDict init = MakeInitialState(config.dims, 23);
  RunOnMesh(
      {1, 4},
      [&](RankContext& ctx) {
        TinyTransformer model = MakeModel(config.dims, init);
        std::unique_ptr<Engine> without = MakeEngine(
            model, MeshComms{&ctx.mesh->shard(), &ctx.mesh->replicate()},
            config);
        hsdp::v1::StepSchedule schedule = MakeSchedule(3, config);
        schedule.set_post_forward_group_size(2);
        absl::Status s = without->Apply(schedule, 0);
        EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
        EXPECT_NE(s.message().find("post_forward_group_size 2"),
                  std::string::npos)
            << s;
        EXPECT_TRUE(without->status().ok());
        TinyTransformer other = MakeModel(config.dims, init);
        std::unique_ptr<Engine> with = MakeEngine(other, ctx.comms(), config);
        for (int bad : {1, 3, 4, -2}) {
          schedule.set_post_forward_group_size(bad);
          s = with->Apply(schedule, 0);
          EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
          EXPECT_NE(s.message().find("post_forward_group_size"),
                    std::string::npos)
              << s;
        }
        schedule.set_post_forward_group_size(2);
        EXPECT_TRUE(with->Apply(schedule, 0).ok());
      },
      absl::Seconds(30), /*shared_memory=*/true, /*host_group_size=*/2);
}

TEST(EngineApiTest, IgnoredAndFrozenParameters) {
  RunConfig config;
  const StateDict init = MakeInitialState(config.dims, 22);
  RunOnMesh({1, 2}, [&](RankContext& ctx) {
    TinyTransformer model = MakeModel(config.dims, init);
    at::Tensor ignored = model->blocks[0]->named_parameters()["fc1.weight"];
    at::Tensor frozen = model->blocks[1]->named_parameters()["fc2.weight"];
    frozen.set_requires_grad(false);
    absl::StatusOr<std::unique_ptr<Engine>> engine =
        Engine::Create(model.ptr(), ctx.comms(), EngineOptions());
    ASSERT_TRUE(engine.ok());
    Engine& e = **engine;
    UnitOptions options;
    options.ignored_params = {ignored};
    ASSERT_TRUE(
        e.FullyShard({model->blocks[0].ptr()}, "layers.0", options).ok());
    ASSERT_TRUE(e.FullyShard({model->blocks[1].ptr()}, "layers.1").ok());
    ASSERT_TRUE(
        e.FullyShardRoot(options).ok());  // root must not pick it up either
    for (const auto& [name, p] : e.NamedParameters())
      EXPECT_NE(name, "layers.0.fc1.weight");
    // The ignored parameter keeps its full data.
    EXPECT_TRUE(torch::equal(ignored, init.at("layers.0.fc1.weight")));
    auto [tokens, targets] = Batch(config.dims, 0, ctx.rank * 4, 4);
    EngineForward(e, model, tokens, false).sum().backward();
    for (const auto& [name, p] : e.NamedParameters()) {
      if (name == "layers.1.fc2.weight") {
        EXPECT_FALSE(p.requires_grad());
        EXPECT_FALSE(p.grad().defined());
      } else if (p.numel() > 0) {
        EXPECT_TRUE(p.grad().defined()) << name;
      }
    }
    EXPECT_TRUE(
        ignored.grad().defined());  // autograd still fills it, unreduced
  });
}

TEST(EngineApiTest, FullyShardWrapperAndMixedPrecisionAccounting) {
  RunConfig config;
  const StateDict init = MakeInitialState(config.dims, 23);
  RunOnMesh({1, 2}, [&](RankContext& ctx) {
    TinyTransformer model = MakeModel(config.dims, init);
    RunConfig bf16 = config;
    bf16.mixed_precision.param_dtype = torch::kBFloat16;
    std::unique_ptr<Engine> engine = MakeEngine(model, ctx.comms(), bf16);
    const std::vector<UnitLayout> units = engine->Units();
    for (const UnitLayout& u : units)
      EXPECT_EQ(u.unsharded_bytes, u.numel * 2) << u.name;
    // Shards stay fp32 (the optimizer's master copy).
    for (const at::Tensor& p : engine->Parameters())
      EXPECT_EQ(p.scalar_type(), torch::kFloat);
    ShardedModule<Block> block(engine->Unit(1), model->blocks[0]);
    const at::Tensor x =
        torch::randn({2, config.dims.seq_len, config.dims.d_model});
    const at::Tensor y = engine->Root().Forward(x, [&](const at::Tensor& in) {
      at::Tensor out = block(in);
      EXPECT_EQ(out.scalar_type(),
                torch::kBFloat16);  // inputs cast to param_dtype
      return out;
    });
    EXPECT_EQ(y.sizes(), x.sizes());
  });
}

}  // namespace
}  // namespace hsdp::fsdp::testing
