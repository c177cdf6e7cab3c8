#include "tests/e2e/cluster.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <torch/serialize/input-archive.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <regex>
#include <sstream>
#include <thread>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"

namespace hsdp::e2e {

namespace fs = std::filesystem;

constexpr char kBinDir[] = HSDP_BIN_DIR;

Proc Spawn(const std::vector<std::string>& argv, const std::string& log) {
  const pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    dup2(fd, STDOUT_FILENO);
    dup2(fd, STDERR_FILENO);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  return Proc{pid, log};
}

int Wait(const Proc& p, std::chrono::seconds timeout) {
  const auto deadline = Clock::now() + timeout;
  int status = 0;
  while (waitpid(p.pid, &status, WNOHANG) == 0) {
    if (Clock::now() > deadline) {
      kill(p.pid, SIGKILL);
      waitpid(p.pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

void Kill(const Proc& p, int sig) {
  kill(p.pid, sig);
  int status;
  waitpid(p.pid, &status, 0);
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> out;
  for (absl::string_view l : absl::StrSplit(text, '\n', absl::SkipEmpty()))
    out.emplace_back(l);
  return out;
}

std::string Bin(const std::string& name) {
  return absl::StrCat(kBinDir, "/", name);
}

std::string Field(const std::string& line, const std::string& key) {
  const std::string needle = absl::StrCat("\"", key, "\":");
  size_t at = line.find(needle);
  if (at == std::string::npos) return "";
  at += needle.size();
  if (line[at] == '"')
    return line.substr(at + 1, line.find('"', at + 1) - at - 1);
  return line.substr(at, line.find_first_of(",}", at) - at);
}

void ExpectSameLosses(const std::vector<std::string>& report_paths,
                      const std::vector<std::vector<StepRecord>>& base,
                      int steps) {
  ASSERT_EQ(report_paths.size(), base.size());
  for (size_t r = 0; r < report_paths.size(); ++r) {
    std::vector<StepRecord> got = ReadReport(report_paths[r]);
    ASSERT_EQ(got.size(), static_cast<size_t>(steps)) << "rank " << r;
    for (int s = 0; s < steps; ++s) {
      EXPECT_EQ(got[s].step, s) << "rank " << r;
      EXPECT_EQ(got[s].loss_hex, base[r][s].loss_hex)
          << "rank " << r << " step " << s;
    }
  }
}

std::vector<StepRecord> ReadReport(const std::string& path) {
  std::vector<StepRecord> out;
  for (const std::string& line : Lines(ReadFile(path))) {
    StepRecord r;
    EXPECT_TRUE(absl::SimpleAtoi(Field(line, "step"), &r.step)) << line;
    r.loss_hex = Field(line, "loss_hex");
    EXPECT_TRUE(absl::SimpleAtod(Field(line, "loss"), &r.loss)) << line;
    // Reference lines have no peak.
    if (const std::string peak = Field(line, "peak_memory_bytes");
        !peak.empty()) {
      EXPECT_TRUE(absl::SimpleAtoi(peak, &r.peak)) << line;
    }
    r.reshard_after_forward = Field(line, "reshard_after_forward");
    if (const std::string n = Field(line, "all_gathers"); !n.empty()) {
      EXPECT_TRUE(absl::SimpleAtoi(n, &r.all_gathers)) << line;
    }
    if (const std::string n = Field(line, "host_all_gathers"); !n.empty()) {
      EXPECT_TRUE(absl::SimpleAtoi(n, &r.host_all_gathers)) << line;
    }
    out.push_back(r);
  }
  return out;
}

std::vector<ReportLine> ReadReportLines(const std::string& path) {
  std::vector<ReportLine> out;
  for (const std::string& text : Lines(ReadFile(path))) {
    ReportLine l;
    EXPECT_TRUE(absl::SimpleAtoi(Field(text, "rank"), &l.rank)) << text;
    EXPECT_TRUE(absl::SimpleAtoi(Field(text, "step"), &l.step)) << text;
    EXPECT_TRUE(absl::SimpleAtoi(Field(text, "generation"), &l.generation))
        << text;
    EXPECT_TRUE(absl::SimpleAtoi(Field(text, "world_size"), &l.world)) << text;
    EXPECT_TRUE(
        absl::SimpleAtoi(Field(text, "first_microbatch"), &l.first_microbatch))
        << text;
    EXPECT_TRUE(
        absl::SimpleAtoi(Field(text, "microbatch_count"), &l.microbatch_count))
        << text;
    EXPECT_TRUE(absl::SimpleAtod(Field(text, "loss"), &l.loss)) << text;
    l.loss_hex = Field(text, "loss_hex");
    l.heal_crc = Field(text, "heal_crc32c");
    out.push_back(l);
  }
  return out;
}

void ExpectExactLedger(const std::vector<std::string>& reports, int steps,
                       int global_microbatches, int killed_file) {
  std::map<int64_t, int> seen;
  int64_t killed_last = -1;
  for (size_t f = 0; f < reports.size(); ++f) {
    for (const ReportLine& l : ReadReportLines(reports[f])) {
      if (static_cast<int>(f) == killed_file)
        killed_last = std::max(killed_last, l.step);
      EXPECT_EQ(l.first_microbatch >= l.step * global_microbatches &&
                    l.first_microbatch + l.microbatch_count <=
                        (l.step + 1) * global_microbatches,
                true)
          << reports[f] << " step " << l.step;
      for (int64_t g = l.first_microbatch;
           g < l.first_microbatch + l.microbatch_count; ++g)
        ++seen[g];
    }
  }
  int missing = 0;
  for (int64_t g = 0; g < int64_t{steps} * global_microbatches; ++g) {
    EXPECT_LE(seen[g], 1) << "microbatch " << g << " trained twice";
    if (seen[g] == 0) {
      ++missing;
      EXPECT_EQ(g / global_microbatches, killed_last + 1)
          << "microbatch " << g << " of a committed step is in no ledger";
    }
  }
  EXPECT_LE(missing, 1);
}

void ExpectResumedFromCheckpoint(const std::string& report,
                                 const std::string& log,
                                 const std::string& ckpt_dir, int64_t steps,
                                 const std::vector<StepRecord>& base) {
  const std::vector<StepRecord> got = ReadReport(report);
  std::smatch m;
  const std::string text = ReadFile(log);
  ASSERT_TRUE(
      std::regex_search(text, m, std::regex("resumed from step ([0-9]+)")))
      << "the restarted worker did not resume from a checkpoint: " << log;
  const int64_t from = std::stoll(m[1]);
  EXPECT_TRUE(
      fs::exists(absl::StrFormat("%s/step-%08d/metadata.json", ckpt_dir, from)))
      << "resumed from step " << from << " without that checkpoint";
  const int64_t second_run = steps - 1 - from;
  ASSERT_GE(static_cast<int64_t>(got.size()), steps) << report;
  const size_t first = got.size() - static_cast<size_t>(second_run);
  for (size_t i = 0; i < got.size(); ++i) {
    const int64_t expected = i < first
                                 ? static_cast<int64_t>(i)
                                 : from + 1 + static_cast<int64_t>(i - first);
    ASSERT_EQ(got[i].step, expected) << report << " line " << i;
    EXPECT_EQ(got[i].loss_hex, base[static_cast<size_t>(got[i].step)].loss_hex)
        << report << " step " << got[i].step;
  }
}

int64_t StepsReported(const std::string& path) {
  return static_cast<int64_t>(Lines(ReadFile(path)).size());
}

std::map<std::string, at::Tensor> LoadParams(const std::string& path) {
  torch::serialize::InputArchive archive;
  archive.load_from(path);
  std::map<std::string, at::Tensor> out;
  for (const std::string& key : archive.keys()) {
    at::Tensor t;
    archive.read(key, t);
    out[key] = t;
  }
  return out;
}

std::vector<std::string> ModelFlags(int64_t steps) {
  return {"--model",
          "gpt-tiny",
          "--dims",
          kDims,
          "--steps",
          std::to_string(steps),
          "--microbatch-size",
          "2"};
}

std::chrono::seconds ReferenceTimeout(int64_t steps) {
  return kRunTimeout + std::chrono::seconds(steps / kReferenceStepsPerSecond);
}

double MaxDiffFromReference(const std::string& params, int world, int64_t steps,
                            const std::string& dir,
                            const std::vector<std::string>& extra) {
  constexpr double kFailed = std::numeric_limits<double>::infinity();
  const std::string reference = dir + "/reference.pt";
  const std::string log = dir + "/reference.log";
  const int rc = RunReference(world, 1, steps, dir + "/reference.jsonl",
                              reference, log, extra);
  if (rc != 0) {
    ADD_FAILURE() << "the reference run failed ("
                  << (rc == -1
                          ? absl::StrCat("timed out after ",
                                         ReferenceTimeout(steps).count(), " s")
                          : absl::StrCat("exit ", rc))
                  << "): " << ReadFile(log);
    return kFailed;
  }
  const auto got = LoadParams(params);
  const auto want = LoadParams(reference);
  if (got.size() != want.size()) {
    ADD_FAILURE() << params << " has " << got.size() << " tensors, the "
                  << "reference " << want.size();
    return kFailed;
  }
  double max_diff = 0;
  for (const auto& [name, t] : want) {
    if (got.count(name) == 0) {
      ADD_FAILURE() << params << " has no " << name;
      return kFailed;
    }
    max_diff =
        std::max(max_diff, (got.at(name) - t).abs().max().item<double>());
  }
  return max_diff;
}

int RunReference(int world, int microbatches, int64_t steps,
                 const std::string& report, const std::string& params,
                 const std::string& log,
                 const std::vector<std::string>& extra) {
  std::vector<std::string> argv = {
      Bin("hsdp-worker"), "--reference",
      "--world-size",     std::to_string(world),
      "--microbatches",   std::to_string(microbatches),
      "--report-file",    report};
  const std::vector<std::string> model = ModelFlags(steps);
  argv.insert(argv.end(), model.begin(), model.end());
  if (!params.empty()) argv.insert(argv.end(), {"--final-params", params});
  argv.insert(argv.end(), extra.begin(), extra.end());
  return Wait(Spawn(argv, log), ReferenceTimeout(steps));
}

void ExpectOneLineError(const std::vector<std::string>& argv,
                        const std::string& needle, const std::string& name) {
  Cluster scratch("bad-" + name);  // a directory removed when the test passes
  const std::string log = scratch.dir() + "/output.log";
  const int rc = Wait(Spawn(argv, log), std::chrono::seconds(60));
  const std::string out = ReadFile(log);
  EXPECT_NE(rc, 0) << out;
  EXPECT_NE(rc, -1) << "timed out: " << out;
  EXPECT_EQ(Lines(out).size(), 1u) << out;
  EXPECT_NE(out.find(needle), std::string::npos) << out;
}

Cluster::Cluster(const std::string& name) {
  dir_ = (fs::path(::testing::TempDir()) /
          absl::StrCat("hsdp-e2e-", name, "-", getpid()))
             .string();
  fs::remove_all(dir_);
  fs::create_directories(dir_);
}

Cluster::~Cluster() {
  for (const Proc& p : workers_) kill(p.pid, SIGKILL);
  if (coordinator_.pid > 0) kill(coordinator_.pid, SIGKILL);
  for (const Proc& p : workers_) waitpid(p.pid, nullptr, 0);
  if (coordinator_.pid > 0) waitpid(coordinator_.pid, nullptr, 0);
  if (!keep_ && !::testing::Test::HasFailure()) {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
}

namespace {

// argv[0] and `defaults` (flag, value pairs), then `extra`. CLI11 refuses a
// repeated option: a default that `extra` names again is dropped (with its
// value), and so is `drop`.
std::vector<std::string> MergeFlags(const std::vector<std::string>& defaults,
                                    const std::vector<std::string>& extra,
                                    const std::string& drop) {
  std::vector<std::string> merged = {defaults[0]};
  for (size_t i = 1; i + 1 < defaults.size(); i += 2) {
    const bool overridden =
        std::find(extra.begin(), extra.end(), defaults[i]) != extra.end() ||
        defaults[i] == drop;
    if (!overridden)
      merged.insert(merged.end(), {defaults[i], defaults[i + 1]});
  }
  merged.insert(merged.end(), extra.begin(), extra.end());
  return merged;
}

}  // namespace

std::vector<std::string> CoordinatorArgv(
    const std::string& dir, int world, const std::string& mesh,
    const std::string& listen, const std::vector<std::string>& extra) {
  const std::vector<std::string> args = {Bin("hsdp-coordinator"),
                                         "--job-id",
                                         "e2e",
                                         "--world-size",
                                         std::to_string(world),
                                         "--mesh",
                                         mesh,
                                         "--listen",
                                         listen,
                                         "--port-file",
                                         dir + "/port",
                                         "--state-dir",
                                         dir + "/state",
                                         "--metrics-listen",
                                         "",
                                         "--heartbeat-timeout",
                                         "30"};
  return MergeFlags(args, extra, "");
}

std::vector<std::string> WorkerArgv(const std::string& coordinator, int rank,
                                    const std::string& report,
                                    const std::vector<std::string>& extra,
                                    int64_t steps) {
  std::vector<std::string> args = {Bin("hsdp-worker"),
                                   "--coordinator",
                                   coordinator,
                                   "--job-id",
                                   "e2e",
                                   "--rank-hint",
                                   std::to_string(rank),
                                   "--gloo-hostname",
                                   "127.0.0.1",
                                   "--report-file",
                                   report,
                                   "--collective-timeout",
                                   "60",
                                   "--coordinator-timeout",
                                   "60"};
  const std::vector<std::string> model = ModelFlags(steps);
  args.insert(args.end(), model.begin(), model.end());
  // An extra --model drops the GPT's --dims too.
  const bool own_model =
      std::find(extra.begin(), extra.end(), "--model") != extra.end();
  return MergeFlags(args, extra, own_model ? "--dims" : "");
}

void Cluster::StartCoordinator(int world, const std::string& mesh, int port,
                               const std::string& policy_file,
                               const std::vector<std::string>& extra) {
  const std::string port_file = dir_ + "/port";
  fs::remove(port_file);
  std::vector<std::string> flags = extra;
  if (!policy_file.empty()) {
    flags.insert(flags.begin(), {"--policy-file", policy_file});
  }
  const std::vector<std::string> args = CoordinatorArgv(
      dir_, world, mesh, absl::StrCat("127.0.0.1:", port), flags);
  coordinator_ = Spawn(args, dir_ + "/coordinator.log");
  const auto deadline = Clock::now() + std::chrono::seconds(20);
  while (Clock::now() < deadline) {
    std::string text = ReadFile(port_file);
    if (absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &port_) && port_ > 0)
      return;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ADD_FAILURE() << "coordinator did not start: "
                << ReadFile(dir_ + "/coordinator.log");
}

Proc Cluster::StartWorker(int rank, const std::vector<std::string>& extra,
                          int64_t steps) {
  return Spawn(WorkerArgv(address(), rank, report(rank), extra, steps),
               worker_log(rank));
}

void Cluster::StartWorkers(int n, const std::vector<std::string>& extra,
                           int64_t steps) {
  workers_.clear();
  for (int r = 0; r < n; ++r) workers_.push_back(StartWorker(r, extra, steps));
}

void Cluster::WaitWorkers() {
  for (size_t r = 0; r < workers_.size(); ++r) {
    EXPECT_EQ(Wait(workers_[r]), 0)
        << "worker " << r << ": " << ReadFile(workers_[r].log);
  }
  workers_.clear();
}

bool Cluster::WaitForSteps(int64_t steps, int rank) {
  const auto deadline = Clock::now() + kRunTimeout;
  while (Clock::now() < deadline) {
    if (StepsReported(report(rank)) >= steps) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

int Cluster::Ctl(const std::vector<std::string>& args, std::string* output) {
  std::vector<std::string> argv = {Bin("hsdpctl"), "--coordinator", address()};
  argv.insert(argv.end(), args.begin(), args.end());
  const std::string log = dir_ + "/hsdpctl.out";
  fs::remove(log);
  const int rc = Wait(Spawn(argv, log), std::chrono::seconds(30));
  if (output != nullptr) *output = ReadFile(log);
  return rc;
}

std::string Cluster::address() const {
  return absl::StrCat("127.0.0.1:", port_);
}

std::string Cluster::report(int r) const {
  return absl::StrCat(dir_, "/worker-", r, ".jsonl");
}

std::string Cluster::worker_log(int r) const {
  return absl::StrCat(dir_, "/worker-", r, ".log");
}

BaselineRun::BaselineRun(std::string name, int workers, std::string mesh,
                         std::vector<std::string> worker_flags, int steps)
    : name_(std::move(name)),
      workers_(workers),
      mesh_(std::move(mesh)),
      worker_flags_(std::move(worker_flags)),
      steps_(steps) {}

const std::vector<std::vector<StepRecord>>& BaselineRun::Reports() {
  if (!reports_.has_value()) {
    reports_.emplace();
    Cluster c(name_);
    c.StartCoordinator(workers_, mesh_);
    c.StartWorkers(workers_, worker_flags_, steps_);
    c.WaitWorkers();
    for (int r = 0; r < workers_; ++r) {
      reports_->push_back(ReadReport(c.report(r)));
    }
  }
  return *reports_;
}

void BaselineRun::ExpectSameAs(const Cluster& c) {
  std::vector<std::string> reports;
  for (int r = 0; r < workers_; ++r) reports.push_back(c.report(r));
  ExpectSameLosses(reports, Reports(), steps_);
}

}  // namespace hsdp::e2e
