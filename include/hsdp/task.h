// The public worker API: the interface a user implements to train their own
// LibTorch model under an hsdp coordinator.
//
// A Task owns one model and its data. The runner (RunTask in runner.h) owns the
// Task and does everything else: join, mesh, sharding, the schedule loop,
// optimizer and learning-rate schedule, reports, checkpoints, drain, errors.
// The same Task also runs unsharded in one process (RunReference), so any model
// can be checked against single-process training.
//
// clang-format off
// The example below is tests/worker/train/task_example_test.cc, which builds
// and trains it (a test checks that the two stay the same):
//
//   class BlockImpl : public torch::nn::Module {
//    public:
//     BlockImpl() { fc = register_module("fc", torch::nn::Linear(16, 16)); }
//     at::Tensor forward(const at::Tensor& x) { return x + torch::relu(fc(x)); }
//     torch::nn::Linear fc{nullptr};
//   };
//
//   class MyTask : public hsdp::train::Task {
//    public:
//     std::string Name() const override { return "my-model"; }
//     absl::Status Build(const hsdp::train::BuildContext& ctx) override {
//       model_ = std::make_shared<torch::nn::Module>("MyModel");
//       for (int i = 0; i < 4; ++i) {
//         blocks_.emplace_back(model_->register_module(
//             absl::StrCat("blocks_", i), std::make_shared<BlockImpl>()));
//       }
//       head_ = model_->register_module("head", torch::nn::Linear(16, 2));
//       hsdp::train::InitParameters(*model_, ctx.seed);  // not torch's RNG
//       return absl::OkStatus();
//     }
//     std::shared_ptr<torch::nn::Module> Model() override { return model_; }
//     int NumUnits() const override { return 4; }
//     absl::StatusOr<hsdp::train::UnitSpec> BuildUnit(int i) override {
//       return blocks_[i].Spec(absl::StrCat("blocks.", i));
//     }
//     absl::StatusOr<hsdp::train::Batch> GetBatch(
//         const hsdp::train::BatchRequest& r) override {
//       at::Tensor x = torch::empty({r.sample_count, 16});
//       for (int64_t b = 0; b < r.sample_count; ++b) {
//         x[b].normal_(0, 1, hsdp::train::SampleGenerator(
//                                r.seed, r.step, r.first_sample + b));
//       }
//       return hsdp::train::Batch{x, (x.sum(1) > 0).to(torch::kLong)};
//     }
//     absl::StatusOr<at::Tensor> Loss(const hsdp::train::Batch& batch) override {
//       at::Tensor h = batch.input;
//       for (const auto& block : blocks_) h = block(h);  // enters its unit
//       return torch::nn::functional::cross_entropy(head_(h), batch.target);
//     }
//
//    private:
//     std::shared_ptr<torch::nn::Module> model_;
//     std::vector<hsdp::train::Unit<BlockImpl>> blocks_;  // unit.h
//     torch::nn::Linear head_{nullptr};
//   };
// clang-format on
//
// Units. A unit is a group of modules whose parameters are gathered and freed
// together (FSDP2's fully_shard). NumUnits() units, in forward order, are
// numbered 0..NumUnits()-1 here; in the job's unit list (schedules, policies,
// reports) the root unit comes first as index 0 and task unit i is index i+1.
// Every parameter under Model() that no unit claims belongs to the root unit,
// which is gathered around the whole of Loss(). A parameter reached from two
// units (tied weights) must be in the root: sharding refuses it otherwise.
//
// Lifetimes and ownership. The runner owns the Task and destroys it after the
// run; the Task owns its model. Build() runs once per process, before anything
// else. BuildUnit(i) runs once per unit per process in the normal flow, plus
// once more per unit before joining (to describe the units to the
// coordinator), each time followed by ReleaseUnit(i) in that describing pass.
// SetShardContext() runs after the units are sharded, once per sharded model
// (again after a membership change rebuilds it); the ShardContext it receives
// stays valid until the next SetShardContext() call or the end of the run.
//
// Sharded initialisation. A task that constructs unit i's modules inside
// BuildUnit(i) (initialised from the seed and i alone, registered under
// Model()) and drops them in ReleaseUnit(i) lets each rank hold only one unit's
// full parameters at a time: the runner shards each unit as soon as it is
// built. A task that builds everything in Build() works too, but every rank
// then holds the whole unsharded model once.
//
// Threading. Every method is called on the one training thread. Functions
// passed to ShardContext::Forward may run again during backward (activation
// recompute), on the autograd thread while the training thread waits in
// backward(): capture by value what they need. Loss() is not a collective, but
// the unit Forwards it makes are; the engine keeps every rank's collectives
// the same as long as the rules below hold.
//
// Parameters without a gradient (mixture of experts, conditional branches).
// What a rank's data routes where may differ between ranks; the engine runs
// the same collectives everywhere and gives each parameter the gradient
// single-process training gives it:
//  - A parameter with no gradient on this rank is reduced with zeros, so it
//    gets the average over every rank's samples; its grad stays undefined (the
//    optimizer skips it) only when no rank had one in the whole step.
//  - Enter units, each for the first time in a forward, in unit order. A unit
//    may be skipped (an expert unit with no tokens on this rank): it still
//    costs its gather and a reduction of zeros, never a hang. Entering a unit
//    after a later one fails the step, naming both.
//  - A unit may be entered several times in one forward (one weight used at
//    several depths), the same number of times on every rank: gathered once
//    while it stays unsharded, its gradients summed over the calls and reduced
//    once.
//
// Coming from FSDP2 / hyper_parallel (the whole table: worker/README.md):
//   fully_shard(block)             a Unit<Block> wrapper returned by BuildUnit
//   shard_placement_fn, Shard(1)   Placement() -> ParamPlacement{.shard_dim=1}
//   replicate_params               Placement() -> {.replicated = true}
//   set_unshard_in_backward(False) UnitSpec::unshard_in_backward = false
//   set_reduce_scatter_unused_params  always on (see above)
//   a module reused in one forward    supported (see above)
//   reshard/prefetch/gradient sync    policy fields (hsdpctl), not the task's
//   MixedPrecisionPolicy, OffloadPolicy, checkpoint_wrapper, divide factor
//                                  worker flags (--param-dtype, --cpu-offload,
//                                  --recompute-units, --grad-divide-factor)
//
// Errors. Return absl::Status; never throw (the runner still converts a stray
// c10::Error into a status). The runner reserves ABORTED and UNAVAILABLE for
// membership changes and the coordinator: return other codes.
//
// Versioning. Name() and Version() are reported when joining; every worker of a
// job must report the same pair. Bump Version() whenever a change alters the
// numbers (init, data order, loss). New virtual methods are only ever added
// with a default that keeps existing tasks correct (kTaskApiVersion counts
// such additions).
#ifndef HSDP_TASK_H_
#define HSDP_TASK_H_

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "hsdp/placement.h"

