// GPT model and byte-level data: configs, determinism, unit partition, block
// hook, learning.
#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include <cmath>
#include <set>

#include "gtest/gtest.h"
#include "hsdp/models/gpt.h"
#include "hsdp/models/token_dataset.h"

namespace hsdp::models {
namespace {

TEST(GptConfigTest, NamedSizesAndDims) {
  for (const std::string& name : KnownModelNames()) {
    auto c = GptConfigForName(name);
    ASSERT_TRUE(c.ok()) << name;
    EXPECT_EQ(c->name, name);
  }
  auto big = GptConfigForName("gpt-1b");
  const double params = static_cast<double>(GptParamCount(*big));
  EXPECT_GT(params, 0.8e9);
  EXPECT_LT(params, 1.3e9);

  auto unknown = GptConfigForName("gpt-huge");
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(unknown.status().message().find("gpt-tiny"), std::string::npos);

  auto dims = GptConfigFromDims("32,3,2,16");
  ASSERT_TRUE(dims.ok());
  EXPECT_EQ(dims->d_model, 32);
  EXPECT_EQ(dims->n_layers, 3);
  EXPECT_EQ(dims->DimsString(), "32,3,2,16");
  EXPECT_FALSE(GptConfigFromDims("32,3,5,16").ok());  // 32 % 5 != 0
  EXPECT_FALSE(GptConfigFromDims("32,3").ok());
  EXPECT_FALSE(GptConfigFromDims("a,b,c,d").ok());
  auto resolved = ResolveGptConfig("gpt-tiny", "32,1,2,16");
  ASSERT_TRUE(resolved.ok());
  EXPECT_EQ(resolved->name, "gpt-tiny");
  EXPECT_EQ(resolved->n_layers, 1);
}

TEST(GptTest, DeterministicInitUnitsAndParamCount) {
  const GptConfig config = *GptConfigForName("gpt-tiny");
  Gpt a(config, 1), b(config, 1), c(config, 2);
  auto pa = a->parameters(), pb = b->parameters(), pc = c->parameters();
  ASSERT_EQ(pa.size(), pb.size());
  int64_t numel = 0;
  bool any_diff = false;
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_TRUE(at::equal(pa[i], pb[i]));
    any_diff |= !at::equal(pa[i], pc[i]);
    numel += pa[i].numel();
  }
  EXPECT_TRUE(any_diff);
  EXPECT_EQ(numel, GptParamCount(config));

