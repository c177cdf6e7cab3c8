// End-to-end for --model torchscript:PATH: a GPT written in Python
// (examples/torchscript/gpt.py), scripted by running python3 inside the test,
// trained by real hsdp-coordinator and hsdp-worker processes on 2x2:
//   losses within 1e-5 of the same scripted model trained single-process
//   (--reference), final parameters loaded back into the Python model with
//   load_state_dict; reshard after forward off from the start, and switched off
//   mid-run by hsdpctl, both bitwise equal to the default run; checkpoint, kill
//   everything, restart: losses continue bit for bit;
// and bad models refused by hsdp-worker in one line, before it joins.
#include <torch/csrc/jit/serialization/import.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <system_error>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "tests/e2e/cluster.h"

namespace hsdp::e2e {
namespace {

namespace fs = std::filesystem;
constexpr int kWorkers = 4;
constexpr char kMesh[] = "2x2";
constexpr int kTsSteps = 24;
// The scripted model's dims: kDims ("32,4,2,24") as gpt.py flags.
const std::vector<std::string> kGptFlags = {
    "--d-model", "32", "--n-layers", "4", "--n-heads", "2", "--seq-len", "24"};

bool HavePython() { return !std::string(HSDP_TORCH_PYTHON).empty(); }

int Python(const std::vector<std::string>& args, const std::string& log) {
  std::vector<std::string> argv = {HSDP_TORCH_PYTHON};
  argv.insert(argv.end(), args.begin(), args.end());
  return Wait(Spawn(argv, log), std::chrono::seconds(120));
}

// The scripted GPT and the test's bad models, made once per binary in a
// directory removed when it exits.
struct ScriptedModels {
  ScriptedModels()
      : dir((fs::temp_directory_path() /
             absl::StrCat("hsdp-ts-e2e-", ::getpid()))
                .string()) {
    fs::create_directories(dir);
    std::vector<std::string> args = {
        absl::StrCat(HSDP_SOURCE_DIR, "/examples/torchscript/gpt.py"),
        dir + "/gpt.pt"};
    args.insert(args.end(), kGptFlags.begin(), kGptFlags.end());
    EXPECT_EQ(Python(args, dir + "/gpt.log"), 0) << ReadFile(dir + "/gpt.log");
    EXPECT_EQ(Python({absl::StrCat(HSDP_SOURCE_DIR, "/tests/worker/models/",
                                   "make_scripted_models.py"),
                      dir + "/bad"},
                     dir + "/bad.log"),
              0)
        << ReadFile(dir + "/bad.log");
  }
  ~ScriptedModels() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
  ScriptedModels(const ScriptedModels&) = delete;
  ScriptedModels& operator=(const ScriptedModels&) = delete;
  const std::string dir;
};

const std::string& ModelDir() {
  static const ScriptedModels models;
  return models.dir;
}

std::string ModelPath() { return ModelDir() + "/gpt.pt"; }

// Worker flags selecting the scripted model.
std::vector<std::string> ScriptedFlags(std::vector<std::string> more = {}) {
  std::vector<std::string> flags = {"--model", "torchscript:" + ModelPath(),
                                    "--units", "layers.*"};
  flags.insert(flags.end(), more.begin(), more.end());
  return flags;
}

#define REQUIRE_PYTHON() \
  if (!HavePython()) GTEST_SKIP() << "no python3 with torch"

// The default 2x2 run every other run is compared with.
BaselineRun& Baseline() {
  static auto* baseline = new BaselineRun("ts-baseline", kWorkers, kMesh,
                                          ScriptedFlags(), kTsSteps);
  return *baseline;
}

TEST(TorchScriptE2eTest, TwoByTwoMatchesSingleProcessAndExportsToPython) {
  REQUIRE_PYTHON();
  Cluster c("ts-parity");
  c.StartCoordinator(kWorkers, kMesh);
  c.StartWorkers(kWorkers,
                 ScriptedFlags({"--final-params", c.dir() + "/final.pt"}),
                 kTsSteps);
  c.WaitWorkers();
  const std::vector<StepRecord> sharded = ReadReport(c.report(0));
  ASSERT_EQ(sharded.size(), static_cast<size_t>(kTsSteps));

  const std::string ref_report = c.dir() + "/ref.jsonl";
  std::vector<std::string> ref_args = {
      Bin("hsdp-worker"),  "--reference",
      "--world-size",      std::to_string(kWorkers),
      "--microbatches",    "1",
      "--steps",           std::to_string(kTsSteps),
      "--microbatch-size", "2",
      "--report-file",     ref_report,
      "--final-params",    c.dir() + "/ref.pt"};
  for (const std::string& f : ScriptedFlags()) ref_args.push_back(f);
  Proc ref = Spawn(ref_args, c.dir() + "/ref.log");
  ASSERT_EQ(Wait(ref), 0) << ReadFile(ref.log);
  const std::vector<StepRecord> reference = ReadReport(ref_report);
  ASSERT_EQ(reference.size(), static_cast<size_t>(kTsSteps));
  EXPECT_EQ(sharded[0].loss_hex, reference[0].loss_hex);
  for (int s = 0; s < kTsSteps; ++s) {
    EXPECT_NEAR(sharded[s].loss, reference[s].loss, 1e-5) << "step " << s;
  }
  EXPECT_LT(reference.back().loss, reference.front().loss - 0.5);  // learns

  // Python: load_state_dict the sharded run's final parameters into gpt.py's
  // model and script it again; every value must come back bit for bit.
  std::vector<std::string> load = {
      absl::StrCat(HSDP_SOURCE_DIR,
                   "/examples/torchscript/load_final_params.py"),
      c.dir() + "/final.pt", "--check", "--save", c.dir() + "/trained.pt"};
  load.insert(load.end(), kGptFlags.begin(), kGptFlags.end());
  ASSERT_EQ(Python(load, c.dir() + "/load.log"), 0)
      << ReadFile(c.dir() + "/load.log");
  std::map<std::string, at::Tensor> final_params =
      LoadParams(c.dir() + "/final.pt");
  torch::jit::Module trained = torch::jit::load(c.dir() + "/trained.pt");
  size_t n = 0;
  for (const auto& p : trained.named_parameters()) {
    ASSERT_TRUE(final_params.count(p.name)) << p.name;
    EXPECT_TRUE(at::equal(p.value, final_params[p.name])) << p.name;
    ++n;
  }
  EXPECT_EQ(n, final_params.size());
  // ...and they are trained: they differ from the saved initial values.
  torch::jit::Module initial = torch::jit::load(ModelPath());
  for (const auto& p : initial.named_parameters()) {
    if (p.name == "layers.0.qkv.weight") {
      EXPECT_FALSE(at::equal(p.value, final_params[p.name]));
    }
  }
}

TEST(TorchScriptE2eTest, ReshardAfterForwardOffGivesBitwiseEqualLosses) {
  REQUIRE_PYTHON();
  Baseline().Reports();
  Cluster c("ts-reshard-off");
  const std::string policy = c.dir() + "/policy.json";
  std::ofstream(policy) << "{\"reshardAfterForward\": false}\n";
  c.StartCoordinator(kWorkers, kMesh, 0, policy);
  c.StartWorkers(kWorkers, ScriptedFlags(), kTsSteps);
  c.WaitWorkers();
  Baseline().ExpectSameAs(c);
  for (const StepRecord& s : ReadReport(c.report(0))) {
    EXPECT_EQ(s.reshard_after_forward.find('1'), std::string::npos)
        << "step " << s.step << " resharded: " << s.reshard_after_forward;
  }
  // The baseline resharded its blocks after forward.
  EXPECT_NE(Baseline().Reports()[0][0].reshard_after_forward.find('1'),
            std::string::npos);
}

TEST(TorchScriptE2eTest, PolicyChangeMidRunKeepsLossesBitwise) {
  REQUIRE_PYTHON();
  Baseline().Reports();
  Cluster c("ts-policy");
  c.StartCoordinator(kWorkers, kMesh);
  c.StartWorkers(kWorkers, ScriptedFlags(), kTsSteps);
  ASSERT_TRUE(c.WaitForSteps(4));
  std::string out;
  ASSERT_EQ(c.Ctl({"policy", "set", "--reshard-after-forward=false"}, &out), 0)
      << out;
  c.WaitWorkers();
  Baseline().ExpectSameAs(c);
  std::vector<StepRecord> r0 = ReadReport(c.report(0));
  int changed = -1;
  for (int s = 0; s < kTsSteps && changed < 0; ++s) {
    if (r0[s].reshard_after_forward.find('1') == std::string::npos) changed = s;
  }
  ASSERT_GT(changed, 0) << "policy change never took effect";
  for (int r = 1; r < kWorkers; ++r) {
    std::vector<StepRecord> rr = ReadReport(c.report(r));
    EXPECT_EQ(rr[changed].reshard_after_forward,
              r0[changed].reshard_after_forward);
  }
  EXPECT_GT(r0[changed].peak, r0[changed - 1].peak);
}

TEST(TorchScriptE2eTest, CheckpointKillRestartContinuesBitForBit) {
  REQUIRE_PYTHON();
  Baseline().Reports();
  Cluster c("ts-checkpoint");
  const std::string policy = c.dir() + "/policy.json";
  std::ofstream(policy) << "{\"checkpointInterval\": 5}\n";
  const std::string ckpt = c.dir() + "/ckpt";
  c.StartCoordinator(kWorkers, kMesh, 0, policy);
  const int port = c.port();
  c.StartWorkers(kWorkers, ScriptedFlags({"--checkpoint-dir", ckpt}), kTsSteps);
  ASSERT_TRUE(c.WaitForSteps(12));
  // The coordinator goes first: alive, it would re-form the workers not yet
  // killed on a smaller mesh when the first ones die.
  Kill(c.coordinator());
  for (Proc& p : c.workers()) Kill(p);
  c.workers().clear();
  const int64_t before = StepsReported(c.report(0));
  ASSERT_LT(before, kTsSteps) << "the workers finished before the kill";
  // A worker slow to start on a loaded machine is waited for, so every rank
  // resumes from the checkpoint rather than joining later to be healed.
  c.StartCoordinator(kWorkers, kMesh, port, policy, {"--reform-window", "60"});
  c.StartWorkers(kWorkers, ScriptedFlags({"--checkpoint-dir", ckpt}), kTsSteps);
  c.WaitWorkers();

  const auto& base = Baseline().Reports();
  for (int r = 0; r < kWorkers; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    ExpectResumedFromCheckpoint(c.report(r), c.worker_log(r), ckpt, kTsSteps,
                                base[r]);
  }
}

// Refused before joining: the coordinator address is unreachable, so any
// other error than the model's would be about the coordinator.
void ExpectRefused(const std::string& model, const std::string& units,
                   const std::string& needle, const std::string& name) {
  std::vector<std::string> argv = {
      Bin("hsdp-worker"),      "--model", model, "--coordinator", "127.0.0.1:1",
      "--coordinator-timeout", "5"};
  if (!units.empty()) {
    argv.push_back("--units");
    argv.push_back(units);
  }
  ExpectOneLineError(argv, needle, "ts-" + name);
}

TEST(TorchScriptE2eTest, BadModelsAreRefusedInOneLine) {
  REQUIRE_PYTHON();
  const std::string bad = ModelDir() + "/bad";
  const std::string text = ModelDir() + "/text.pt";
  std::ofstream(text) << "not a model\n";
  ExpectRefused("torchscript:" + text, "", "not a TorchScript archive",
                "archive");
  ExpectRefused("torchscript:" + bad + "/no_head_loss.pt", "",
                "has no method head_loss", "method");
  ExpectRefused("torchscript:" + bad + "/bad_signature.pt", "",
                "method 'head_loss' has the wrong signature", "signature");
  ExpectRefused("torchscript:" + ModelPath(), "blocks.*",
                "'blocks.*' matches no submodule", "nomatch");
  ExpectRefused("torchscript:" + ModelPath(), "layers.*,layers.*.fc",
                "units overlap", "overlap");
}

}  // namespace
}  // namespace hsdp::e2e
