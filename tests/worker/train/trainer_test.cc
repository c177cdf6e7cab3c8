// The single-process reference trainer and the worker's fail-fast checks (no
// coordinator needed).
#include "worker/train/trainer.h"

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"

namespace hsdp::train {
namespace {

std::vector<double> Losses(const std::string& path) {
  std::ifstream in(path);
  std::vector<double> out;
  std::string line;
  while (std::getline(in, line)) {
    const size_t at = line.find("\"loss\":");
    EXPECT_NE(at, std::string::npos) << line;
    const size_t begin = at + 7;
    double v = 0;
    EXPECT_TRUE(
        absl::SimpleAtod(line.substr(begin, line.find(',', begin) - begin), &v))
        << line;
    out.push_back(v);
  }
  return out;
}

ReferenceOptions Small(const std::string& report) {
  ReferenceOptions o;
  o.training.dims = "32,1,2,16";
  o.training.steps = 4;
  o.training.microbatch_size = 2;
  o.training.report_file = report;
  return o;
}

TEST(ReferenceTest, SameGlobalBatchWhetherSplitByRanksOrMicrobatches) {
  const std::string dir = ::testing::TempDir();
  const std::string a = dir + "/ref-ranks.jsonl", b = dir + "/ref-micro.jsonl";
  std::remove(a.c_str());
  std::remove(b.c_str());
  // 2 ranks x 1 microbatch and 1 rank x 2 microbatches read the same global
  // sequence indices.
  ReferenceOptions ranks = Small(a);
  ranks.world_size = 2;
  ReferenceOptions micro = Small(b);
  micro.microbatches = 2;
  ASSERT_TRUE(RunReference(ranks).ok());
  ASSERT_TRUE(RunReference(micro).ok());
  std::vector<double> la = Losses(a), lb = Losses(b);
  ASSERT_EQ(la.size(), 4u);
  ASSERT_EQ(lb.size(), 4u);
  for (size_t i = 0; i < la.size(); ++i)
    EXPECT_DOUBLE_EQ(la[i], lb[i]) << "step " << i;
  EXPECT_LT(la.back(), la.front());
}

TEST(ReferenceTest, UnknownModelIsAnError) {
  ReferenceOptions o = Small("");
  o.training.model = "gpt-nope";
  o.training.dims = "";
  absl::Status s = RunReference(o);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(s.message().find("gpt-nope"), std::string::npos);
}

TEST(WorkerTest, FailsFastBeforeContactingTheCoordinator) {
  WorkerOptions o;
  o.coordinator = "127.0.0.1:1";
  o.coordinator_timeout =
      absl::Seconds(30);  // never reached: the checks come first
  o.training.model = "gpt-nope";
  EXPECT_EQ(RunWorker(o).code(), absl::StatusCode::kNotFound);
  o.training.model = "gpt-tiny";
  o.device = "cuda:0";  // this machine's LibTorch has no CUDA
  EXPECT_EQ(RunWorker(o).code(), absl::StatusCode::kFailedPrecondition);
  o.device = "cpu";
  o.training.data = "/nonexistent/corpus.txt";
  EXPECT_EQ(RunWorker(o).code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace hsdp::train
