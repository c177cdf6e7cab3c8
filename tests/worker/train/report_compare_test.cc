// Report files as the runner writes them (ReportFile): valid JSON with a
// non-finite loss, settings on the first line and on a change; and their
// comparison (report_compare.h, hsdp-compare): the figures on a known pair of
// files, and refusals that name the differing setting.
#include "worker/train/report_compare.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "worker/train/report_file.h"
#include "worker/train/training_options.h"

namespace hsdp::train {
namespace {

std::string FreshFile(const std::string& name) {
  const std::string path =
      absl::StrCat(::testing::TempDir(), "/", getpid(), "-", name);
  std::remove(path.c_str());
  return path;
}

std::vector<std::string> Lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> out;
  std::string line;
  while (std::getline(in, line)) out.push_back(line);
  return out;
}

RunSettings Settings(int world = 2, int micro = 1,
                     int64_t microbatch_size = 4) {
  TrainingOptions t;
  t.steps = 4;
  t.microbatch_size = microbatch_size;
  t.seed = 3;
  TaskArgs args;
  args.options["channels"] = "8";
  return RunSettings{world, micro, world * micro * microbatch_size,
                     ToProto(t, args, "resnet", 1)};
}

// A reference of `losses`, written as RunReference writes it.
std::string WriteReference(const std::string& name,
                           const std::vector<double>& losses,
                           const RunSettings& settings) {
  const std::string path = FreshFile(name);
  ReportFile file;
  EXPECT_TRUE(file.Open(path).ok());
  file.SetSettings(settings);
  for (size_t s = 0; s < losses.size(); ++s) {
    file.WriteReference(
        ReferenceLine{static_cast<int64_t>(s), losses[s], 0.1, ""});
  }
  return path;
}

// Rank `rank` of a sharded run with `losses`.
std::string WriteRank(const std::string& name, int rank,
                      const std::vector<double>& losses,
                      const RunSettings& settings) {
  const std::string path = FreshFile(name);
  ReportFile file;
  EXPECT_TRUE(file.Open(path).ok());
  for (size_t s = 0; s < losses.size(); ++s) {
    StepLine line;
    line.rank = rank;
    line.step = static_cast<int64_t>(s);
    line.loss = losses[s];
    line.world_size = settings.world_size;
    line.microbatches = settings.microbatches;
    file.SetSettings(settings);  // as every step does: written once
    file.Write(line);
  }
  return path;
}

ReportContents Read(const std::vector<std::string>& paths) {
  ReportContents c;
  for (const std::string& p : paths) {
    absl::Status s = ReadReportFile(p, c);
    EXPECT_TRUE(s.ok()) << s;
  }
  return c;
}

TEST(ReportFileTest, NonFiniteLossIsNullAndSettingsComeOnceOnTheFirstLine) {
  EXPECT_EQ(LossFields(std::numeric_limits<double>::quiet_NaN())
                .rfind("\"loss\":null,\"loss_hex\":\"", 0),
            0u);
  EXPECT_EQ(LossFields(-std::numeric_limits<double>::infinity()),
            "\"loss\":null,\"loss_hex\":\"-inf\"");
  EXPECT_EQ(LossFields(0.5), "\"loss\":0.5,\"loss_hex\":\"0x1p-1\"");

  const std::string path = FreshFile("lines.jsonl");
  ReportFile file;
  ASSERT_TRUE(file.Open(path).ok());
  file.SetSettings(Settings());
  file.WriteReference(ReferenceLine{0, 2.5, 0.1, ""});
  file.SetSettings(Settings());
  file.WriteReference(
      ReferenceLine{1, std::nan(""), 0.1, "step 1: the loss is \"nan\""});
  file.SetSettings(Settings(/*world=*/4));
  file.WriteReference(ReferenceLine{2, 2.0, 0.1, ""});
  const std::vector<std::string> lines = Lines(path);
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_TRUE(absl::StrContains(lines[0], ",\"settings\":{\"world_size\":2,"))
      << lines[0];
  EXPECT_FALSE(absl::StrContains(lines[1], "settings")) << lines[1];
  EXPECT_TRUE(
      absl::StrContains(lines[1],
                        "\"nonfinite\":\"step 1: the loss is \\\"nan\\\"\","
                        "\"skipped\":true"))
      << lines[1];
  EXPECT_TRUE(absl::StrContains(lines[2], "\"settings\":{\"world_size\":4,"))
      << lines[2];

  ReportContents c = Read({path});
  ASSERT_EQ(c.settings.size(), 2u);
  EXPECT_EQ(c.settings[0].training.task(), "resnet");
  EXPECT_EQ(c.settings[0].training.microbatch_size(), 4);
  EXPECT_EQ(c.settings[0].training.task_options().at("channels"), "8");
  EXPECT_EQ(c.settings[1].world_size, 4);
  ASSERT_EQ(c.steps[-1].size(), 3u);
  EXPECT_FALSE(c.steps[-1][1].loss.has_value());
  EXPECT_DOUBLE_EQ(*c.steps[-1][0].loss, 2.5);
}

TEST(ReportCompareTest, FiguresOfAKnownPair) {
  const RunSettings settings = Settings();
  const std::string ref =
      WriteReference("ref.jsonl", {2.5, 2.25, 2.0, 1.75}, settings);
  // Rank 0: bitwise equal to step 1, then off by 1e-6 and 3e-6. Rank 1: step
  // 0 already differs, by 2^-20.
  const std::string r0 = WriteRank(
      "rank0.jsonl", 0, {2.5, 2.25, 2.0 + 1e-6, 1.75 - 3e-6}, settings);
  const std::string r1 = WriteRank(
      "rank1.jsonl", 1, {2.5 + std::ldexp(1.0, -20), 2.25, 2.0}, settings);
  absl::StatusOr<Comparison> c = CompareReports(Read({r0, r1}), Read({ref}));
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(c->ranks.size(), 2u);
  const RankComparison& a = c->ranks[0];
  EXPECT_EQ(a.rank, 0);
  EXPECT_EQ(a.steps_compared, 4);
  EXPECT_NEAR(a.max_abs_diff, 3e-6, 1e-12);
  EXPECT_EQ(a.max_diff_step, 3);
  EXPECT_EQ(a.first_differing_step, 2);
  EXPECT_TRUE(a.step0_bitwise_equal);
  const RankComparison& b = c->ranks[1];
  EXPECT_EQ(b.first_differing_step, 0);
  EXPECT_FALSE(b.step0_bitwise_equal);
  EXPECT_DOUBLE_EQ(b.max_abs_diff, std::ldexp(1.0, -20));
  EXPECT_EQ(b.only_in_reference, 1);
  EXPECT_NEAR(c->max_abs_diff, 3e-6, 1e-12);

  const std::string text = FormatComparison(*c);
  EXPECT_TRUE(absl::StrContains(
      text,
      "rank 0: 4 steps, max |dloss| 3e-06 (step 3), first differing "
      "step 2, step 0 bitwise equal\n"))
      << text;
  EXPECT_TRUE(absl::StrContains(text, "rank 1: 3 steps")) << text;
  EXPECT_TRUE(absl::StrContains(text,
                                "step 0 differs, 1 reference steps not "
                                "in the run"))
      << text;
  EXPECT_TRUE(absl::StrContains(text, "not bitwise equal on every rank"))
      << text;
}

TEST(ReportCompareTest, DifferentSettingsAreRefusedNamingTheField) {
  const std::string ref = WriteReference("ref-s.jsonl", {2.5}, Settings());
  struct Case {
    RunSettings run;
    std::string needle;
  };
  std::vector<Case> cases;
  cases.push_back({Settings(/*world=*/4),
                   "world_size differs: the run has 4, "
                   "the reference has 2"});
  cases.push_back({Settings(2, /*micro=*/2), "microbatches differs"});
  {
    // Same global batch, other split: still another run.
    RunSettings s = Settings(2, 1, /*microbatch_size=*/8);
    cases.push_back({s, "global_batch differs: the run has 16"});
    s.global_batch = 8;
    cases.push_back({s,
                     "training setting microbatch_size differs: the run "
                     "has 8, the reference has 4"});
  }
  {
    RunSettings s = Settings();
    s.training.mutable_optimizer()->set_lr(0.5);
    cases.push_back({s,
                     "training setting optimizer.lr differs: the run has "
                     "0.5"});
  }
  {
    RunSettings s = Settings();
    s.training.set_seed(4);
    cases.push_back({s, "training setting seed differs"});
  }
  {
    RunSettings s = Settings();
    s.training.set_task_version(2);
    cases.push_back({s, "training setting task_version differs"});
  }
  {
    RunSettings s = Settings();
    (*s.training.mutable_task_options())["channels"] = "16";
    cases.push_back({s,
                     "training setting task_options.channels differs: the "
                     "run has 16, the reference has 8"});
  }
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string run =
        WriteRank(absl::StrCat("run-s", i, ".jsonl"), 0, {2.5}, cases[i].run);
    absl::StatusOr<Comparison> c = CompareReports(Read({run}), Read({ref}));
    ASSERT_FALSE(c.ok()) << cases[i].needle;
    EXPECT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_TRUE(absl::StrContains(c.status().message(), cases[i].needle))
        << c.status();
  }

