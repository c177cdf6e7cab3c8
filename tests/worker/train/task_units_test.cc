// How the runner builds a task's units: the unit list it reports equals what
// the engine builds, each rank materialises one unit at a time and ends with
// shards bitwise equal to the reference's init, and tasks that break the
// contract are refused.
#include "worker/train/task_units.h"

#include <torch/torch.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "hsdp/models/gpt_task.h"
#include "tests/worker/fsdp/fsdp_test_util.h"

namespace hsdp::train {
namespace {

using fsdp::testing::RankContext;
using fsdp::testing::RunOnMesh;

std::unique_ptr<models::GptTask> MakeGpt(const std::string& dims) {
  TaskArgs args;
  args.model = "gpt-tiny";
  args.dims = dims;
  auto task = models::GptTask::Create(args);
  EXPECT_TRUE(task.ok()) << task.status();
  return std::move(*task);
}

// Bytes of parameter storage alive under `module` for names starting with
// `prefix`.
int64_t StorageBytes(torch::nn::Module& module, const std::string& prefix) {
  int64_t bytes = 0;
  for (const auto& [name, t] : UniqueNamedParameters(module)) {
    if (name.rfind(prefix, 0) == 0)
      bytes += static_cast<int64_t>(t.storage().nbytes());
  }
  return bytes;
}

// A GPT task that records, whenever a unit is built, how many bytes of other
// blocks' parameters are still allocated.
class WatchedGpt : public Task {
 public:
  explicit WatchedGpt(std::unique_ptr<models::GptTask> inner)
      : inner_(std::move(inner)) {}
  std::string Name() const override { return inner_->Name(); }
  absl::Status Build(const BuildContext& c) override {
    return inner_->Build(c);
  }
  std::shared_ptr<torch::nn::Module> Model() override {
    return inner_->Model();
  }
  int NumUnits() const override { return inner_->NumUnits(); }
  absl::StatusOr<UnitSpec> BuildUnit(int i) override {
    other_block_bytes.push_back(StorageBytes(*Model(), "layers."));
    return inner_->BuildUnit(i);
  }
  void ReleaseUnit(int i) override { inner_->ReleaseUnit(i); }
  void SetShardContext(ShardContext& c) override { inner_->SetShardContext(c); }
  absl::StatusOr<Batch> GetBatch(const BatchRequest& r) override {
    return inner_->GetBatch(r);
  }
  absl::StatusOr<at::Tensor> Loss(const Batch& b) override {
    return inner_->Loss(b);
  }

  std::vector<int64_t> other_block_bytes;

 private:
  std::unique_ptr<models::GptTask> inner_;
};

TEST(TaskUnitsTest, EachRankHoldsOneUnitAtATimeAndItsShardsEqualTheInit) {
  at::set_num_threads(1);
  constexpr char kDims[] = "32,3,2,16";
  // The reference's model, built whole.
  std::unique_ptr<models::GptTask> reference = MakeGpt(kDims);
  ASSERT_TRUE(reference->Build(BuildContext{c10::kCPU, 7}).ok());
  ASSERT_TRUE(BuildAllUnits(*reference, c10::kCPU).ok());
  std::map<std::string, at::Tensor> full;
  for (const auto& [name, t] : UniqueNamedParameters(*reference->Model()))
    full[name] = t.detach();

  std::mutex mu;
  RunOnMesh({2, 2}, [&](RankContext& ctx) {
    WatchedGpt task(MakeGpt(kDims));
    ASSERT_TRUE(task.Build(BuildContext{c10::kCPU, 7}).ok());
    fsdp::EngineOptions options;
    absl::StatusOr<std::vector<fsdp::UnitLayout>> described =
        DescribeTaskUnits(task, options);
    ASSERT_TRUE(described.ok()) << described.status();
    absl::StatusOr<std::unique_ptr<fsdp::Engine>> engine =
        ShardTask(task, ctx.comms(), options, *described);
    ASSERT_TRUE(engine.ok()) << engine.status();

    std::lock_guard<std::mutex> lock(mu);
    // Describing and sharding each built every block once, with no other
    // block's full parameters alive at the time.
    ASSERT_EQ(task.other_block_bytes.size(), 6u);
    for (int64_t bytes : task.other_block_bytes) EXPECT_EQ(bytes, 0);
    // The reported list is the engine's, and it covers every parameter.
    std::vector<fsdp::UnitLayout> built = (*engine)->Units();
    ASSERT_EQ(built.size(), described->size());
    int64_t numel = 0;
    for (size_t i = 0; i < built.size(); ++i) {
      EXPECT_EQ(built[i].name, (*described)[i].name);
      EXPECT_EQ(built[i].numel, (*described)[i].numel);
      EXPECT_EQ(built[i].bytes, (*described)[i].bytes);
      EXPECT_EQ(built[i].param_names, (*described)[i].param_names);
      numel += built[i].numel;
    }
    EXPECT_EQ((*described)[0].name, "root");
    EXPECT_EQ(numel,
              models::GptParamCount(models::GptConfigFromDims(kDims).value()));
    // Every shard holds exactly the reference's rows.
    for (const auto& [name, st] : fsdp::ShardedStateDict(**engine)) {
      ASSERT_TRUE(full.count(name)) << name;
      at::Tensor rows = full[name].narrow(0, st.row_offset, st.local.size(0));
      EXPECT_TRUE(torch::equal(st.local, rows)) << name;
    }
  });
}

// A task whose second unit reuses a module of the first: the parameter would
// be read while the first unit is freed.
class SharedAcrossUnits : public Task {
 public:
  std::string Name() const override { return "shared"; }
  absl::Status Build(const BuildContext&) override {
    root_ = std::make_shared<torch::nn::Module>();
    a_ = root_->register_module("a", torch::nn::Linear(4, 4));
    b_ = root_->register_module("b", torch::nn::Sequential(a_));
    return absl::OkStatus();
  }
  std::shared_ptr<torch::nn::Module> Model() override { return root_; }
  int NumUnits() const override { return 2; }
  absl::StatusOr<UnitSpec> BuildUnit(int i) override {
    if (i == 0) return UnitSpec{"a", {a_.ptr()}};
    return UnitSpec{"b", {b_.ptr()}};
  }
  void SetShardContext(ShardContext&) override {}
  absl::StatusOr<Batch> GetBatch(const BatchRequest&) override {
    return Batch{};
  }
  absl::StatusOr<at::Tensor> Loss(const Batch&) override {
    return at::Tensor();
  }

