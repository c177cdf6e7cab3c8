#include "worker/comm/serial_executor.h"

#include <deque>
#include <optional>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

namespace hsdp::comm {
namespace {

// Completion state shared by the executing thread (producer) and the Work
// handle (consumer); shared so a Work dropped without Wait() does not dangle.
// Thread-safe: every field is guarded by `mu`.
struct WorkState {
  absl::Mutex mu;
  bool done ABSL_GUARDED_BY(mu) = false;
  absl::Status status ABSL_GUARDED_BY(mu);
  double elapsed_seconds ABSL_GUARDED_BY(mu) = 0;
  absl::Time completed_at ABSL_GUARDED_BY(mu);

  void Complete(absl::Status s, double elapsed) {
    const absl::Time now = absl::Now();
    absl::MutexLock lock(&mu);
    status = std::move(s);
    elapsed_seconds = elapsed;
    completed_at = now;
    done = true;
  }
};

struct QueuedTask {
  std::string what;
  SerialExecutor::Task run;
  uint64_t tag = 0;
  std::shared_ptr<WorkState> work;
};

}  // namespace

// The queue and flags are guarded by `mu`; `broken` belongs to whichever
// thread holds the `running` token (claimed and released under `mu`), so only
// one task ever executes at a time.
struct SerialExecutor::State {
  explicit State(std::function<std::string(const std::string&)> d)
      : describe(std::move(d)) {}

  // Claims the running token and pops the head task if it may start now and
  // (when `only` is set) is the task with that state.
  std::unique_ptr<QueuedTask> ClaimHead(const WorkState* only)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (running || queue.empty()) return nullptr;
    if (only != nullptr && queue.front()->work.get() != only) return nullptr;
    std::unique_ptr<QueuedTask> task = std::move(queue.front());
    queue.pop_front();
    running = true;
    return task;
  }

  // Completes `task` without running it: the executor was aborted.
  void CompleteAborted(QueuedTask& task, const std::string& reason) {
    task.work->Complete(
        absl::AbortedError(
            absl::StrCat(describe(task.what), " not run: aborted: ", reason)),
        0);
  }

  // Runs `task` (caller holds the running token), completes its Work, and
  // releases the token.
  void Execute(QueuedTask& task) {
    bool was_aborted;
    std::string abort_reason;
    {
      absl::MutexLock lock(&mu);
      was_aborted = aborted;
      abort_reason = reason;
    }
    if (was_aborted) {
      CompleteAborted(task, abort_reason);
    } else if (!broken.ok()) {
      task.work->Complete(
          absl::Status(broken.code(),
                       absl::StrCat(describe(task.what),
                                    " not run: the communicator failed "
                                    "earlier: ",
                                    broken.message())),
          0);
    } else {
      const absl::Time start = absl::Now();
      absl::Status status = task.run(task.tag, describe(task.what));
      if (!status.ok()) broken = status;
      task.work->Complete(std::move(status),
                          absl::ToDoubleSeconds(absl::Now() - start));
    }
    absl::MutexLock lock(&mu);
    running = false;
  }

  const std::function<std::string(const std::string&)> describe;
  absl::Mutex mu;
  std::deque<std::unique_ptr<QueuedTask>> queue ABSL_GUARDED_BY(mu);
  bool running ABSL_GUARDED_BY(mu) = false;
  bool stopping ABSL_GUARDED_BY(mu) = false;
  bool aborted ABSL_GUARDED_BY(mu) = false;
  std::string reason ABSL_GUARDED_BY(mu);
  uint64_t issued ABSL_GUARDED_BY(mu) = 0;
  absl::Status broken;  // owned by the running-token holder
};

// Thread-compatible handle (one waiter), see Work.
class SerialExecutor::ExecutorWork final : public Work {
 public:
  ExecutorWork(std::shared_ptr<WorkState> work, std::shared_ptr<State> state)
      : work_(std::move(work)), state_(std::move(state)) {}

  absl::Status Wait() override {
    // Next in line and not started: run it here rather than wake the executor
    // thread and sleep (the caller would block anyway).
    std::unique_ptr<QueuedTask> task;
    {
      absl::MutexLock lock(&state_->mu);
      task = state_->ClaimHead(work_.get());
    }
    if (task != nullptr) state_->Execute(*task);
    absl::MutexLock lock(&work_->mu);
    work_->mu.Await(absl::Condition(&work_->done));
    return work_->status;
  }
  bool IsCompleted() override {
    absl::MutexLock lock(&work_->mu);
    return work_->done;
  }
  double ElapsedSeconds() const override {
    absl::MutexLock lock(&work_->mu);
    return work_->elapsed_seconds;
  }
  std::optional<absl::Time> CompletedAt() const override {
    absl::MutexLock lock(&work_->mu);
    if (!work_->done) return std::nullopt;
    return work_->completed_at;
  }

 private:
  std::shared_ptr<WorkState> work_;
  std::shared_ptr<State> state_;
};

SerialExecutor::SerialExecutor(
    std::function<std::string(const std::string&)> describe)
    : state_(std::make_shared<State>(std::move(describe))) {
  thread_ = std::thread([state = state_] {
    for (;;) {
      std::unique_ptr<QueuedTask> task;
      {
        absl::MutexLock lock(&state->mu);
        auto ready = [&state]()
                         ABSL_EXCLUSIVE_LOCKS_REQUIRED(state->mu) -> bool {
          return !state->running && (state->stopping || !state->queue.empty());
        };
        state->mu.Await(absl::Condition(&ready));
        // Drain: stop only once everything issued has run.
        if (state->queue.empty()) return;
        task = state->ClaimHead(nullptr);
      }
      state->Execute(*task);
    }
  });
}

SerialExecutor::~SerialExecutor() {
  {
    absl::MutexLock lock(&state_->mu);
    state_->stopping = true;
  }
  thread_.join();
}

std::unique_ptr<Work> SerialExecutor::Enqueue(const std::string& what,
                                              Task task) {
  auto queued = std::make_unique<QueuedTask>();
  queued->run = std::move(task);
  queued->work = std::make_shared<WorkState>();
  auto work = std::make_unique<ExecutorWork>(queued->work, state_);
  std::string abort_reason;
  {
    absl::MutexLock lock(&state_->mu);
    queued->tag = state_->issued;
    queued->what = absl::StrCat(what, " #", state_->issued);
    ++state_->issued;
    if (!state_->aborted) {
      state_->queue.push_back(std::move(queued));
      return work;
    }
    abort_reason = state_->reason;
  }
  state_->CompleteAborted(*queued, abort_reason);
  return work;
}

void SerialExecutor::Abort(absl::string_view reason) {
  std::deque<std::unique_ptr<QueuedTask>> dropped;
  std::string first_reason;
  {
    absl::MutexLock lock(&state_->mu);
    if (!state_->aborted) {
      state_->aborted = true;
      state_->reason = std::string(reason);
    }
    first_reason = state_->reason;
    dropped.swap(state_->queue);
  }
  for (auto& task : dropped) state_->CompleteAborted(*task, first_reason);
}

bool SerialExecutor::WaitIdle(absl::Time deadline) {
  absl::MutexLock lock(&state_->mu);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu) {
    return !state_->running;
  };
  return state_->mu.AwaitWithDeadline(absl::Condition(&idle), deadline);
}

}  // namespace hsdp::comm
