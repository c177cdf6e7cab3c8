// One rank of a job under the coordinator: the elastic training loop of
// worker/agent/ELASTIC.md. The rank joins, enters a generation (builds its
// communicators, shards the task or rebinds the engine it kept, heals), and
// trains step after step — each step voted with CommitStep before the
// optimizer applies it — until the job's last step, a drain, or an EXIT
// answer. When a generation ends (a peer lost, a failed collective, an
// eviction, a worker joining), the rank aborts its communicators, discards
// the uncommitted step and enters the next generation in the same process.
//
// Thread-safety: TrainSharded runs on the calling thread (the training
// thread); the agent's generation watcher aborts the current communicators
// from its own thread.
#ifndef HSDP_WORKER_TRAIN_ELASTIC_LOOP_H_
#define HSDP_WORKER_TRAIN_ELASTIC_LOOP_H_

#include <memory>

#include "absl/status/status.h"
#include "hsdp/runner.h"
#include "hsdp/task.h"

namespace hsdp::train {

// Joins the coordinator at `options.coordinator` and trains `task` until the
// job ends for this worker. OK when the job finished, was drained, or this
// worker was evicted; the error otherwise (FAILED_PRECONDITION when the job
// failed, e.g. no live copy of some shard's state survived).
absl::Status TrainSharded(std::unique_ptr<Task> task,
                          const WorkerOptions& options);

}  // namespace hsdp::train

#endif  // HSDP_WORKER_TRAIN_ELASTIC_LOOP_H_