  // Memory trades, --on-nonfinite, and steps under a constant schedule do not
  // decide the numbers.
  RunSettings same = Settings();
  same.training.set_cpu_offload(true);
  same.training.set_recompute_units("blocks.*");
  same.training.set_on_nonfinite("skip-step");
  same.training.set_steps(100);
  const std::string run = WriteRank("run-same.jsonl", 0, {2.5}, same);
  EXPECT_TRUE(CompareReports(Read({run}), Read({ref})).ok());
  // Under a cosine schedule every step's learning rate depends on steps.
  RunSettings cosine_ref = Settings(), cosine_run = Settings();
  cosine_ref.training.mutable_lr_schedule()->set_cosine(true);
  cosine_run.training.mutable_lr_schedule()->set_cosine(true);
  cosine_run.training.set_steps(8);
  absl::StatusOr<Comparison> c = CompareReports(
      Read({WriteRank("run-cos.jsonl", 0, {2.5}, cosine_run)}),
      Read({WriteReference("ref-cos.jsonl", {2.5}, cosine_ref)}));
  ASSERT_FALSE(c.ok());
  EXPECT_TRUE(absl::StrContains(
      c.status().message(), "training setting steps differs: the run has 8"))
      << c.status();
}

TEST(ReportCompareTest, FilesWithoutSettingsOrJsonAreRefused) {
  const std::string old = FreshFile("old.jsonl");
  std::ofstream(old) << "{\"rank\":-1,\"step\":0,\"loss\":2.5}\n";
  const std::string run = WriteRank("run-o.jsonl", 0, {2.5}, Settings());
  absl::StatusOr<Comparison> c = CompareReports(Read({run}), Read({old}));
  ASSERT_FALSE(c.ok());
  EXPECT_TRUE(absl::StrContains(c.status().message(),
                                "the reference carries no settings"))
      << c.status();

  const std::string bad = FreshFile("bad.jsonl");
  std::ofstream(bad) << "{\"rank\":0,\"step\":0,\"loss\":2.5}\n"
                     << "{\"rank\":0,\"step\":1,\"loss\":-nan}\n";
  ReportContents contents;
  absl::Status s = ReadReportFile(bad, contents);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), absl::StrCat(bad, ":2: "))) << s;
}

