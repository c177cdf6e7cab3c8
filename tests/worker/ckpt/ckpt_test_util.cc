#include "tests/worker/ckpt/ckpt_test_util.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "worker/ckpt/state.h"
#include "worker/train/checkpointing.h"

namespace hsdp::ckpt::testing {

using fsdp::testing::RankContext;

Trainer::Trainer(RankContext& c, const fsdp::testing::StateDict& init,
                 const fsdp::testing::RunConfig& cfg)
    : ctx(&c), config(cfg) {
  model = fsdp::testing::MakeModel(config.dims, init);
  engine = fsdp::testing::MakeEngine(model, ctx->comms(), config);
  optimizer = std::make_unique<torch::optim::AdamW>(
      engine->Parameters(), torch::optim::AdamWOptions(config.lr));
  schedule = fsdp::testing::PlanSchedule(*engine, config);
}

void Trainer::Step(int step, int global_batch) {
  const int world = ctx->mesh->shape().world_size();
  const int local = global_batch / world;
  absl::Status s = engine->Apply(schedule, 0);
  ASSERT_TRUE(s.ok()) << s;
  auto [tokens, targets] =
      fsdp::testing::Batch(config.dims, step, ctx->rank * local, local);
  at::Tensor loss = fsdp::testing::Loss(
      fsdp::testing::EngineForward(*engine, model, tokens, false), targets);
  loss.backward();
  optimizer->step();
  optimizer->zero_grad();
}

std::vector<LocalTensor> Trainer::Params() const {
  return train::ParamTensors(*engine, train::CheckpointUse::kSave);
}

std::vector<LocalTensor> Trainer::State(std::map<std::string, int64_t>* steps) {
  std::vector<LocalTensor> all = Params();
  absl::StatusOr<std::vector<LocalTensor>> o =
      OptimizerShards(*optimizer, all, steps);
  EXPECT_TRUE(o.ok()) << o.status();
  if (o.ok()) all.insert(all.end(), o->begin(), o->end());
  return all;
}

SaverOptions SaverOptionsFor(const RankContext& ctx, const std::string& root,
                             bool async, int keep) {
  SaverOptions o;
  o.root = root;
  o.replicate_rank = ctx.mesh->replicate().rank();
  o.replicate_size = ctx.mesh->replicate().size();
  o.shard_rank = ctx.mesh->shard().rank();
  o.shard_size = ctx.mesh->shard().size();
  o.async = async;
  o.keep = keep;
  o.publish_timeout = absl::Seconds(30);
  return o;
}

void RankBarrier::Wait() {
  absl::MutexLock lock(&mu_);
  const int64_t generation = generation_;
  if (++waiting_ == ranks_) {
    waiting_ = 0;
    ++generation_;
    return;
  }
  std::pair<int64_t*, int64_t> wait(&generation_, generation);
  mu_.Await(absl::Condition(
      +[](std::pair<int64_t*, int64_t>* g) { return *g->first != g->second; },
      &wait));
}

absl::Status SaveOnRank(Trainer& trainer, CheckpointSaver& saver, int64_t step,
                        RankBarrier& barrier) {
  absl::Status s = saver.Prepare(step);
  // Every rank has cleared its stale files before any rank writes.
  barrier.Wait();
  if (!s.ok()) return s;
  std::map<std::string, int64_t> steps;
  std::vector<LocalTensor> tensors = trainer.State(&steps);
  Metadata base;
  base.next_step = step + 1;
  base.model_name = kModelName;
  base.optimizer = OptimizerType(*trainer.optimizer);
  return saver.Save(step, tensors, std::move(steps), std::move(base));
}

absl::Status LoadOnRank(Trainer& trainer, const std::string& root,
                        ReadStats* stats) {
  absl::StatusOr<FoundCheckpoint> found = FindLatestCheckpoint(root);
  if (!found.ok()) return found.status();
  if (found->step < 0) return absl::NotFoundError("no checkpoint in " + root);
  absl::StatusOr<Metadata> m = ReadMetadata(found->dir);
  if (!m.ok()) return m.status();
  const std::vector<LocalTensor> params = trainer.Params();
  absl::Status s =
      CheckModel(*m, found->dir, kModelName, params, *trainer.optimizer);
  if (!s.ok()) return s;
  return LoadShards(found->dir, *m, params, *trainer.optimizer, stats);
}

void GlobalState::Add(const std::vector<LocalTensor>& tensors) {
  absl::MutexLock lock(&mu_);
  for (const LocalTensor& t : tensors) {
    at::Tensor& full = tensors_[t.name];
    if (!full.defined())
      full = at::full(t.global_shape, std::nan(""), t.tensor.options());
    full.narrow(0, t.row_offset, t.tensor.size(0)).copy_(t.tensor);
  }
}

std::map<std::string, at::Tensor> GlobalState::tensors() const {
  absl::MutexLock lock(&mu_);
  return tensors_;
}

namespace {

// Removes this process's TempDirs after the last test when every test passed
// (kept for inspection otherwise).
class TempDirCleaner : public ::testing::Environment {
 public:
  void Add(const std::string& dir) {
    absl::MutexLock lock(&mu_);
    dirs_.push_back(dir);
  }
  void TearDown() override {
    if (!::testing::UnitTest::GetInstance()->Passed()) return;
    absl::MutexLock lock(&mu_);
    for (const std::string& dir : dirs_) std::filesystem::remove_all(dir);
  }

 private:
  absl::Mutex mu_;
  std::vector<std::string> dirs_ ABSL_GUARDED_BY(mu_);
};

TempDirCleaner* Cleaner() {
  // Owned by GoogleTest once added.
  static TempDirCleaner* cleaner = static_cast<TempDirCleaner*>(
      ::testing::AddGlobalTestEnvironment(new TempDirCleaner));
  return cleaner;
}

}  // namespace

std::string TempDir(const std::string& name) {
  // Per process: ctest -j runs the cases of one binary side by side.
  const std::string dir =
      absl::StrCat(::testing::TempDir(), "/ckpt_", getpid(), "_", name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  Cleaner()->Add(dir);
  return dir;
}

}  // namespace hsdp::ckpt::testing
