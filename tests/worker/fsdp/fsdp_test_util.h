// Test support for the sharding engine: a tiny causal transformer (with
// parameters whose dim 0 does not divide 2 or 4, and one with fewer rows than
// shards), multi-rank runs as threads over loopback Gloo, and sharded /
// single-process training drivers that report losses and the final full
// parameters.
#ifndef HSDP_TESTS_WORKER_FSDP_FSDP_TEST_UTIL_H_
#define HSDP_TESTS_WORKER_FSDP_FSDP_TEST_UTIL_H_

#include <torch/torch.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "common/units.h"
#include "hsdp/communicator.h"
#include "hsdp/device_mesh.h"
#include "hsdp/fully_shard.h"
#include "hsdp/v1/policy.pb.h"
#include "hsdp/v1/schedule.pb.h"
#include "tests/worker/fsdp/recording_communicator.h"

namespace hsdp::fsdp::testing {

struct ModelDims {
  int64_t vocab = 11;  // 11 rows: uneven over 2 and 4 shards
  int64_t d_model = 8;
  int64_t heads = 2;
  int64_t hidden = 20;
  int64_t seq_len = 6;  // the positional table has 6 rows: uneven over 4 shards
  int64_t layers = 2;
};

class BlockImpl : public torch::nn::Module {
 public:
  explicit BlockImpl(const ModelDims& dims);
  at::Tensor forward(const at::Tensor& x);

 private:
  int64_t heads_;
  torch::nn::LayerNorm ln1_{nullptr}, ln2_{nullptr};
  torch::nn::Linear qkv_{nullptr}, proj_{nullptr}, fc1_{nullptr}, fc2_{nullptr};
};
TORCH_MODULE(Block);

class TinyTransformerImpl : public torch::nn::Module {
 public:
  explicit TinyTransformerImpl(const ModelDims& dims);
  at::Tensor Embed(const at::Tensor& tokens);
  at::Tensor Head(const at::Tensor& h);
  // Plain (unsharded) forward: logits [B, T, vocab].
  at::Tensor forward(const at::Tensor& tokens);

  std::vector<Block> blocks;
  ModelDims dims;

