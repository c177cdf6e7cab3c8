// Every training feature a job can turn on, through real hsdp-worker processes
// under a coordinator, against the single-process reference (`--reference`):
// plain SGD (whose update is the gradient itself, so final parameters after
// one step compare gradients), mixed precision, CPU offload, activation
// recompute, clipping, the learning-rate schedule, tied embeddings, token
// files — and the job's settings being enforced at Join.
#include <cmath>
#include <cstdint>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/e2e/cluster.h"

namespace hsdp::e2e {
namespace {

struct JobRun {
  std::vector<StepRecord> steps;  // rank 0's report, or the reference's
  std::map<std::string, at::Tensor> params;
};

// A sharded job of R x S workers with `flags` (worker flags, every rank) and
// `microbatches` from the policy.
JobRun Sharded(const std::string& name, int replicate, int shard,
               const std::vector<std::string>& flags, int steps,
               int microbatches = 1) {
  Cluster c(name);
  const std::string policy = c.dir() + "/policy.json";
  std::ofstream(policy) << "{\"microbatches\": " << microbatches << "}\n";
  const int world = replicate * shard;
  c.StartCoordinator(world, absl::StrCat(replicate, "x", shard), 0, policy);
  std::vector<std::string> extra = flags;
  extra.push_back("--final-params");
  extra.push_back(c.dir() + "/final.pt");
  c.StartWorkers(world, extra, steps);
  c.WaitWorkers();
  JobRun run;
  run.steps = ReadReport(c.report(0));
  run.params = LoadParams(c.dir() + "/final.pt");
  return run;
}

JobRun Reference(const std::string& name, int world,
                 const std::vector<std::string>& flags, int steps,
                 int microbatches = 1) {
  Cluster scratch(name);
  const std::string report = scratch.dir() + "/ref.jsonl";
  const std::string params = scratch.dir() + "/ref.pt";
  const std::string log = scratch.dir() + "/ref.log";
  EXPECT_EQ(
      RunReference(world, microbatches, steps, report, params, log, flags), 0)
      << ReadFile(log);
  return JobRun{ReadReport(report), LoadParams(params)};
}

double MaxParamDiff(const JobRun& a, const JobRun& b) {
  EXPECT_EQ(a.params.size(), b.params.size());
  double worst = 0;
  for (const auto& [name, t] : b.params) {
    auto it = a.params.find(name);
    if (it == a.params.end() || !it->second.sizes().equals(t.sizes())) {
      ADD_FAILURE() << "parameter " << name << " missing or reshaped";
      return INFINITY;
    }
    worst = std::max(worst, (it->second - t).abs().max().item<double>());
  }
  return worst;
}

void ExpectLossesNear(const JobRun& got, const JobRun& want, double tolerance) {
  ASSERT_EQ(got.steps.size(), want.steps.size());
  for (size_t s = 0; s < want.steps.size(); ++s) {
    EXPECT_NEAR(got.steps[s].loss, want.steps[s].loss, tolerance)
        << "step " << s;
  }
}

// One plain-SGD step at lr 1: the final parameters are the initial ones minus
// the gradient, so they compare the gradients themselves; then a few steps
// compare the losses too.
TEST(WorkerFeaturesTest, PlainSgdGradientsMatchReferenceOnEveryMeshShape) {
  const std::vector<std::string> sgd = {"--optimizer", "sgd", "--lr", "1"};
  struct Shape {
    int replicate, shard, microbatches;
  };
  for (const Shape& m : {Shape{1, 2, 1}, Shape{1, 2, 3}, Shape{2, 1, 1},
                         Shape{2, 1, 3}, Shape{2, 2, 1}, Shape{2, 2, 3}}) {
    SCOPED_TRACE(absl::StrCat(m.replicate, "x", m.shard, " microbatches ",
                              m.microbatches));
    const std::string tag =
        absl::StrCat("sgd-", m.replicate, "x", m.shard, "-", m.microbatches);
    const int world = m.replicate * m.shard;
    JobRun one = Sharded(tag, m.replicate, m.shard, sgd, 1, m.microbatches);
    JobRun ref = Reference(tag + "-ref", world, sgd, 1, m.microbatches);
    EXPECT_LT(MaxParamDiff(one, ref), 1e-6);
    ExpectLossesNear(one, ref, 1e-6);
  }
  const std::vector<std::string> sgd_small = {"--optimizer", "sgd", "--lr",
                                              "0.5"};
  JobRun sharded = Sharded("sgd-steps", 2, 2, sgd_small, 6, 3);
  JobRun ref = Reference("sgd-steps-ref", 4, sgd_small, 6, 3);
  ExpectLossesNear(sharded, ref, 1e-5);
  EXPECT_LT(MaxParamDiff(sharded, ref), 1e-5);
  EXPECT_LT(ref.steps.back().loss, ref.steps.front().loss);
}

TEST(WorkerFeaturesTest, EveryTrainingFeatureMatchesTheReference) {
  constexpr int kFeatureSteps = 6;
  struct Feature {
    std::string name;
    std::vector<std::string> flags;
    double loss_tolerance;
    double param_tolerance;
  };
  const std::vector<Feature> features = {
      {"offload", {"--cpu-offload"}, 1e-5, 1e-5},
      {"recompute", {"--recompute-units", "layers.*"}, 1e-5, 1e-5},
      {"clip", {"--clip-grad-norm", "0.05"}, 1e-5, 1e-5},
      {"schedule",
       {"--optimizer", "sgd", "--lr", "0.5", "--momentum", "0.9",
        "--weight-decay", "0.01", "--lr-schedule", "cosine", "--warmup-steps",
        "2", "--min-lr", "0.05"},
       1e-5,
       1e-5},
      {"tied", {"--task-option", "tie_embeddings=true"}, 1e-5, 1e-5},
      // bf16 compute against the fp32 reference: close, not equal.
      {"bf16", {"--param-dtype", "bf16"}, 3e-2, 3e-2},
  };
  for (const Feature& f : features) {
    SCOPED_TRACE(f.name);
    JobRun sharded = Sharded(f.name, 1, 2, f.flags, kFeatureSteps);
    JobRun ref = Reference(f.name + "-ref", 2, f.flags, kFeatureSteps);
    ExpectLossesNear(sharded, ref, f.loss_tolerance);
    EXPECT_LT(MaxParamDiff(sharded, ref), f.param_tolerance);
  }
}

TEST(WorkerFeaturesTest, RecomputeAndOffloadNeverChangeTheNumbers) {
  JobRun plain = Sharded("plain", 1, 2, {}, 4);
  for (const std::vector<std::string>& flags :
       {std::vector<std::string>{"--recompute-units", "layers.*"},
        std::vector<std::string>{"--cpu-offload"}}) {
    JobRun other = Sharded("variant", 1, 2, flags, 4);
    ASSERT_EQ(other.steps.size(), plain.steps.size());
    for (size_t s = 0; s < plain.steps.size(); ++s) {
      EXPECT_EQ(other.steps[s].loss_hex, plain.steps[s].loss_hex)
          << flags[0] << " step " << s;
    }
  }
}

// Hierarchical reshard through the whole stack: four workers that report two
// hosts (--host-id a, a, b, b) on a 1x4 mesh form a generation with host
// groups of two; with reshard_after_forward_within_host every worker builds
// its host group and the job trains the numbers of the same job without it,
// bit for bit, its final parameters too.
TEST(WorkerFeaturesTest, ReshardWithinHostAcrossTwoHostsKeepsTheNumbers) {
  constexpr int kWorld = 4;
  constexpr int kJobSteps = 4;
  auto run = [&](const std::string& name, bool within) {
    Cluster c(name);
    const std::string policy = c.dir() + "/policy.json";
    std::ofstream(policy) << "{\"reshardAfterForwardWithinHost\": "
                          << (within ? "true" : "false") << "}\n";
    c.StartCoordinator(kWorld, "1x4", 0, policy);
    for (int r = 0; r < kWorld; ++r) {
      c.workers().push_back(
          c.StartWorker(r,
                        {"--host-id", r < 2 ? "host-a" : "host-b",
                         "--final-params", c.dir() + "/final.pt"},
                        kJobSteps));
    }
    c.WaitWorkers();
    for (int r = 0; r < kWorld; ++r) {
      // Every worker built the host group the generation named.
      EXPECT_NE(ReadFile(c.worker_log(r)).find("host (2 ranks)"),
                std::string::npos)
          << ReadFile(c.worker_log(r));
    }
    EXPECT_NE(ReadFile(c.coordinator().log).find("spans hosts host-a, host-b"),
              std::string::npos);
    return JobRun{ReadReport(c.report(0)), LoadParams(c.dir() + "/final.pt")};
  };
  const JobRun plain = run("hosts-plain", false);
  const JobRun within = run("hosts-within", true);
  ASSERT_EQ(within.steps.size(), static_cast<size_t>(kJobSteps));
  ASSERT_EQ(plain.steps.size(), within.steps.size());
  for (size_t s = 0; s < plain.steps.size(); ++s) {
    EXPECT_EQ(within.steps[s].loss_hex, plain.steps[s].loss_hex)
        << "step " << s;
    // The backward gathers moved to the host group.
    EXPECT_EQ(plain.steps[s].host_all_gathers, 0) << "step " << s;
    EXPECT_GT(within.steps[s].host_all_gathers, 0) << "step " << s;
    EXPECT_EQ(within.steps[s].all_gathers + within.steps[s].host_all_gathers,
              plain.steps[s].all_gathers)
        << "step " << s;
  }
  EXPECT_EQ(MaxParamDiff(within, plain), 0.0);
}

TEST(WorkerFeaturesTest, TokenFileTrainsLikeTheReference) {
  Cluster scratch("tokens-data");
  // A headerless uint16 token file over a 300-token vocabulary.
  const std::string path = scratch.dir() + "/train.bin";
  {
    std::ofstream out(path, std::ios::binary);
    for (int i = 0; i < 20000; ++i) {
      const uint16_t token = static_cast<uint16_t>((i * 31 + (i / 7)) % 300);
      out.write(reinterpret_cast<const char*>(&token), sizeof(token));
    }
  }
  const std::vector<std::string> flags = {"--data", "tokens-u16:" + path,
                                          "--vocab-size", "300"};
  JobRun sharded = Sharded("tokens", 2, 2, flags, 5);
  JobRun ref = Reference("tokens-ref", 4, flags, 5);
  ExpectLossesNear(sharded, ref, 1e-5);
  EXPECT_LT(MaxParamDiff(sharded, ref), 1e-5);
  // The head is vocabulary-sized.
  EXPECT_EQ(ref.params.at("head.weight").size(0), 300);
}

TEST(WorkerFeaturesTest, WorkerWithOtherSettingsIsRefusedNamingTheField) {
  Cluster c("settings");
  c.StartCoordinator(2, "1x2");
  c.workers().push_back(c.StartWorker(0, {"--lr", "0.003"}, 20));
  // Give the first worker time to join and record the job's settings.
  const auto deadline = Clock::now() + std::chrono::seconds(30);
  std::string status;
  while (Clock::now() < deadline) {
    c.Ctl({"status"}, &status);
    if (status.find("adamw lr=0.003") != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_NE(status.find("adamw lr=0.003"), std::string::npos) << status;
  ExpectOneLineError(
      {Bin("hsdp-worker"), "--coordinator", c.address(), "--job-id", "e2e",
       "--model", "gpt-tiny", "--dims", kDims, "--steps", "20",
       "--microbatch-size", "2", "--lr", "0.001", "--coordinator-timeout", "5"},
      "training setting optimizer.lr differs: this worker has 0.001, the job "
      "has 0.003",
      "settings-refused");
}

}  // namespace
}  // namespace hsdp::e2e
