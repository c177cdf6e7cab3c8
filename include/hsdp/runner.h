// Running a Task: as one rank of a job under an hsdp coordinator (RunTask), or
// unsharded in this process (RunReference).
//
// The job's training settings (TrainingOptions) are the same on every rank: the
// worker reports them when joining and the coordinator refuses a worker whose
// settings differ from the job's, naming the field.
//
// Numerics. Every rank's microbatch loss is the mean over its samples; the
// runner scales it by 1 / microbatches and the engine averages gradients over
// all ranks, so a step's update is the one single-process training computes on
// the whole global batch (world × microbatches × microbatch_size samples).
// RunReference does exactly that in one process: its losses match a sharded
// run's within fp32 tolerance, bitwise for the loss of step 0.
//
// Thread-safety: each call runs the task on the calling thread and returns when
// the run ends; one call per Task.
#ifndef HSDP_RUNNER_H_
#define HSDP_RUNNER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "hsdp/task.h"

namespace hsdp::train {

enum class OptimizerKind { kAdamW, kSgd };

struct OptimizerOptions {
  OptimizerKind kind = OptimizerKind::kAdamW;
  // Peak learning rate (see LrScheduleOptions).
  double lr = 3e-3;
  // Unset: 0.01 for AdamW (LibTorch's default), 0 for SGD.
  std::optional<double> weight_decay;
  // SGD only.
  double momentum = 0;
  // AdamW only.
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;

  double EffectiveWeightDecay() const;
};

// Linear warmup from lr / warmup_steps to lr over the first warmup_steps steps,
// then (cosine) a half cosine from lr down to min_lr at the last step, or
// (constant) lr.
struct LrScheduleOptions {
  int64_t warmup_steps = 0;
  bool cosine = false;
  double min_lr = 0;

  // The learning rate of step `step` of a job of `steps` steps.
  double LearningRate(double peak_lr, int64_t step, int64_t steps) const;
};

// What a step whose loss, or (when clipping) global gradient norm, is NaN or
// infinite does. Every rank sees the same mean loss and norm, so every rank
// takes the same branch.
enum class NonFiniteAction {
  // The run fails with one line naming the step, rank and microbatch, and the
  // coordinator marks the job FAILED with it.
  kStop,
  // Every rank drops the step's gradients and applies no update (optimizer
  // state untouched); the step's report line says why, with "loss":null.
  kSkipStep,
};

// The settings every rank of a job shares.
struct TrainingOptions {
  int64_t steps = 100;
  // Samples per microbatch per rank.
  int64_t microbatch_size = 4;
  // Model init and data order.
  uint64_t seed = 0;
  OptimizerOptions optimizer;
  LrScheduleOptions lr_schedule;
  // Mixed precision: dtype of the gathered (compute) parameters, "fp32" or
  // "bf16"; reduce_dtype: the dtype gradients are reduced in (empty: fp32 when
  // param_dtype is bf16).
  std::string param_dtype = "fp32";
  std::string reduce_dtype;
  // The dtype a unit's gradients accumulate in across microbatches that do
  // not synchronise them, "fp32" or "bf16" (empty: param_dtype). "fp32" with
  // bf16 params: fp32 main gradients (fsdp::MixedPrecisionPolicy).
  std::string grad_accumulation_dtype;
  // Shards, gradients and optimizer state live on the CPU.
  bool cpu_offload = false;
  // Glob over unit names ("layers.*"): those units drop their activations in
  // forward and recompute them in backward. Empty: none.
  std::string recompute_units;
  // Clip the global gradient norm to this (0: no clipping).
  double clip_grad_norm = 0;
  // How gradients combine across ranks (fsdp::GradientReduction): "avg", the
  // mean over ranks, for a loss averaged over each rank's samples; "sum" for
  // a loss summed over them. grad_divide_factor > 0: the sum over ranks
  // divided by it instead. The reference applies the same scale.
  std::string grad_reduce = "avg";
  double grad_divide_factor = 0;
  NonFiniteAction on_nonfinite = NonFiniteAction::kStop;
};

// Settings of this process that may differ between ranks.
struct ProcessOptions {
  // Intra-op threads (0: LibTorch's default).
  int threads = 1;
  // JSON lines, one per step (see worker/README.md).
  std::string report_file;
  // After the last step, the full unsharded parameters are written here
  // (LibTorch archive; global rank 0 only in a sharded run).
  std::string final_params;
};

struct WorkerOptions {
  TrainingOptions training;
  ProcessOptions process;
  // The task's own settings, reported to the coordinator with the training
  // settings (every rank must agree).
  TaskArgs task_args;
  std::string coordinator = "localhost:50051";
  // This host's relay (hsdp-relay), HOST:PORT or unix:PATH: the schedule and
  // report streams go there, shared with the host's other ranks, while every
  // call goes to the coordinator. Empty: no relay.
  std::string relay;
  std::string job_id;
  // Files of the coordinator's worker-API credentials: the job token (empty:
  // HSDP_JOB_TOKEN_FILE, else HSDP_JOB_TOKEN, else none), and TLS — the
  // coordinator's CA and, for mutual TLS, this worker's certificate and key
  // (empty: plaintext).
  std::string job_token_file;
  std::string tls_ca;
  std::string tls_client_cert;
  std::string tls_client_key;
  std::optional<int> rank_hint;
  // "cpu" or "cuda:N".
  std::string device = "cpu";
  // Checkpoints (format v1, worker/ckpt/README.md): resumed from on any mesh.
  std::string checkpoint_dir;
  // Write checkpoints on the training thread instead of in the background.
  bool sync_checkpoint = false;
  // Newest checkpoints kept (older ones deleted once a newer one is
  // complete); 0 keeps all.
  int keep_checkpoints = 0;
  std::string gloo_iface;
  std::string gloo_hostname;
  // The host this worker tells the coordinator it runs on, for placing shard
  // groups inside hosts and for host groups (hierarchical reshard). Empty:
  // the machine's hostname. In a container, whose hostname is its own, set
  // it to the node's name.
  std::string host_id;
  // Ranks on one host move their all-gathers and reduce-scatters through
  // shared memory (Gloo TCP where they cannot).
  bool shared_memory = true;
  absl::Duration collective_timeout = absl::Seconds(60);
  // How long RPCs keep retrying an unreachable coordinator.
  absl::Duration coordinator_timeout = absl::Seconds(60);
};

struct ReferenceOptions {
  TrainingOptions training;
  ProcessOptions process;
  // The task's settings, written with the training settings at the head of
  // the report file (hsdp-compare checks them against a sharded run's).
  TaskArgs task_args;
  // The global batch of the sharded run it mirrors: world_size ranks x
  // microbatches.
  int world_size = 1;
  int microbatches = 1;
};

// Joins the coordinator and trains `task` until the last step or a drain.
// Resumes from the latest complete checkpoint in checkpoint_dir, on whatever
// mesh it was saved.
absl::Status RunTask(std::unique_ptr<Task> task, const WorkerOptions& options);

// Unsharded single-process training on exactly the global batches of a sharded
// run with the same world size, microbatches and microbatch size.
absl::Status RunReference(std::unique_ptr<Task> task,
                          const ReferenceOptions& options);

// Sets up glog (which LibTorch uses) to log to stderr without the "before
// InitGoogleLogging" warning. Call once from main.
void InitLogging(const char* argv0);

}  // namespace hsdp::train

#endif  // HSDP_RUNNER_H_