 private:
  torch::nn::Embedding embed_{nullptr};
  at::Tensor pos_;
  at::Tensor mix_;  // 3 rows: fewer than 4 shards
  torch::nn::LayerNorm ln_f_{nullptr};
  torch::nn::Linear head_{nullptr};
};
TORCH_MODULE(TinyTransformer);

using StateDict = std::map<std::string, at::Tensor>;
// One step's gradients by parameter name; an undefined tensor: no gradient.
using StepGrads = std::map<std::string, at::Tensor>;

// Clones of `module`'s current gradients (undefined where it has none), and of
// its parameters.
StepGrads CloneGrads(torch::nn::Module& module);
StateDict CloneParams(torch::nn::Module& module);

// Deterministic initial weights (seeded once, on the calling thread).
StateDict MakeInitialState(const ModelDims& dims, uint64_t seed);
TinyTransformer MakeModel(const ModelDims& dims, const StateDict& init);

// How one training run is configured; the policy fields never change the
// numbers.
struct RunConfig {
  ModelDims dims;
  int steps = 3;
  int global_batch = 8;
  int microbatches = 1;
  bool sync_every_microbatch =
      true;  // requires_grad_sync on non-last microbatches
  bool all_reduce_every_microbatch =
      true;  // requires_all_reduce on non-last microbatches
  bool reshard_after_forward = true;
  bool reshard_after_backward = true;
  int prefetch = 0;
  bool offload = false;
  bool checkpoint = false;
  double clip_norm = 0;  // 0: no clipping
  double lr = 2e-3;
  MixedPrecisionPolicy mixed_precision;
  GradientReduction gradient_reduction;
  // Policy.comm_fusion_bucket_bytes (0: no fusion).
  int64_t comm_fusion_bucket_bytes = 0;
  // When not empty, step s runs with comm_fusion_bucket_bytes =
  // fusion_bucket_by_step[s % size]: a policy changed between steps.
  std::vector<int64_t> fusion_bucket_by_step;
  // Policy.reshard_after_forward_within_host, planned for a generation whose
  // host_group_size is this (0: none; RunOnMesh's host_group_size must
  // match).
  int within_host_group = 0;
};

struct RunResult {
  std::vector<double>
      losses;  // this rank's loss per step (sum over its microbatches)
  StateDict
      params;  // final full parameters (global rank 0 only for sharded runs)
  EngineStats stats;
};

// The policy a RunConfig describes: both reshard flags, prefetch depth
// `prefetch` both ways, microbatches and their sync / all-reduce modes, the
// comm fusion bucket.
hsdp::v1::Policy PolicyFor(const RunConfig& config);
// The production planner's schedule (coordinator/planner.h) of that policy for
// `engine`'s units.
hsdp::v1::StepSchedule PlanSchedule(const Engine& engine,
                                    const RunConfig& config);
// The same for a model of `num_units` units named as the test model's ("root",
// "layers.0", ...) when no engine is at hand. Tests that need a schedule the
// planner never makes edit one of these.
hsdp::v1::StepSchedule MakeSchedule(int num_units, const RunConfig& config);

// The planner's unit list (PlannerUnits) of the test model `config.dims`
// describes, built on a one-rank mesh: e.g. to choose comm fusion buckets.
UnitList TestModelUnits(const RunConfig& config);

// The engine options a RunConfig asks for (mixed precision, offload, the
// default reshard after forward).
EngineOptions EngineOptionsFor(const RunConfig& config);
// Builds the engine over `model` (one unit per block + root).
std::unique_ptr<Engine> MakeEngine(TinyTransformer& model, MeshComms comms,
                                   const RunConfig& config);
// Sharded forward through the engine; logits. With a log, every unit's
// compute is marked in it (forward and backward begin/end; see
// recording_communicator.h).
at::Tensor EngineForward(Engine& engine, TinyTransformer& model,
                         const at::Tensor& tokens, bool checkpoint,
                         CollectiveLog* log = nullptr);

// The tokens/targets of global step `step`, samples [begin, begin + count).
std::pair<at::Tensor, at::Tensor> Batch(const ModelDims& dims, int step,
                                        int begin, int count);

// Cross-entropy of logits [B, T, vocab] (in fp32) against targets [B, T].
at::Tensor Loss(const at::Tensor& logits, const at::Tensor& targets);

// One rank of a sharded run; `dp_rank`/`dp_size` pick its slice of each global
// batch.
RunResult TrainSharded(MeshComms comms, int dp_rank, int dp_size,
                       const StateDict& init, const RunConfig& config);
// Single-process unsharded training on the global batch.
RunResult TrainReference(const StateDict& init, const RunConfig& config);

struct RankContext {
  int rank = 0;
  comm::DeviceMesh* mesh = nullptr;
  MeshComms comms() const {
    return MeshComms{&mesh->shard(), &mesh->replicate(), mesh->host()};
  }
};
// Runs fn on every rank of a replicate × shard mesh (threads, Gloo over
// 127.0.0.1; with `shared_memory`, the unit collectives of each group go
// through ShmCommunicator, as on one host in production; with
// `host_group_size`, rank r reports host "host-<r / host_group_size>", so
// shard groups of four or more ranks get host groups of that many).
void RunOnMesh(comm::MeshShape shape,
               const std::function<void(RankContext&)>& fn,
               absl::Duration timeout = absl::Seconds(30),
               bool shared_memory = true, int host_group_size = 0);

// max |a - b| over every tensor of two state dicts with equal keys (inf on a
// mismatch).
double MaxAbsDiff(const StateDict& a, const StateDict& b);
bool BitwiseEqual(const StateDict& a, const StateDict& b);

}  // namespace hsdp::fsdp::testing

#endif  // HSDP_TESTS_WORKER_FSDP_FSDP_TEST_UTIL_H_