  // Units partition the parameters: root + one per block, no overlap, nothing
  // missing.
  std::vector<std::string> names = a->UnitNames();
  ASSERT_EQ(names.size(), static_cast<size_t>(config.n_layers + 1));
  EXPECT_EQ(names[0], "root");
  EXPECT_EQ(names[1], "layers.0");
  std::set<const void*> seen;
  size_t count = 0;
  for (int u = 0; u < static_cast<int>(names.size()); ++u) {
    for (const at::Tensor& p : a->UnitParameters(u)) {
      seen.insert(p.unsafeGetTensorImpl());
      ++count;
    }
  }
  EXPECT_EQ(count, pa.size());
  EXPECT_EQ(seen.size(), pa.size());
}

TEST(GptTest, BlockRunnerSeesEveryBlockInOrderAndLossStartsNearUniform) {
  const GptConfig config = *GptConfigForName("gpt-tiny");
  Gpt model(config, 0);
  TokenDataset data = TokenDataset::Builtin();
  TokenBatch batch = data.GlobalSlice(0, 0, 0, 4, config.seq_len);
  at::Tensor direct = model->Loss(batch.tokens, batch.targets);
  std::vector<int> calls;
  model->set_block_runner([&](int i, const at::Tensor& x) {
    calls.push_back(i);
    return model->block(i)->forward(x);
  });
  at::Tensor hooked = model->Loss(batch.tokens, batch.targets);
  EXPECT_EQ(calls, (std::vector<int>{0, 1}));
  EXPECT_TRUE(at::equal(direct, hooked));
  EXPECT_NEAR(direct.item<double>(), std::log(256.0), 0.3);
}

TEST(GptTest, AdamWTrainingLowersLoss) {
  at::set_num_threads(1);
  const GptConfig config = *GptConfigFromDims("32,1,2,32");
  Gpt model(config, 0);
  TokenDataset data = TokenDataset::Builtin();
  torch::optim::AdamW opt(model->parameters(),
                          torch::optim::AdamWOptions(3e-3));
  double first = 0, last = 0;
  constexpr int kSteps = 60;
  for (int s = 0; s < kSteps; ++s) {
    TokenBatch batch = data.GlobalSlice(0, s, 0, 8, config.seq_len);
    at::Tensor loss = model->Loss(batch.tokens, batch.targets);
    opt.zero_grad();
    loss.backward();
    opt.step();
    if (s == 0) first = loss.item<double>();
    last = loss.item<double>();
  }
  EXPECT_LT(last, first - 1.0) << "first " << first << " last " << last;
}

TEST(DataTest, RankSlicesTileTheGlobalBatch) {
  TokenDataset data = TokenDataset::Builtin();
  EXPECT_GT(data.size(), 4096);
  constexpr int kWorld = 4, kMicro = 2, kMb = 3, kSeq = 16;
  TokenBatch global = data.GlobalSlice(7, 11, 0, kWorld * kMicro * kMb, kSeq);
  EXPECT_TRUE(at::equal(global.tokens.slice(1, 1),
                        global.targets.slice(1, 0, kSeq - 1)));
  for (int r = 0; r < kWorld; ++r) {
    for (int m = 0; m < kMicro; ++m) {
      const int64_t first = (r * kMicro + m) * kMb;
      TokenBatch mb = data.GlobalSlice(7, 11, first, kMb, kSeq);
      EXPECT_TRUE(
          at::equal(mb.tokens, global.tokens.slice(0, first, first + kMb)));
      EXPECT_TRUE(
          at::equal(mb.targets, global.targets.slice(0, first, first + kMb)));
    }
  }
  // Different steps draw different windows.
  EXPECT_FALSE(
      at::equal(global.tokens, data.GlobalSlice(7, 12, 0, 24, kSeq).tokens));
  EXPECT_EQ(TokenDataset::Open("/nonexistent/x.txt", 256, kSeq).status().code(),
            absl::StatusCode::kNotFound);
}

TEST(GptTest, BlocksBuiltOneAtATimeEqualTheWholeModel) {
  const GptConfig config = *GptConfigFromDims("32,3,2,16");
  Gpt whole(config, 5);
  Gpt lazy(config, 5, /*build_blocks=*/false);
  EXPECT_TRUE(lazy->block(1).is_empty());
  // Built in any order, each block has the values it has in the whole model.
  for (int i : {2, 0, 1}) lazy->BuildBlock(i);
  auto pw = whole->named_parameters(), pl = lazy->named_parameters();
  ASSERT_EQ(pw.size(), pl.size());
  for (const auto& item : pw) {
    ASSERT_NE(pl.find(item.key()), nullptr) << item.key();
    EXPECT_TRUE(at::equal(item.value(), *pl.find(item.key()))) << item.key();
  }
  // Rebuilding replaces the block with equal values; releasing drops it.
  Block again = lazy->BuildBlock(1);
  EXPECT_TRUE(
      at::equal(again->parameters()[0], whole->block(1)->parameters()[0]));
  lazy->ReleaseBlock(1);
  EXPECT_TRUE(lazy->block(1).is_empty());
  EXPECT_EQ(lazy->named_parameters().find("layers.1.qkv.weight"), nullptr);
}

TEST(GptTest, TiedEmbeddingsShareOneTensor) {
  GptConfig config = *GptConfigFromDims("32,1,2,16");
  config.tie_embeddings = true;
  Gpt model(config, 0);
  auto params = model->named_parameters();
  ASSERT_NE(params.find("head.weight"), nullptr);
  EXPECT_EQ(params.find("head.weight")->unsafeGetTensorImpl(),
            params.find("tok_emb.weight")->unsafeGetTensorImpl());
  std::set<const void*> unique;
  int64_t numel = 0;
  for (const auto& item : params) {
    if (unique.insert(item.value().unsafeGetTensorImpl()).second)
      numel += item.value().numel();
  }
  EXPECT_EQ(numel, GptParamCount(config));
}

}  // namespace
}  // namespace hsdp::models