namespace torch::nn {
class Module;
}  // namespace torch::nn
namespace torch::optim {
class Optimizer;
}  // namespace torch::optim

namespace hsdp::train {

// Version of this header's contract (2: Task::Placement).
inline constexpr int kTaskApiVersion = 2;

// What Build() gets.
struct BuildContext {
  // Where the unsharded parameters compute. Build on the CPU or here; the
  // runner moves the model to this device before sharding.
  c10::Device device = c10::kCPU;
  // The job's seed: initial values must be a function of it alone.
  uint64_t seed = 0;
};

class ShardContext;

// Where a Unit<> wrapper (unit.h) enters its unit: the runner sets it once
// the unit is sharded (or in the reference) and clears it when that context
// goes away. Tasks that enter units through ShardContext::Forward ignore it.
struct UnitBinding {
  ShardContext* context = nullptr;
  int index = -1;
};

// One unit: its name in the job's unit list ("layers.3"; not "root") and its
// modules, all registered under Task::Model().
struct UnitSpec {
  std::string name;
  std::vector<std::shared_ptr<torch::nn::Module>> modules;
  // false: backward through the unit never reads its parameters (an
  // embedding table), so it is not gathered again for backward. Wrong for a
  // unit whose backward reads its weights (any Linear): see
  // fsdp::UnitOptions::unshard_in_backward.
  bool unshard_in_backward = true;
  // Set by Unit<>::Spec (unit.h); null otherwise.
  std::shared_ptr<UnitBinding> binding = nullptr;
};

// Samples [first_sample, first_sample + sample_count) of step `step`'s global
// batch: one microbatch. Sample indices run over the whole global batch (the
// same numbering as a report file's first_sample / sample_count); the runner
// decides which rank trains which (on any mesh, and in the reference, the
// same indices give the same samples).
struct BatchRequest {
  int64_t step = 0;
  int64_t first_sample = 0;
  int64_t sample_count = 0;
  uint64_t seed = 0;
};

// One microbatch on the CPU (the runner moves it to the device).
struct Batch {
  at::Tensor input;
  at::Tensor target;
};

// A unit's computation: one tensor in and out, or (UnitTensorsFn) several.
using UnitFn = std::function<at::Tensor(const at::Tensor&)>;
using UnitTensorsFn =
    std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;
// The former name of UnitTensorsFn.
using UnitListFn [[deprecated("use UnitTensorsFn")]] = UnitTensorsFn;

// How Loss() enters the units. In a sharded run Forward() gathers the unit's
// parameters (and starts the prefetches the coordinator scheduled), runs fn,
// then frees them as scheduled; with recompute on for the unit, fn's
// activations are dropped and recomputed in backward. In the reference it runs
// fn directly. A failed collective throws c10::Error out of Forward (the only
// way out of an autograd hook); let it propagate: the runner catches it.
// Thread-compatible: the training thread only.
class ShardContext {
 public:
  virtual ~ShardContext() = default;

