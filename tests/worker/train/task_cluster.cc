#include "tests/worker/train/task_cluster.h"

#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace hsdp::train::testing {
namespace {

constexpr absl::Duration kTimeout = absl::Seconds(30);

}  // namespace

std::string FreshFile(const std::string& name) {
  const std::string path =
      absl::StrCat(::testing::TempDir(), "/", getpid(), "-", name);
  std::remove(path.c_str());
  return path;
}

std::vector<double> ReportField(const std::string& path,
                                const std::string& key) {
  std::ifstream in(path);
  std::vector<double> out;
  std::string line;
  const std::string needle = absl::StrCat("\"", key, "\":");
  while (std::getline(in, line)) {
    const size_t at = line.find(needle);
    if (at == std::string::npos) continue;
    const size_t begin = at + needle.size();
    double v = 0;
    if (absl::SimpleAtod(
            line.substr(begin, line.find_first_of(",}", begin) - begin), &v))
      out.push_back(v);
  }
  return out;
}

ClusterRun RunCluster(
    const std::string& job_id, MeshShape mesh, const TaskMaker& make,
    const TrainingOptions& training, const TaskArgs& task_args,
    const std::function<void(coordinator::JobConfig&)>& adjust) {
  unsetenv("HSDP_JOB_TOKEN");
  unsetenv("HSDP_JOB_TOKEN_FILE");
  // Ranks and coordinator share this process: a socket closed at shutdown
  // must give EPIPE, not kill the test.
  std::signal(SIGPIPE, SIG_IGN);
  ClusterRun out;
  const int world = mesh.world_size();
  coordinator::JobConfig job;
  job.job_id = job_id;
  job.world_size = world;
  job.mesh = mesh;
  if (adjust) adjust(job);
  coordinator::ServerOptions server_options;
  server_options.listen = "127.0.0.1:0";
  server_options.sync_state = false;
  auto server = coordinator::CoordinatorServer::Start(job, server_options);
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok()) return out;
  out.results.resize(world);
  std::vector<std::thread> ranks;
  for (int r = 0; r < world; ++r) {
    out.reports.push_back(
        FreshFile(absl::StrCat(job_id, "-rank-", r, ".jsonl")));
    WorkerOptions w;
    w.training = training;
    w.task_args = task_args;
    w.process.report_file = out.reports.back();
    w.coordinator = (*server)->address();
    w.job_id = job_id;
    w.rank_hint = r;
    w.gloo_hostname = "127.0.0.1";
    // One process: the ranks are threads, which shared memory does not need.
    w.shared_memory = false;
    w.collective_timeout = kTimeout;
    w.coordinator_timeout = kTimeout;
    ranks.emplace_back(
        [w, r, &make, &out] { out.results[r] = RunTask(make(), w); });
  }
  for (std::thread& t : ranks) t.join();
  (*server)->Shutdown();
  return out;
}

absl::Status RunTaskReference(const TaskMaker& make,
                              const TrainingOptions& training, int world_size,
                              const std::string& report_file) {
  ReferenceOptions ref;
  ref.training = training;
  ref.world_size = world_size;
  ref.microbatches = 1;
  ref.process.report_file = report_file;
  return RunReference(make(), ref);
}

}  // namespace hsdp::train::testing
