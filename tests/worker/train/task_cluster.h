// Test support for tasks: a job of RunTask threads under an in-process
// coordinator (Gloo over loopback), the task's single-process reference, and
// readers of the report files both write. Thread-compatible: one run at a time
// per test.
#ifndef HSDP_TESTS_WORKER_TRAIN_TASK_CLUSTER_H_
#define HSDP_TESTS_WORKER_TRAIN_TASK_CLUSTER_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "coordinator/server.h"
#include "hsdp/runner.h"
#include "hsdp/task.h"

namespace hsdp::train::testing {

using TaskMaker = std::function<std::unique_ptr<Task>()>;

// A path under the test's temp directory, removed if it exists; per process,
// since several builds may run one test at once.
std::string FreshFile(const std::string& name);

// The numeric value of `key` on each line of a report file that has one
// (lines with "loss":null are passed over for "loss").
std::vector<double> ReportField(const std::string& path,
                                const std::string& key);

struct ClusterRun {
  std::vector<absl::Status> results;  // per rank
  std::vector<std::string> reports;   // per rank
};

// Runs `mesh.world_size()` ranks of job `job_id` as threads, each RunTask of a
// fresh task from `make`, under a coordinator started here. `adjust` may
// change the job (its policy, say) before the coordinator starts.
ClusterRun RunCluster(
    const std::string& job_id, MeshShape mesh, const TaskMaker& make,
    const TrainingOptions& training, const TaskArgs& task_args = {},
    const std::function<void(coordinator::JobConfig&)>& adjust = {});

// RunReference of a task from `make` over `world_size` ranks' global batches,
// writing `report_file`.
absl::Status RunTaskReference(const TaskMaker& make,
                              const TrainingOptions& training, int world_size,
                              const std::string& report_file);

}  // namespace hsdp::train::testing

#endif  // HSDP_TESTS_WORKER_TRAIN_TASK_CLUSTER_H_
