// The worker's training loop (hsdp-worker) and the single-process reference
// trainer.
//
// Torch-free header: worker_main.cc parses flags without compiling LibTorch;
// all torch code lives in trainer.cc. Every error (c10::Error, gloo exceptions,
// gRPC failures) comes back as an absl::Status with a one-line message.
#ifndef HSDP_WORKER_TRAIN_TRAINER_H_
#define HSDP_WORKER_TRAIN_TRAINER_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace hsdp::train {

// What the sharded worker and the single-process reference share: the model,
// the data and the optimisation.
struct TrainingOptions {
  std::string model = "gpt-tiny";
  // "d_model,n_layers,n_heads,seq_len"; empty: the named model's dims.
  std::string dims;
  // Text file of training bytes; empty: the built-in corpus.
  std::string data;
  int64_t steps = 100;
  int64_t microbatch_size = 4;
  double lr = 3e-3;
  // Model init and data.
  uint64_t seed = 0;
  // Intra-op threads (0: leave LibTorch's default).
  int threads = 1;
  // JSON lines, one per step (see README).
  std::string report_file;
  // After the last step, the full unsharded parameters are written here
  // (LibTorch archive; rank 0 only in the sharded run).
  std::string final_params;
};

struct WorkerOptions {
  TrainingOptions training;
  std::string coordinator = "localhost:50051";
  std::string job_id;
  std::optional<int> rank_hint;
  // "cpu" or "cuda:N".
  std::string device = "cpu";
  std::string checkpoint_dir;
  std::string gloo_iface;
  std::string gloo_hostname;
  // Ranks on one host move their all-gathers and reduce-scatters through
  // shared memory (Gloo TCP where they cannot).
  bool shared_memory = true;
  absl::Duration collective_timeout = absl::Seconds(60);
  // How long RPCs keep retrying an unreachable coordinator.
  absl::Duration coordinator_timeout = absl::Seconds(60);
};

// Sets up glog (which LibTorch uses) to log to stderr without the "before
// InitGoogleLogging" warning. Call once from main.
void InitLogging(const char* argv0);

// Joins the coordinator and trains until the last step or a drain. Resumes from
// the latest complete checkpoint in checkpoint_dir.
absl::Status RunWorker(const WorkerOptions& options);

struct ReferenceOptions {
  TrainingOptions training;
  // The global batch of the sharded run it mirrors: world_size ranks x
  // microbatches.
  int world_size = 1;
  int microbatches = 1;
};

// Unsharded single-process training on exactly the global batches of a sharded
// run with the same world size, microbatches and microbatch size.
absl::Status RunReference(const ReferenceOptions& options);

}  // namespace hsdp::train

#endif  // HSDP_WORKER_TRAIN_TRAINER_H_
