// Multi-process parity: every rank is its own process (the helper
// fsdp_multiprocess_rank, spawned here), rendezvousing through a FileStore
// directory and talking Gloo over loopback TCP. Losses and final parameters
// must equal single-process training, as in the threaded ParityTest.
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "tests/worker/fsdp/fsdp_test_util.h"

extern char** environ;

namespace hsdp::fsdp::testing {
namespace {

constexpr double kParityTolerance = 1e-5;  // fp32 sums in another order
constexpr uint64_t kSeed = 7;
// Generous for 4 processes loading LibTorch on a loaded 2-core machine; a
// healthy run takes a few seconds.
constexpr absl::Duration kRunTimeout = absl::Seconds(90);

std::string MakeTempDir() {
  std::string pattern = ::testing::TempDir() + "fsdp_mp_XXXXXX";
  EXPECT_NE(::mkdtemp(pattern.data()), nullptr);
  return pattern;
}

pid_t Spawn(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (const std::string& a : args)
    argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = -1;
  const int rc =
      ::posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), environ);
  EXPECT_EQ(rc, 0) << "posix_spawn " << args[0];
  return rc == 0 ? pid : -1;
}

// Waits for every child until the deadline; kills (by pid) those still
// running after it. Returns each child's exit code (-1: killed or signalled).
std::vector<int> WaitAll(const std::vector<pid_t>& pids) {
  std::vector<int> codes(pids.size(), -1);
  std::vector<bool> done(pids.size(), false);
  const absl::Time deadline = absl::Now() + kRunTimeout;
  size_t remaining = pids.size();
  while (remaining > 0 && absl::Now() < deadline) {
    for (size_t i = 0; i < pids.size(); ++i) {
      if (done[i]) continue;
      int status = 0;
      if (pids[i] < 0 || ::waitpid(pids[i], &status, WNOHANG) == pids[i]) {
        done[i] = true;
        --remaining;
        if (pids[i] >= 0 && WIFEXITED(status)) codes[i] = WEXITSTATUS(status);
      }
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  for (size_t i = 0; i < pids.size(); ++i) {
    if (done[i]) continue;
    ADD_FAILURE() << "rank " << i << " still running after "
                  << absl::FormatDuration(kRunTimeout) << "; killed";
    ::kill(pids[i], SIGKILL);
    ::waitpid(pids[i], nullptr, 0);
  }
  return codes;
}

// Parses the helper's output (see fsdp_multiprocess_rank.cc); parameters come
// back flat and are reshaped like `shapes`.
RunResult ReadResult(const std::string& path, const StateDict& shapes) {
  RunResult result;
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "no result file " << path;
  std::string tag;
  while (in >> tag) {
    if (tag == "loss") {
      double loss = 0;
      in >> loss;
      result.losses.push_back(loss);
    } else if (tag == "param") {
      std::string name;
      int64_t numel = 0;
      in >> name >> numel;
      at::Tensor t = torch::empty({numel}, torch::kFloat);
      float* data = t.data_ptr<float>();
      for (int64_t i = 0; i < numel; ++i) in >> data[i];
      auto it = shapes.find(name);
      result.params[name] = it != shapes.end() && it->second.numel() == numel
                                ? t.reshape(it->second.sizes())
                                : t;
    } else {
      ADD_FAILURE() << "unexpected token " << tag << " in " << path;
      break;
    }
  }
  return result;
}

class MultiProcessParityTest
    : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(MultiProcessParityTest, ProcessesMatchSingleProcessTraining) {
  const comm::MeshShape shape{std::get<0>(GetParam()), std::get<1>(GetParam())};
  const int world = shape.world_size();
  const std::string dir = MakeTempDir();
  std::vector<pid_t> pids;
  for (int rank = 0; rank < world; ++rank) {
    pids.push_back(
        Spawn({HSDP_RANK_HELPER, dir + "/store", absl::StrCat(rank),
               absl::StrCat(shape.replicate), absl::StrCat(shape.shard),
               absl::StrCat(kSeed), absl::StrCat(dir, "/rank", rank, ".txt")}));
  }
  // The reference trains while the ranks do.
  RunConfig config;
  const StateDict init = MakeInitialState(config.dims, kSeed);
  const RunResult reference = TrainReference(init, config);
  ASSERT_GT(MaxAbsDiff(reference.params, init), 1e-3);  // it really trains
  const std::vector<int> codes = WaitAll(pids);
  for (int rank = 0; rank < world; ++rank) {
    ASSERT_EQ(codes[rank], 0) << "rank " << rank << " failed (see its stderr)";
  }

  std::vector<double> losses(reference.losses.size(), 0.0);
  RunResult rank0;
  for (int rank = 0; rank < world; ++rank) {
    RunResult r =
        ReadResult(absl::StrCat(dir, "/rank", rank, ".txt"), reference.params);
    ASSERT_EQ(r.losses.size(), reference.losses.size()) << "rank " << rank;
    // Each rank's loss is over its equal slice: the global loss is the mean.
    for (size_t s = 0; s < losses.size(); ++s) losses[s] += r.losses[s] / world;
    if (rank == 0) rank0 = std::move(r);
  }
  for (size_t s = 0; s < losses.size(); ++s) {
    EXPECT_NEAR(losses[s], reference.losses[s], kParityTolerance)
        << "step " << s;
  }
  EXPECT_LE(MaxAbsDiff(rank0.params, reference.params), kParityTolerance);
  // Kept on failure for inspection.
  if (!HasFailure()) std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Meshes, MultiProcessParityTest,
                         ::testing::Values(std::make_tuple(1, 2),
                                           std::make_tuple(2, 2)),
                         [](const auto& info) {
                           return absl::StrCat(std::get<0>(info.param), "x",
                                               std::get<1>(info.param));
                         });

}  // namespace
}  // namespace hsdp::fsdp::testing