 private:
  std::shared_ptr<torch::nn::Module> root_;
  torch::nn::Linear a_{nullptr};
  torch::nn::Sequential b_{nullptr};
};

TEST(TaskUnitsTest, ParameterSharedByTwoUnitsIsRefused) {
  RunOnMesh({1, 2}, [&](RankContext& ctx) {
    SharedAcrossUnits task;
    ASSERT_TRUE(task.Build(BuildContext{}).ok());
    auto described = DescribeTaskUnits(task, fsdp::EngineOptions());
    ASSERT_TRUE(described.ok());
    auto engine =
        ShardTask(task, ctx.comms(), fsdp::EngineOptions(), *described);
    ASSERT_FALSE(engine.ok());
    EXPECT_NE(engine.status().message().find("must belong to the root unit"),
              std::string::npos)
        << engine.status();
  });
}

TEST(TaskUnitsTest, UnitsNamedRootOrTwiceAreRefused) {
  class Named : public SharedAcrossUnits {
   public:
    explicit Named(std::vector<std::string> names) : names_(std::move(names)) {}
    absl::StatusOr<UnitSpec> BuildUnit(int i) override {
      absl::StatusOr<UnitSpec> spec = SharedAcrossUnits::BuildUnit(i);
      spec->name = names_[i];
      return spec;
    }

   private:
    std::vector<std::string> names_;
  };
  for (const auto& names : {std::vector<std::string>{"root", "b"},
                            std::vector<std::string>{"x", "x"}}) {
    Named task(names);
    ASSERT_TRUE(task.Build(BuildContext{}).ok());
    auto described = DescribeTaskUnits(task, fsdp::EngineOptions());
    EXPECT_EQ(described.status().code(), absl::StatusCode::kInvalidArgument);
  }
}

// A task written against the former name, Shard(), still receives the context:
// the default SetShardContext() forwards to it.
TEST(TaskUnitsTest, TaskOverridingTheFormerShardNameGetsTheContext) {
  class NoUnits : public ShardContext {
   public:
    int num_units() const override { return 0; }
    at::Tensor Forward(int, const at::Tensor& input,
                       const UnitFn& fn) override {
      return fn(input);
    }
    std::vector<at::Tensor> Forward(int, const std::vector<at::Tensor>& inputs,
                                    const UnitTensorsFn& fn) override {
      return fn(inputs);
    }
  };
  class OldTask : public Task {
   public:
    std::string Name() const override { return "old"; }
    absl::Status Build(const BuildContext&) override {
      return absl::OkStatus();
    }
    std::shared_ptr<torch::nn::Module> Model() override { return nullptr; }
    int NumUnits() const override { return 0; }
    absl::StatusOr<UnitSpec> BuildUnit(int) override {
      return absl::OutOfRangeError("no units");
    }
    void Shard(ShardContext& context) override { received = &context; }
    absl::StatusOr<Batch> GetBatch(const BatchRequest&) override {
      return absl::UnimplementedError("GetBatch");
    }
    absl::StatusOr<at::Tensor> Loss(const Batch&) override {
      return absl::UnimplementedError("Loss");
    }
    ShardContext* received = nullptr;
  };
  NoUnits context;
  OldTask task;
  Task& as_task = task;
  as_task.SetShardContext(context);
  EXPECT_EQ(task.received, &context);
}

}  // namespace
}  // namespace hsdp::train