// The installed tool on the same kind of files: exit status and output.
struct ToolResult {
  int exit_code = -1;
  std::string output;
};

ToolResult RunTool(const std::string& args) {
  ToolResult r;
  FILE* p =
      popen(absl::StrCat(HSDP_COMPARE_BINARY, " ", args, " 2>&1").c_str(), "r");
  if (p == nullptr) return r;
  char buf[512];
  while (fgets(buf, sizeof(buf), p) != nullptr) r.output += buf;
  const int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

TEST(HsdpCompareTest, PrintsTheFiguresAndRefusesOtherSettings) {
  const std::string dir =
      absl::StrCat(::testing::TempDir(), "/", getpid(), "-compare-run");
  ASSERT_EQ(
      std::system(absl::StrCat("rm -rf ", dir, " && mkdir -p ", dir).c_str()),
      0);
  const RunSettings settings = Settings();
  const std::string ref =
      WriteReference("tool-ref.jsonl", {2.5, 2.25, 2.0}, settings);
  for (int r = 0; r < 2; ++r) {
    const std::string path =
        WriteRank(absl::StrCat("tool-rank", r, ".jsonl"), r,
                  {2.5, 2.25 + (r == 1 ? 1e-3 : 0.0), 2.0}, settings);
    ASSERT_EQ(std::rename(path.c_str(),
                          absl::StrCat(dir, "/worker-", r, ".jsonl").c_str()),
              0);
  }
  // A reference kept beside the workers' files is skipped.
  ASSERT_EQ(std::system(
                absl::StrCat("cp ", ref, " ", dir, "/reference.jsonl").c_str()),
            0);

  ToolResult ok = RunTool(absl::StrCat(dir, " ", dir, "/reference.jsonl"));
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_TRUE(absl::StrContains(
      ok.output,
      "rank 0: 3 steps, max |dloss| 0 (step 0), first differing "
      "step none, step 0 bitwise equal\n"))
      << ok.output;
  EXPECT_TRUE(
      absl::StrContains(ok.output,
                        "rank 1: 3 steps, max |dloss| 0.001 (step 1), first "
                        "differing step 1, step 0 bitwise equal\n"))
      << ok.output;
  EXPECT_TRUE(absl::StrContains(ok.output, "settings agree: task resnet v1"))
      << ok.output;

  ToolResult strict = RunTool(absl::StrCat("--tolerance 1e-5 ", dir, " ", ref));
  EXPECT_EQ(strict.exit_code, 1) << strict.output;
  EXPECT_TRUE(absl::StrContains(strict.output, "exceeds --tolerance"))
      << strict.output;

  RunSettings other = settings;
  other.training.mutable_optimizer()->set_lr(0.25);
  const std::string other_run = WriteRank("tool-other.jsonl", 0, {2.5}, other);
  ToolResult refused = RunTool(absl::StrCat(other_run, " ", ref));
  EXPECT_EQ(refused.exit_code, 2) << refused.output;
  EXPECT_TRUE(absl::StrContains(
      refused.output,
      "hsdp-compare: refused: training setting optimizer.lr differs: the run "
      "has 0.25, the reference has 0.003"))
      << refused.output;
}

}  // namespace
}  // namespace hsdp::train
