// The TorchScript task: a model scripted in Python (by running python3 with
// torch inside the test) loads under the convention, shares its parameter
// tensors with the engine's mirror, computes the scripted forward's loss while
// entering each unit once, trains sharded on a 2x2 mesh of threads with
// gradients that reach the shards equal to the unsharded ones, and bad models
// are refused in one line.
#include "worker/models/torchscript_task.h"

#include <torch/csrc/jit/runtime/graph_executor.h>
#include <torch/csrc/jit/serialization/import.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <ostream>
#include <string>
#include <system_error>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "gtest/gtest.h"
#include "tests/worker/fsdp/fsdp_test_util.h"
#include "worker/train/task_units.h"
#include "worker/train/unit_entry.h"

namespace hsdp::models {
namespace {

namespace fs = std::filesystem;
using fsdp::testing::RankContext;
using fsdp::testing::RunOnMesh;

constexpr int kRanks = 4;
constexpr int kSamplesPerRank = 2;

// The scripted models of make_scripted_models.py, made once per test binary
// in a directory removed when it exits; empty when no python3 with torch was
// found at configure time.
struct ScriptedModels {
  ScriptedModels() {
    const std::string python = HSDP_TORCH_PYTHON;
    if (python.empty()) return;
    const fs::path d =
        fs::temp_directory_path() / absl::StrCat("hsdp-ts-models-", ::getpid());
    const std::string cmd =
        absl::StrCat(python, " ", HSDP_MAKE_SCRIPTED_MODELS, " ", d.string());
    if (std::system(cmd.c_str()) != 0) {
      ADD_FAILURE() << "failed: " << cmd;
      return;
    }
    dir = d.string();
  }
  ~ScriptedModels() {
    std::error_code ec;
    if (!dir.empty()) fs::remove_all(dir, ec);
  }
  ScriptedModels(const ScriptedModels&) = delete;
  ScriptedModels& operator=(const ScriptedModels&) = delete;
  std::string dir;
};

const std::string& ModelsDir() {
  static const ScriptedModels models;
  return models.dir;
}

#define REQUIRE_MODELS()                                                  \
  if (std::string(HSDP_TORCH_PYTHON).empty())                             \
    GTEST_SKIP() << "no python3 with torch (HSDP_TORCH_PYTHON is empty)"; \
  ASSERT_FALSE(ModelsDir().empty())

train::TaskArgs Args(const std::string& file, const std::string& units = "",
                     const std::string& placement = "") {
  train::TaskArgs args;
  args.model = absl::StrCat("torchscript:", ModelsDir(), "/", file);
  if (!units.empty()) args.options[kUnitsOption] = units;
  if (!placement.empty()) args.options[kPlacementOption] = placement;
  return args;
}

std::unique_ptr<TorchScriptTask> Load(const std::string& file,
                                      const std::string& units = "",
                                      const std::string& placement = "") {
  auto task = TorchScriptTask::Create(Args(file, units, placement));
  EXPECT_TRUE(task.ok()) << task.status();
  if (!task.ok()) return nullptr;
  EXPECT_TRUE((*task)->Build(train::BuildContext{}).ok());
  return std::move(*task);
}

// Records the units entered and runs them directly.
class RecordingContext : public train::ShardContext {
 public:
  int num_units() const override { return n; }
  at::Tensor Forward(int unit, const at::Tensor& input,
                     const train::UnitFn& fn) override {
    entered.push_back(unit);
    return fn(input);
  }
  std::vector<at::Tensor> Forward(int unit,
                                  const std::vector<at::Tensor>& inputs,
                                  const train::UnitTensorsFn& fn) override {
    entered.push_back(unit);
    return fn(inputs);
  }
  int n = 0;
  std::vector<int> entered;
};

TEST(TorchScriptTaskTest, ConventionLoadsAndTheMirrorSharesTheTensors) {
  REQUIRE_MODELS();
  std::unique_ptr<TorchScriptTask> task = Load("gpt.pt");
  ASSERT_NE(task, nullptr);
  EXPECT_EQ(task->unit_names(),
            (std::vector<std::string>{"layers.0", "layers.1", "layers.2"}));
  EXPECT_EQ(task->TokensPerSample(), 24);
  EXPECT_EQ(task->Name(), "torchscript:__torch__.gpt.GPT");
  EXPECT_GT(task->Version(), 0);

  std::map<std::string, const c10::TensorImpl*> mirrored;
  for (const auto& [name, t] : train::UniqueNamedParameters(*task->Model()))
    mirrored[name] = t.unsafeGetTensorImpl();
  size_t n = 0;
  for (const auto& p : task->scripted().named_parameters()) {
    ASSERT_TRUE(mirrored.count(p.name)) << p.name;
    EXPECT_EQ(mirrored[p.name], p.value.unsafeGetTensorImpl()) << p.name;
    ++n;
  }
  EXPECT_EQ(n, mirrored.size());
  for (int i = 0; i < task->NumUnits(); ++i) {
    absl::StatusOr<train::UnitSpec> unit = task->BuildUnit(i);
    ASSERT_TRUE(unit.ok()) << unit.status();
    EXPECT_EQ(unit->name, absl::StrCat("layers.", i));
    ASSERT_EQ(unit->modules.size(), 1u);
    EXPECT_EQ(unit->modules[0]->named_parameters().size(), 12u);  // 6 modules
  }
}

TEST(TorchScriptTaskTest, LossIsTheScriptedForwardsAndEntersEachUnitOnce) {
  REQUIRE_MODELS();
  std::unique_ptr<TorchScriptTask> task = Load("gpt.pt");
  ASSERT_NE(task, nullptr);
  RecordingContext ctx;
  ctx.n = task->NumUnits();
  task->SetShardContext(ctx);
  absl::StatusOr<train::Batch> batch =
      task->GetBatch(train::BatchRequest{3, 0, 2, 5});
  ASSERT_TRUE(batch.ok()) << batch.status();
  absl::StatusOr<at::Tensor> loss = task->Loss(*batch);
  ASSERT_TRUE(loss.ok()) << loss.status();
  EXPECT_EQ(ctx.entered, (std::vector<int>{0, 1, 2}));
  EXPECT_TRUE(loss->requires_grad());
  EXPECT_EQ(loss->dim(), 0);

  torch::jit::GraphOptimizerEnabledGuard unoptimized(false);
  at::Tensor expected =
      task->scripted().forward({batch->input, batch->target}).toTensor();
  EXPECT_TRUE(torch::equal(*loss, expected))
      << loss->item<double>() << " vs " << expected.item<double>();
}

// One forward and backward of the global batch: the reference's full
// gradients, by name.
std::map<std::string, at::Tensor> ReferenceGradients() {
  std::unique_ptr<TorchScriptTask> task = Load("gpt.pt");
  train::DirectShardContext ctx(task->NumUnits());
  task->SetShardContext(ctx);
  auto batch = task->GetBatch(
      train::BatchRequest{0, 0, kRanks * kSamplesPerRank, /*seed=*/9});
  EXPECT_TRUE(batch.ok());
  auto loss = task->Loss(*batch);
  EXPECT_TRUE(loss.ok());
  loss->backward();
  std::map<std::string, at::Tensor> grads;
  for (const auto& [name, t] : train::UniqueNamedParameters(*task->Model()))
    grads[name] = t.grad().clone();
  return grads;
}

struct ShardingCase {
  bool recompute = false;
  std::string units;
  // Parameters inside the units (the rest are the root's).
  int unit_params = 0;
  // --task-option placement=RULE (empty: none).
  std::string placement;
  // Of unit_params, those replicated (never gathered, never freed).
  int replicated_unit_params = 0;
};

void PrintTo(const ShardingCase& c, std::ostream* os) {
  *os << "--units '" << c.units << "'" << (c.recompute ? ", recompute" : "")
      << (c.placement.empty() ? "" : ", placement ") << c.placement;
}

class ShardedGradientsTest : public ::testing::TestWithParam<ShardingCase> {};

TEST_P(ShardedGradientsTest, ReachTheShardsAndEqualTheUnshardedOnes) {
  REQUIRE_MODELS();
  const bool recompute = GetParam().recompute;
  at::set_num_threads(1);
  const std::map<std::string, at::Tensor> full = ReferenceGradients();
  std::mutex mu;
  RunOnMesh({2, 2}, [&](RankContext& rank) {
    std::unique_ptr<TorchScriptTask> task =
        Load("gpt.pt", GetParam().units, GetParam().placement);
    ASSERT_NE(task, nullptr);
    fsdp::EngineOptions options;
    auto described = train::DescribeTaskUnits(*task, options);
    ASSERT_TRUE(described.ok()) << described.status();
    auto engine = train::ShardTask(*task, rank.comms(), options, *described);
    ASSERT_TRUE(engine.ok()) << engine.status();
    train::EngineShardContext ctx(
        **engine, std::vector<bool>(task->NumUnits(), recompute));
    task->SetShardContext(ctx);
    const hsdp::v1::StepSchedule schedule =
        fsdp::testing::PlanSchedule(**engine, fsdp::testing::RunConfig{});
    ASSERT_TRUE((*engine)->Apply(schedule, 0).ok());
    auto batch = task->GetBatch(train::BatchRequest{
        0, rank.rank * kSamplesPerRank, kSamplesPerRank, /*seed=*/9});
    ASSERT_TRUE(batch.ok());
    at::Tensor loss = (*engine)->Root().Forward(
        std::vector<at::Tensor>{},
        [&](const std::vector<at::Tensor>&) -> std::vector<at::Tensor> {
          return {task->Loss(*batch).value()};
        })[0];
    loss.backward();
    ASSERT_TRUE((*engine)->status().ok()) << (*engine)->status();

    std::lock_guard<std::mutex> lock(mu);
    const auto layout = fsdp::ShardedStateDict(**engine);
    // The scripted module's own parameter tensors are the engine's: the
    // units' sharded ones, resharded after backward, have their storage bytes
    // freed (replicated ones are never gathered).
    int freed = 0;
    for (const auto& p : task->scripted().named_parameters()) {
      if (layout.at(p.name).replicated) continue;
      for (const std::string& unit : task->unit_names()) {
        if (p.name.rfind(unit + ".", 0) == 0) {
          EXPECT_EQ(p.value.storage().nbytes(), 0u) << p.name;
          ++freed;
        }
      }
    }
    EXPECT_EQ(freed,
              GetParam().unit_params - GetParam().replicated_unit_params);
    int checked = 0;
    for (const auto& [name, shard] : (*engine)->NamedParameters()) {
      ASSERT_TRUE(shard.grad().defined()) << name;
      const fsdp::ShardedTensor& st = layout.at(name);
      at::Tensor want = st.replicated
                            ? full.at(name)
                            : full.at(name).narrow(st.shard_dim, st.row_offset,
                                                   shard.size(st.shard_dim));
      EXPECT_TRUE(torch::allclose(shard.grad(), want, 1e-5, 1e-6))
          << name << " max diff "
          << (shard.grad() - want).abs().max().item<double>();
      ++checked;
    }
    EXPECT_EQ(checked, static_cast<int>(full.size()));
  });
}

// Blocks as units (3 x 12 parameters), with and without recompute; and the
// same units named one by one.
INSTANTIATE_TEST_SUITE_P(
    Units, ShardedGradientsTest,
    ::testing::Values(
        ShardingCase{false, "layers.*", 36, "", 0},
        ShardingCase{true, "layers.*", 36, "", 0},
        ShardingCase{false, "layers.0,layers.1,layers.2", 36, "", 0},
        // Norms whole on every rank (4 per block), two weights on dim 1.
        ShardingCase{false, "layers.*", 36,
                     "layers.*.ln1.*=replicated,layers.*.ln2.*=replicated,"
                     "layers.*.qkv.weight=1,layers.*.out.weight=-1",
                     12},
        ShardingCase{true, "layers.*", 36,
                     "layers.*.ln1.*=replicated,layers.*.qkv.weight=1", 6}),
    [](const ::testing::TestParamInfo<ShardingCase>& info) {
      return absl::StrCat(info.param.units == "layers.*" ? "Glob" : "Listed",
                          info.param.recompute ? "Recompute" : "",
                          info.param.placement.empty() ? "" : "Placed");
    });

// A scripted mixture of experts (examples/torchscript/moe.py) on a batch
// whose samples reach only some experts, and never expert 7: every shard's
// gradient equals PyTorch's own (eager, in Python) gradient of the whole
// batch's mean loss, and a parameter no sample reaches has none, on every
// mesh shape.
class MoeGradientsTest : public ::testing::TestWithParam<comm::MeshShape> {};

TEST_P(MoeGradientsTest, EqualPyTorchsOwnOnEveryMesh) {
  REQUIRE_MODELS();
  at::set_num_threads(1);
  const comm::MeshShape mesh = GetParam();
  std::map<std::string, at::Tensor> want;
  for (const auto& b :
       torch::jit::load(ModelsDir() + "/moe_reference.pt").named_buffers())
    want[b.name] = b.value;
  const at::Tensor tokens = want.at("tokens");
  const at::Tensor targets = want.at("targets");
  const int64_t local = tokens.size(0) / mesh.world_size();
  std::mutex mu;
  int checked = 0, without = 0;
  RunOnMesh(mesh, [&](RankContext& rank) {
    std::unique_ptr<TorchScriptTask> task = Load("moe.pt");
    ASSERT_NE(task, nullptr);
    fsdp::EngineOptions options;
    auto described = train::DescribeTaskUnits(*task, options);
    ASSERT_TRUE(described.ok()) << described.status();
    auto engine = train::ShardTask(*task, rank.comms(), options, *described);
    ASSERT_TRUE(engine.ok()) << engine.status();
    train::EngineShardContext ctx(**engine,
                                  std::vector<bool>(task->NumUnits(), false));
    task->SetShardContext(ctx);
    ASSERT_TRUE((*engine)
                    ->Apply(fsdp::testing::PlanSchedule(
                                **engine, fsdp::testing::RunConfig{}),
                            0)
                    .ok());
    const train::Batch batch{tokens.narrow(0, rank.rank * local, local),
                             targets.narrow(0, rank.rank * local, local)};
    at::Tensor loss = (*engine)->Root().Forward(
        std::vector<at::Tensor>{},
        [&](const std::vector<at::Tensor>&) -> std::vector<at::Tensor> {
          return {task->Loss(batch).value()};
        })[0];
    loss.backward();
    ASSERT_TRUE((*engine)->status().ok()) << (*engine)->status();
    const auto layout = fsdp::ShardedStateDict(**engine);
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& [name, shard] : (*engine)->NamedParameters()) {
      const std::string key =
          "grad__" + absl::StrReplaceAll(name, {{".", "__"}});
      auto it = want.find(key);
      if (it == want.end()) {
        EXPECT_FALSE(shard.grad().defined()) << name;
        if (rank.rank == 0) ++without;
        continue;
      }
      ASSERT_TRUE(shard.grad().defined()) << name;
      const fsdp::ShardedTensor& st = layout.at(name);
      const at::Tensor rows =
          it->second.narrow(0, st.row_offset, shard.size(0));
      if (rows.numel() > 0) {
        EXPECT_LT((shard.grad() - rows).abs().max().item<double>(), 1e-6)
            << name;
      }
      if (rank.rank == 0) ++checked;
    }
  });
  EXPECT_EQ(without, 8);  // expert 7's four tensors in each of two layers
  EXPECT_EQ(checked + without, 71);
}

INSTANTIATE_TEST_SUITE_P(
    Meshes, MoeGradientsTest,
    ::testing::Values(comm::MeshShape{4, 1}, comm::MeshShape{1, 4},
                      comm::MeshShape{2, 2}, comm::MeshShape{1, 2}),
    [](const auto& info) {
      return absl::StrCat(info.param.replicate, "x", info.param.shard);
    });

// INVALID_ARGUMENT (or `code`), one line, containing `needle`.
void ExpectRefused(const train::TaskArgs& args, const std::string& needle,
                   absl::StatusCode code = absl::StatusCode::kInvalidArgument) {
  auto task = TorchScriptTask::Create(args);
  ASSERT_FALSE(task.ok()) << needle;
  EXPECT_EQ(task.status().code(), code) << task.status();
  const std::string message(task.status().message());
  EXPECT_NE(message.find(needle), std::string::npos) << message;
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
}

TEST(TorchScriptTaskTest, BadModelsAreRefusedInOneLine) {
  REQUIRE_MODELS();
  const std::string text = ModelsDir() + "/not_a_model.pt";
  std::ofstream(text) << "just some text\n";
  ExpectRefused(Args("not_a_model.pt"), "not a TorchScript archive");
  ExpectRefused(Args("state_dict.pt"), "not a TorchScript archive");
  ExpectRefused(Args("missing.pt"), "cannot open", absl::StatusCode::kNotFound);
  ExpectRefused(Args("no_head_loss.pt"),
                "has no method head_loss(self, x: Tensor, targets: Tensor)");
  ExpectRefused(Args("bad_signature.pt"),
                "method 'head_loss' has the wrong signature");
  ExpectRefused(Args("bad_unit.pt"),
                "unit 'layers.0': method 'forward' has the wrong signature");
  ExpectRefused(Args("one_arg_forward.pt"),
                "method 'forward' has the wrong signature");
  ExpectRefused(Args("gpt.pt", "blocks.*"), "'blocks.*' matches no submodule");
  ExpectRefused(Args("gpt.pt", "", "blocks.*.ln1.*=replicated"),
                "'blocks.*.ln1.*=replicated' matches no parameter");
  ExpectRefused(Args("gpt.pt", "", "layers.*.qkv.weight=sideways"),
                "places its parameters neither on a dim nor replicated");
  ExpectRefused(Args("gpt.pt", "", "layers.*.qkv.*=1,layers.0.qkv.weight=0"),
                "places layers.0.qkv.weight, which 'layers.*.qkv.*=1' placed");
  // Units that are not the stages forward runs in turn: a block left out (it
  // would silently never run), and modules inside the blocks.
  ExpectRefused(Args("gpt.pt", "layers.1"),
                "': embed, the units in order and head_loss give loss");
  ExpectRefused(Args("gpt.pt", "layers.*.qkv"),
                "': embed, the units in order and head_loss fail on one "
                "sample");
  ExpectRefused(Args("gpt.pt", "layers.*,layers.*.fc"),
                "units overlap: 'layers.0.fc'");
  train::TaskArgs dims = Args("gpt.pt");
  dims.dims = "32,2,2,16";
  ExpectRefused(dims, "--dims 32,2,2,16");
  train::TaskArgs option = Args("gpt.pt");
  option.options["tie_embeddings"] = "true";
  ExpectRefused(option, "--task-option tie_embeddings");
}

}  // namespace
}  // namespace hsdp::models
