// Crash-safe persistence of the coordinator's state in a directory:
// - <dir>/state.binpb: PersistedState (job, policies, generation, model,
//   members, drain step, checkpoint records), rewritten atomically;
// - <dir>/steps/<step>.binpb (generation 0) or <step>-g<generation>.binpb:
//   one serialized StepSchedule per step and generation that sealed it, after
//   a header with its length and CRC-32C, written once (a step sealed again in
//   a later generation gets a new file; the old one stays);
// - <dir>/commit.binpb: the last committed step (CommitPoint), rewritten once
//   per committed step — small, so the per-step fsync stays cheap.
// Every write goes to "<file>.tmp", is fsync'ed, renamed over the target, and
// the directory is fsync'ed, so a crash leaves either the old or the new file.
// Leftover *.tmp files (a crash mid-write) are removed on Open, with a line
// on stderr; a step file shorter than its header says, or that fails its
// checksum or does not parse, is DATA_LOSS (a crash cannot leave one).
// <dir>/LOCK is flock'ed for the store's lifetime: a second coordinator on the
// same directory is refused before it removes or writes anything (its
// clean-up of *.tmp files would break the first one's write in flight).
// Sealing a step writes one small file and never rewrites the others
// (append-friendly).
#ifndef HSDP_COORDINATOR_CORE_STATE_STORE_H_
#define HSDP_COORDINATOR_CORE_STATE_STORE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/core/state_store.pb.h"

namespace hsdp::coordinator {

using state::PersistedState;

// Thread-safe: Update and SaveSealedStep may be called from any thread; each
// call is serialized by an internal mutex. Components call it while holding
// their own lock (lock order: component -> StateStore), and StateStore never
// calls back into them.
class StateStore {
 public:
  struct Options {
    // fsync files and the directory (off only for benchmarks/tests that do not
    // crash).
    bool sync = true;
  };

  // Opens (creating if needed) `dir`, locks it and loads what is there. A
  // directory another StateStore holds (this process or another) is
  // FAILED_PRECONDITION naming the holder's pid; a corrupt state.binpb, or a
  // truncated, corrupt or empty step file, is DATA_LOSS naming the file (and
  // the step); unreadable dir is the underlying errno status.
  static absl::StatusOr<std::unique_ptr<StateStore>> Open(
      const std::string& dir, Options options);
  static absl::StatusOr<std::unique_ptr<StateStore>> Open(
      const std::string& dir) {
    return Open(dir, Options());
  }

  StateStore(const StateStore&) = delete;
  StateStore& operator=(const StateStore&) = delete;
  // Releases the directory lock.
  ~StateStore();

  // A copy of the current state (as loaded, plus updates since).
  PersistedState state() const;

  // Applies `mutate` to the state and rewrites state.binpb atomically (no
  // write when nothing changed). On a write error the in-memory state is
  // rolled back and the error returned.
  absl::Status Update(const std::function<void(PersistedState*)>& mutate);

  // Writes the sealed bytes of `step` in `generation` (once; rewriting it
  // with different bytes is FAILED_PRECONDITION — sealed steps are
  // immutable). The bytes must be a StepSchedule of that step and generation.
  absl::Status SaveSealedStep(int64_t step, int64_t generation,
                              const std::string& bytes);

  // (step, generation) of a sealed record.
  using SealedKey = std::pair<int64_t, int64_t>;
  // The operator's repair of a damaged directory: moves every sealed step file
  // of a step after `last_step` (any generation) into
  // <dir>/truncated-<unix ms>/steps/ and forgets them, so the steps from
  // last_step + 1 on are sealed again. Returns how many files moved.
  // FAILED_PRECONDITION (nothing moved) when a step after last_step committed
  // (commit.binpb): its record cannot be sealed again.
  absl::StatusOr<int> TruncateSealedSteps(int64_t last_step);

  // Where the record of `step` sealed in `generation` lives (whether or not it
  // exists).
  std::string SealedStepPath(int64_t step, int64_t generation) const;

  // The sealed records loaded at Open plus those saved since.
  std::map<SealedKey, std::string> SealedSteps() const;

  // Rewrites commit.binpb atomically (fsync'ed when sync is on).
  absl::Status SaveCommitPoint(const state::CommitPoint& point);
  // The commit point loaded at Open or saved since; unset if none.
  std::optional<state::CommitPoint> commit_point() const;

  const std::string& dir() const { return dir_; }

 private:
  // Logs the first failed write (a full disk) and the first success after it
  // to stderr; returns `status`.
  absl::Status NoteWrite(absl::Status status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  StateStore(std::string dir, Options options, int lock_fd);
  absl::Status Load();

  const std::string dir_;
  const Options options_;
  // Holds the flock on <dir>/LOCK.
  const int lock_fd_;
  mutable absl::Mutex mu_;
  PersistedState state_ ABSL_GUARDED_BY(mu_);
  std::map<SealedKey, std::string> sealed_ ABSL_GUARDED_BY(mu_);
  std::optional<state::CommitPoint> commit_point_ ABSL_GUARDED_BY(mu_);
  // A write failed and none succeeded since (logged once per episode).
  bool failing_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace hsdp::coordinator

#endif  // HSDP_COORDINATOR_CORE_STATE_STORE_H_
