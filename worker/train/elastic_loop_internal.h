// Private to worker/train: the ElasticLoop class behind TrainSharded
// (elastic_loop.h), shared by elastic_loop.cc (joining, entering and leaving
// generations) and elastic_step.cc (one training step).
#ifndef HSDP_WORKER_TRAIN_ELASTIC_LOOP_INTERNAL_H_
#define HSDP_WORKER_TRAIN_ELASTIC_LOOP_INTERNAL_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "hsdp/device_mesh.h"
#include "hsdp/fully_shard.h"
#include "hsdp/runner.h"
#include "hsdp/task.h"
#include "hsdp/v1/schedule.pb.h"
#include "worker/agent/agent.h"
#include "worker/agent/coordinator_store.h"
#include "worker/train/checkpointing.h"
#include "worker/train/optimizer.h"
#include "worker/train/report_file.h"
#include "worker/train/step_trace.h"
#include "worker/train/unit_entry.h"

namespace hsdp::train::internal {

// Marks a status as a failure of the generation's communicators (a
// collective, the rendezvous, a heal), which re-forms instead of stopping.
absl::Status CollectiveFailure(absl::Status s);
bool IsCollectiveFailure(const absl::Status& s);

// Errors a communicator gives when a peer or the generation went away, as
// opposed to bad input or a broken checkpoint.
bool IsCommunicationCode(absl::StatusCode code);

// What a step (or entering a generation) leads to.
enum class Next { kStep, kReform, kFinish };

// The loop of worker/agent/ELASTIC.md for one process. Thread-compatible
// except OnGenerationEnd, which the agent's watcher calls from its thread.
class ElasticLoop {
 public:
  ElasticLoop(std::unique_ptr<Task> task, const WorkerOptions& options);
  ~ElasticLoop();
  ElasticLoop(const ElasticLoop&) = delete;
  ElasticLoop& operator=(const ElasticLoop&) = delete;

  absl::Status Run();

 private:
  // The step's share of the global batch (schedule.proto): slot
  // i = rank * M + m carries global microbatch F + i while i < U, padding
  // (weight 0) past it; a real microbatch's loss is divided by U / W.
  struct StepPlan {
    hsdp::v1::StepSchedule schedule;
    // When the schedule fetch began and ended (StepTrace::Now).
    int64_t fetch_begin = 0;
    int64_t fetch_end = 0;
    int micro = 1;       // M: this rank's microbatches, padding included
    int world = 1;       // W
    int64_t global = 0;  // U: real microbatches over every rank
    double scale = 1;    // U / W
    int64_t first_slot = 0;
    int64_t real = 0;  // this rank's real (not padding) microbatches
  };
  // This rank's microbatch losses, still on the device.
  struct MicrobatchLosses {
    // Their sum: one host sync per step, not per microbatch.
    at::Tensor sum;
    // Each real microbatch's; read only when the step's loss is not finite.
    std::vector<at::Tensor> each;
  };
  // The step's loss over every rank, and what a non-finite one leads to.
  struct StepLoss {
    double mean = 0;
    // Empty while the loss and the norm are finite; else the one line naming
    // the non-finite step and what the run does about it (the step is not
    // applied).
    std::string nonfinite;
  };
  // The commit vote's answer and how long it took.
  struct CommitVote {
    bool reform_after = false;
    double seconds = 0;
  };
  // A checkpoint the schedule asked for.
  struct CheckpointOutcome {
    bool saved = false;
    // A communication failure while saving: re-forms after the step is
    // reported (the step itself is committed).
    absl::Status lost_peer;
  };

  absl::Status Start();
  // The next generation this worker is a member of; nullopt when it must
  // stop without an error (job finished, evicted).
  absl::StatusOr<std::optional<hsdp::v1::Generation>> AwaitNext(int64_t known);
  absl::StatusOr<Next> RunGeneration(const hsdp::v1::Generation& g);
  absl::Status Enter(const hsdp::v1::Generation& g);
  absl::Status Heal(const hsdp::v1::Generation& g);

