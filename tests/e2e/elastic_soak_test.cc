// Elastic soak (not in the default test set; see tests/e2e/CMakeLists.txt): a
// 3x2 job of real worker processes trains kSoakSteps steps while workers are
// killed with SIGKILL at random, one at a time, and each is replaced by a new
// process that joins and is healed. At the end the sample ledger of every
// report file covers every global microbatch of every committed step exactly
// once, and the final parameters match single-process training on the same
// global batches (FIXED batch mode; the meshes differ in reduction order, so
// within fp32 tolerance, and the test prints the largest difference).
//
//   build/tests/e2e/elastic_soak_test        (env: HSDP_SOAK_STEPS,
//   HSDP_SOAK_KILLS, HSDP_SOAK_SEED)
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <random>
#include <set>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "tests/e2e/cluster.h"

namespace hsdp::e2e {
namespace {

constexpr int kReplicas = 3;
constexpr int kShards = 2;
constexpr int kWorld = kReplicas * kShards;
constexpr double kParamTolerance = 1e-6;

int EnvInt(const char* name, int fallback) {
  const char* v = std::getenv(name);
  int out = 0;
  return v != nullptr && absl::SimpleAtoi(v, &out) ? out : fallback;
}

struct Entry {
  int64_t step = 0;
  int64_t generation = 0;
  int64_t first = 0;
  int64_t count = 0;
};

std::vector<Entry> Ledger(const std::string& path) {
  std::vector<Entry> out;
  for (const std::string& line : Lines(ReadFile(path))) {
    Entry e;
    EXPECT_TRUE(absl::SimpleAtoi(Field(line, "step"), &e.step)) << line;
    EXPECT_TRUE(absl::SimpleAtoi(Field(line, "generation"), &e.generation));
    EXPECT_TRUE(absl::SimpleAtoi(Field(line, "first_microbatch"), &e.first));
    EXPECT_TRUE(absl::SimpleAtoi(Field(line, "microbatch_count"), &e.count));
    out.push_back(e);
  }
  return out;
}

int64_t Progress(const std::string& path) {
  const std::vector<Entry> l = Ledger(path);
  return l.empty() ? -1 : l.back().step;
}

int64_t LastGeneration(const std::string& path) {
  const std::vector<Entry> l = Ledger(path);
  return l.empty() ? -1 : l.back().generation;
}

TEST(ElasticSoakTest, RandomKillsAndRejoinsKeepTheLedgerAndTheParameters) {
  const int steps = EnvInt("HSDP_SOAK_STEPS", 300);
  const int kills = EnvInt("HSDP_SOAK_KILLS", 6);
  std::mt19937 rng(EnvInt("HSDP_SOAK_SEED", 1));
  Cluster c("elastic-soak");
  c.StartCoordinator(kWorld, absl::StrCat(kReplicas, "x", kShards), 0, "",
                     {"--heartbeat-timeout", "4", "--reform-window", "2",
                      "--join-wait", "30"});
  const std::vector<std::string> flags = {"--optimizer", "sgd", "--lr", "0.05"};
  struct Live {
    Proc proc;
    std::string report;
    std::string params;
  };
  std::vector<Live> live;
  std::vector<std::string> reports;
  std::vector<std::string> killed_reports;
  int next_id = 0;
  auto start = [&](int rank_hint) {
    const int id = next_id++;
    Live w;
    w.report = absl::StrCat(c.dir(), "/worker-", id, ".jsonl");
    w.params = absl::StrCat(c.dir(), "/final-", id, ".pt");
    std::vector<std::string> extra = flags;
    extra.insert(extra.end(), {"--report-file", w.report, "--final-params",
                               w.params, "--collective-timeout", "30"});
    w.proc = c.StartWorker(rank_hint, extra, steps);
    reports.push_back(w.report);
    live.push_back(w);
  };
  for (int r = 0; r < kWorld; ++r) start(r);

  auto progress = [&] {
    int64_t p = -1;
    for (const Live& w : live) p = std::max(p, Progress(w.report));
    return p;
  };
  auto wait_until = [&](const std::function<bool()>& cond) {
    const auto deadline = Clock::now() + std::chrono::seconds(180);
    while (Clock::now() < deadline && !cond()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return cond();
  };
  int rejoins = 0;
  const int64_t every = steps / (kills + 2);
  for (int k = 0; k < kills; ++k) {
    ASSERT_TRUE(wait_until([&] { return progress() >= (k + 1) * every; }))
        << "no progress to step " << (k + 1) * every;
    const size_t victim =
        std::uniform_int_distribution<size_t>(0, live.size() - 1)(rng);
    int64_t generation = -1;
    for (const Live& w : live)
      generation = std::max(generation, LastGeneration(w.report));
    Kill(live[victim].proc);
    killed_reports.push_back(live[victim].report);
    live.erase(live.begin() + victim);
    // The survivors commit a step in a later generation...
    ASSERT_TRUE(wait_until([&] {
      for (const Live& w : live)
        if (LastGeneration(w.report) > generation) return true;
      return false;
    })) << "no re-formed generation after kill "
        << k;
    // ...then a new process takes the dead one's place and trains.
    start(-1);
    const std::string replacement = live.back().report;
    ASSERT_TRUE(wait_until([&] { return Progress(replacement) >= 0; }))
        << "the replacement never trained: " << ReadFile(live.back().proc.log);
    ++rejoins;
  }
  for (const Live& w : live) {
    EXPECT_EQ(Wait(w.proc, std::chrono::seconds(600)), 0)
        << ReadFile(w.proc.log);
  }
  EXPECT_GE(kills, 5);
  EXPECT_GE(rejoins, 5);

  // The ledger: every global microbatch of steps [0, steps) exactly once;
  // only a killed process's line of the step after its last may be missing
  // (the kill can land between the commit and the line).
  std::map<int64_t, int> seen;
  std::set<int64_t> may_miss;
  for (const std::string& path : reports) {
    for (const Entry& e : Ledger(path))
      for (int64_t g = e.first; g < e.first + e.count; ++g) ++seen[g];
  }
  for (const std::string& path : killed_reports)
    may_miss.insert(Progress(path) + 1);
  for (int64_t g = 0; g < int64_t{steps} * kWorld; ++g) {
    EXPECT_LE(seen[g], 1) << "microbatch " << g << " trained twice";
    if (seen[g] == 0) {
      EXPECT_TRUE(may_miss.count(g / kWorld) > 0)
          << "microbatch " << g << " of a committed step is in no ledger";
    }
  }

  // Final parameters against single-process training on the same batches.
  std::string final_params;
  for (const Live& w : live)
    if (std::filesystem::exists(w.params)) final_params = w.params;
  ASSERT_FALSE(final_params.empty());
  const double max_diff =
      MaxDiffFromReference(final_params, kWorld, steps, c.dir(), flags);
  std::cout << "soak: " << steps << " steps, " << kills << " kills, " << rejoins
            << " rejoins; final parameters: max |diff| vs reference "
            << max_diff << "\n";
  EXPECT_LE(max_diff, kParamTolerance);
}

}  // namespace
}  // namespace hsdp::e2e
