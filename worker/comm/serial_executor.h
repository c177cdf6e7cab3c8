// Runs a communicator's collectives one at a time, in issue order, off the
// caller's thread, and hands back Work handles (see communicator.h).
//
// Shared by the CPU backends (Gloo, shared memory): each owns one
// SerialExecutor. A task is a function returning absl::Status; the first task
// that fails makes the executor "broken" — every later task completes at once
// with that error ("... not run: the communicator failed earlier: ..."), since
// the transport is then in an unknown state.
//
// Thread-safety: Enqueue may be called from any thread (issuing is serialised
// by a mutex; the ordering contract across ranks is the caller's). Tasks run on
// the executor's own thread — except that Wait() on a task that is next in
// line and not yet started runs it on the waiting thread (same order, no
// thread hand-off when the caller would block anyway). Work handles may
// outlive the executor.
#ifndef HSDP_WORKER_COMM_SERIAL_EXECUTOR_H_
#define HSDP_WORKER_COMM_SERIAL_EXECUTOR_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "hsdp/communicator.h"

namespace hsdp::comm {

class SerialExecutor {
 public:
  // `tag` is the task's issue number (0, 1, ...): the same on every rank by
  // the ordering contract, so backends use it to tell collectives apart;
  // `where` is the task's error prefix (`describe` of "<what> #<tag>").
  using Task =
      std::function<absl::Status(uint64_t tag, const std::string& where)>;

  // `describe` turns a task name into its error prefix, e.g. "AllGather #3 on
  // gloo:shard (rank 0 of 2)".
  explicit SerialExecutor(
      std::function<std::string(const std::string&)> describe);
  SerialExecutor(const SerialExecutor&) = delete;
  SerialExecutor& operator=(const SerialExecutor&) = delete;
  // Runs the tasks still queued, then joins the thread.
  ~SerialExecutor();

  // Queues `task` under the name "<what> #<tag>" and returns its Work. A task's
  // error status is reported as is (it should already name the collective).
  // After Abort() the task is not run: its Work completes at once with
  // ABORTED.
  std::unique_ptr<Work> Enqueue(const std::string& what, Task task);

  // Completes every queued task with ABORTED ("<name> not run: aborted:
  // <reason>") without running it, and so every later one. The task running
  // now (if any) is not interrupted here: the backend unblocks it; see
  // WaitIdle(). Thread-safe, idempotent (the first reason stays).
  void Abort(absl::string_view reason);
  // True once no task is running (waiting at most until `deadline`).
  bool WaitIdle(absl::Time deadline);

 private:
  struct State;
  class ExecutorWork;

  std::shared_ptr<State> state_;
  std::thread thread_;
};

}  // namespace hsdp::comm

#endif  // HSDP_WORKER_COMM_SERIAL_EXECUTOR_H_
