// Typed task options (task_options.h): defaults, canonical values, refusals
// that name the option; and WorkerMain with a TaskDefinition: --help lists the
// task's options and the runner's flags but none of the built-in GPT's, and a
// bad option stops the binary with one line.
#include "hsdp/task_options.h"

#include <signal.h>

#include <csignal>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "hsdp/worker_main.h"

namespace hsdp::train {
namespace {

constexpr int kExitUsage = 2;

TaskOptionSpec Spec() {
  TaskOptionSpec spec;
  spec.Int("channels", 8, "width of every block", 1, 4096)
      .Double("dropout", 0.25, "dropout probability", 0, 1)
      .Bool("bias", false, "linear layers with bias")
      .String("norm", "group", "group or layer");
  return spec;
}

TEST(TaskOptionsTest, DefaultsAndCanonicalValues) {
  absl::StatusOr<TaskOptionValues> v = Spec().Parse({});
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->GetInt("channels"), 8);
  EXPECT_DOUBLE_EQ(v->GetDouble("dropout"), 0.25);
  EXPECT_FALSE(v->GetBool("bias"));
  EXPECT_EQ(v->GetString("norm"), "group");
  EXPECT_EQ(v->AsMap().size(), 4u);

  v = Spec().Parse(
      {{"channels", "016"}, {"dropout", "0.50"}, {"bias", "1"}, {"norm", "x"}});
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->GetInt("channels"), 16);
  // Spelt differently, reported the same: the coordinator compares text.
  EXPECT_EQ(v->AsMap().at("channels"), "16");
  EXPECT_EQ(v->AsMap().at("dropout"), "0.5");
  EXPECT_EQ(v->AsMap().at("bias"), "true");
  EXPECT_TRUE(v->GetBool("bias"));
  // Another type, or an undeclared name: the zero value.
  EXPECT_EQ(v->GetInt("dropout"), 0);
  EXPECT_EQ(v->GetString("depth"), "");
  EXPECT_FALSE(v->Has("depth"));
}

TEST(TaskOptionsTest, UnknownOrMistypedOptionsAreRefusedNamingThem) {
  const std::vector<std::pair<std::map<std::string, std::string>, std::string>>
      cases = {
          {{{"depth", "3"}},
           "--task-option depth: not an option of this task (it has "
           "channels, dropout, bias, norm)"},
          {{{"channels", "eight"}},
           "--task-option channels=eight: want an integer in [1, 4096]"},
          {{{"channels", "0"}}, "--task-option channels=0: want an integer"},
          {{{"channels", "2.5"}}, "--task-option channels=2.5"},
          {{{"dropout", "1.5"}},
           "--task-option dropout=1.5: want a finite number in [0, 1]"},
          {{{"dropout", "nan"}}, "--task-option dropout=nan"},
          {{{"bias", "maybe"}}, "--task-option bias=maybe: want true or false"},
      };
  for (const auto& [given, needle] : cases) {
    absl::StatusOr<TaskOptionValues> v = Spec().Parse(given);
    ASSERT_FALSE(v.ok()) << needle;
    EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StartsWith(v.status().message(), needle)) << v.status();
  }
}

TEST(TaskOptionsTest, HelpListsTypesDefaultsAndRanges) {
  const std::string help = Spec().Help();
  EXPECT_TRUE(absl::StrContains(
      help, "  channels=INT in [1, 4096] (default 8): width of every block\n"))
      << help;
  EXPECT_TRUE(absl::StrContains(help, "  bias=true|false (default false)"))
      << help;
  EXPECT_TRUE(absl::StrContains(help, "  norm=TEXT (default group)")) << help;
}

// A task that is never run: these tests stop at the command line.
TaskDefinition Definition() {
  TaskDefinition d;
  d.name = "toy";
  d.description = "a toy model for the tests";
  d.options = Spec();
  d.make =
      [](const TaskOptionValues&) -> absl::StatusOr<std::unique_ptr<Task>> {
    return absl::UnimplementedError("not built in this test");
  };
  return d;
}

// WorkerMain(definition) on `args`: its exit code, stdout and stderr.
struct MainResult {
  int code = -1;
  std::string out, err;
};

MainResult Main(std::vector<std::string> args) {
  args.insert(args.begin(), "toy-worker");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  MainResult r;
  r.code = WorkerMain(static_cast<int>(argv.size()), argv.data(), Definition());
  r.out = ::testing::internal::GetCapturedStdout();
  r.err = ::testing::internal::GetCapturedStderr();
  return r;
}

TEST(WorkerMainDefinitionTest, HelpListsTheTaskAndRunnerFlagsButNoGptFlag) {
  const MainResult r = Main({"--help"});
  EXPECT_EQ(r.code, 0) << r.err;
  for (const char* want :
       {"a toy model for the tests", "--task-option NAME=VALUE",
        "channels=INT in [1, 4096] (default 8)", "--steps", "--lr",
        "--on-nonfinite", "--reference", "--report-file"}) {
    EXPECT_TRUE(absl::StrContains(r.out, want)) << want << "\n" << r.out;
  }
  for (const char* gpt : {"--dims", "--vocab-size", "--data", "--units",
                          "--model", "built-in corpus", "d_model"}) {
    EXPECT_FALSE(absl::StrContains(r.out, gpt)) << gpt << "\n" << r.out;
  }
}

TEST(WorkerMainDefinitionTest, BadOptionsAndGptFlagsAreRefusedInOneLine) {
  MainResult r = Main({"--task-option", "chanels=8"});
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_EQ(r.err,
            "toy-worker: --task-option chanels: not an option of this task "
            "(it has channels, dropout, bias, norm)\n");
  r = Main({"--task-option", "channels=wide"});
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_TRUE(absl::StrContains(r.err, "--task-option channels=wide")) << r.err;
  r = Main({"--dims", "64,2,4,32"});
  EXPECT_EQ(r.code, kExitUsage);
  EXPECT_TRUE(absl::StrContains(r.err, "--dims")) << r.err;
  // Valid options reach the task's factory, whose error ends the run.
  r = Main(
      {"--task-option", "channels=16", "--reference", "--world-size", "1"});
  EXPECT_EQ(r.code, 1);
  EXPECT_TRUE(absl::StrContains(r.err, "not built in this test")) << r.err;
}

// A worker binary survives writing to a peer that went away: Gloo writes to
// its sockets without MSG_NOSIGNAL, so the process must ignore SIGPIPE.
TEST(WorkerMainDefinitionTest, SigpipeIsIgnored) {
  std::signal(SIGPIPE, SIG_DFL);
  EXPECT_EQ(Main({"--help"}).code, 0);
  struct sigaction now = {};
  ASSERT_EQ(sigaction(SIGPIPE, nullptr, &now), 0);
  EXPECT_EQ(now.sa_handler, SIG_IGN);
}

}  // namespace
}  // namespace hsdp::train