  // One step (elastic_step.cc): fetch the schedule, train the microbatches,
  // reduce the loss, vote, apply, checkpoint, report.
  absl::StatusOr<Next> Step(int64_t step);
  // The step's sealed schedule and this rank's share of the batch; nullopt
  // when the job drained before the step.
  absl::StatusOr<std::optional<StepPlan>> FetchSchedule(int64_t step);
  // Forward and backward of every microbatch of this rank, gradients left
  // for the optimizer.
  absl::StatusOr<MicrobatchLosses> RunMicrobatches(int64_t step,
                                                   const StepPlan& plan);
  // The grad norm clip and the mean loss over every rank (collectives), and
  // what a non-finite loss or norm leads to.
  absl::StatusOr<StepLoss> ReduceLoss(int64_t step,
                                      const MicrobatchLosses& losses);
  // Votes the step with CommitStep, then applies it (unless `apply` is
  // false) and clears the gradients.
  absl::StatusOr<CommitVote> VoteAndApply(int64_t step, bool apply,
                                          StepTrace& trace);
  absl::StatusOr<CheckpointOutcome> SaveCheckpoint(int64_t step,
                                                   const StepPlan& plan,
                                                   StepTrace& trace);
  // The report file's line and the coordinator's step report.
  absl::Status Report(int64_t step, const StepPlan& plan,
                      const fsdp::EngineStats& stats, const StepLoss& loss,
                      double step_seconds, const CommitVote& vote, bool saved,
                      StepTrace& trace);
  // The step's mean loss (or clipped norm) is not finite, on every rank: the
  // one line naming the step, and the first rank and microbatch whose loss is
  // not finite (a collective: every rank calls it). `microbatch_losses` are
  // this rank's real microbatches' losses.
  absl::StatusOr<std::string> DescribeNonFinite(
      int64_t step, double loss, std::optional<double> norm,
      const std::vector<at::Tensor>& microbatch_losses);
  // Fails the job with `message` at the coordinator and returns it.
  absl::Status StopForNonFinite(int64_t step, const std::string& message);

  // A failed step or entry: re-form (after reporting a failed collective), or
  // the error when it is not a communication failure.
  absl::StatusOr<Next> OnFailure(const absl::Status& s, int64_t step);
  void Leave();
  absl::Status Finish();
  void OnGenerationEnd(int64_t generation, const absl::Status& why);
  void PublishMesh();

  std::unique_ptr<Task> task_;
  const WorkerOptions& o_;
  const TrainingOptions& t_;
  const c10::Device device_;
  fsdp::EngineOptions engine_options_;
  std::vector<fsdp::UnitLayout> units_;
  CheckpointingOptions checkpointing_options_;
  std::unique_ptr<agent::Agent> agent_;
  ReportFile report_file_;
  // The training settings reported at Join and written to the report file.
  hsdp::v1::TrainingSpec spec_;
  int64_t last_step_ = 0;

  // The current generation and its communicators. The previous ones are kept
  // until the engine's Rebind dropped the works it issued on them.
  hsdp::v1::Generation generation_;
  int rank_ = -1;
  std::unique_ptr<agent::CoordinatorStore> store_;
  std::unique_ptr<comm::DeviceMesh> mesh_;
  std::unique_ptr<agent::CoordinatorStore> old_store_;
  std::unique_ptr<comm::DeviceMesh> old_mesh_;
  std::unique_ptr<Checkpointing> checkpointing_;
  // Set by a heal this rank took part in, reported with the next step.
  std::optional<uint32_t> heal_crc_;

  // The model's state: kept across generations.
  std::unique_ptr<fsdp::Engine> engine_;
  std::unique_ptr<EngineShardContext> units_context_;
  // The task's Unit<> wrappers, pointed at units_context_ (declared after it:
  // cleared first).
  UnitBindings unit_bindings_;
  // CheckDeterministicBatch and CheckLossGraph ran (the first microbatch).
  bool task_checked_ = false;
  std::unique_ptr<torch::optim::Optimizer> opt_;
  // The first step after a resumed checkpoint (0 when fresh).
  int64_t first_step_ = 0;

  // The last step report: sent again with `finished` at the end.
  hsdp::v1::StepReport last_report_;
  bool have_report_ = false;

  absl::Mutex mu_;
  // The mesh the watcher aborts when its generation ends.
  comm::DeviceMesh* abort_target_ ABSL_GUARDED_BY(mu_) = nullptr;
  int64_t abort_generation_ ABSL_GUARDED_BY(mu_) = -1;
  // The newest generation the watcher saw end.
  int64_t ended_generation_ ABSL_GUARDED_BY(mu_) = -1;
};

}  // namespace hsdp::train::internal

#endif  // HSDP_WORKER_TRAIN_ELASTIC_LOOP_INTERNAL_H_