  virtual int num_units() const = 0;
  // Runs unit `unit` (0-based, task numbering) around fn.
  virtual at::Tensor Forward(int unit, const at::Tensor& input,
                             const UnitFn& fn) = 0;
  // Several inputs/outputs (no recompute: one input only).
  virtual std::vector<at::Tensor> Forward(int unit,
                                          const std::vector<at::Tensor>& inputs,
                                          const UnitTensorsFn& fn) = 0;
};

class Task {
 public:
  virtual ~Task() = default;

  // Reported when joining: every worker of a job must run the same name and
  // version.
  virtual std::string Name() const = 0;
  virtual int Version() const { return 1; }

  // Once per process, first. Builds the model: everything outside the units,
  // and the units too unless BuildUnit constructs them.
  virtual absl::Status Build(const BuildContext& context) = 0;
  // The whole model. Valid after Build().
  virtual std::shared_ptr<torch::nn::Module> Model() = 0;

  virtual int NumUnits() const = 0;
  // Unit `index` in forward order (see "Units" and "Sharded initialisation").
  virtual absl::StatusOr<UnitSpec> BuildUnit(int index) = 0;
  // Drops what BuildUnit(index) constructed (nothing for tasks that build
  // every unit in Build()).
  virtual void ReleaseUnit(int /*index*/) {}

  // After sharding (and in the reference) the runner hands the task the
  // context that enters units: keep it, and call ShardContext::Forward from
  // Loss(). Tasks whose units are Unit<> wrappers (unit.h) need not override
  // it. The default calls Shard(), its former name, so older tasks still work.
  virtual void SetShardContext(ShardContext& context) { Shard(context); }
  // The former name of SetShardContext; override that instead.
  virtual void Shard(ShardContext& /*context*/) {}

  // The samples of one microbatch: a pure function of the request.
  virtual absl::StatusOr<Batch> GetBatch(const BatchRequest& request) = 0;
  // Forward of one microbatch: its mean loss, a scalar that requires grad.
  virtual absl::StatusOr<at::Tensor> Loss(const Batch& batch) = 0;
  // Tokens (or samples) per microbatch sample, for throughput reports.
  virtual int64_t TokensPerSample() const { return 1; }

  // Where a parameter lives across its unit's shard group (placement.h):
  // sharded on a dim other than 0 (FSDP2's shard_placement_fn), or kept whole
  // on every rank with its gradient all-reduced (hyper_parallel's
  // replicate_params). Asked for every parameter under Model(), root unit's
  // included, by its name there (as named_parameters() gives it); it must
  // answer the same on every rank and every call. std::nullopt (the default):
  // sharded on dim 0. Memory changes; the numbers only in the last bits
  // (reduction order). The reference ignores it.
  virtual std::optional<fsdp::ParamPlacement> Placement(
      const std::string& /*fqn*/, const at::Tensor& /*param*/) const {
    return std::nullopt;
  }

  // The optimizer over `params` (this rank's shards, or the full parameters in
  // the reference). nullptr (the default): the job's optimizer. The runner
  // applies the job's learning-rate schedule to every parameter group.
  virtual std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(
      const std::vector<at::Tensor>& params);
};

// What a task factory gets from the worker's command line.
struct TaskArgs {
  // --model
  std::string model;
  // --dims
  std::string dims;
  // --data: a text file, or a token file (see worker/README.md); empty: the
  // task's default data.
  std::string data;
  // --vocab-size (0: the task's default).
  int64_t vocab_size = 0;
  // --task-option KEY=VALUE, repeatable: settings a user's task defines.
  std::map<std::string, std::string> options;
};

using TaskFactory =
    std::function<absl::StatusOr<std::unique_ptr<Task>>(const TaskArgs&)>;

}  // namespace hsdp::train

#endif  // HSDP_TASK_H_
