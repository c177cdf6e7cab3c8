// The public API of the sharding engine: FSDP2/HSDP-style fully sharded data
// parallelism for LibTorch C++ modules, driven by a hsdp::v1::StepSchedule.
//
// Usage (one Engine per model per rank; ranks may be threads or processes),
// e.g. with hsdp::models::Gpt and a comm::DeviceMesh:
//
//   fsdp::MeshComms comms{&mesh->shard(), &mesh->replicate()};
//   fsdp::EngineOptions opts;  // device, mixed precision, offload, reshard
//   auto engine = fsdp::Engine::Create(gpt.ptr(), comms, opts).value();
//   for (int i = 0; i < gpt->num_blocks(); ++i)  // forward order: units 1..n
//     engine->FullyShard({gpt->block(i).ptr()}, models::UnitName(i + 1));
//   engine->FullyShardRoot();  // leftover parameters: unit 0 "root"
//   torch::optim::AdamW opt(engine->Parameters(), AdamWOptions(lr));
//
//   // LibTorch has no forward hooks: the model enters each unit explicitly.
//   gpt->set_block_runner([&](int i, const at::Tensor& x) {
//     models::Block block = gpt->block(i);  // by value: recompute may rerun it
//     return engine->Unit(i + 1).Forward(x, [block](const at::Tensor& y) {
//       return models::Block(block)->forward(y);
//     });
//   });
//   for (int mb = 0; mb < n_microbatches; ++mb) {
//     RETURN_IF_ERROR(engine->Apply(schedule, mb));
//     at::Tensor loss = engine->Root().Forward(tokens[mb], [&](auto& t) {
//       return gpt->Loss(t, targets[mb]);
//     }) / n_microbatches;
//     loss.backward();  // every reduction has finished when this returns
//   }
//   fsdp::ClipGradNormGlobal(*engine, 1.0);
//   opt.step();
//   opt.zero_grad();
//
// Errors: set-up, Apply and the helpers return absl::Status. A collective that
// fails inside forward or backward (dead or stalled peer) surfaces as a
// c10::Error thrown by UnitHandle::Forward / backward() — the only way out of
// an autograd hook — whose message is the Status; it is also kept (sticky) in
// Engine::status(), and Apply refuses to go on. Catch c10::Error around the
// step and end the generation. A misuse of the engine inside a forward (units
// entered out of order, Forward before FullyShardRoot) throws a c10::Error
// whose message starts with kUsageErrorPrefix and leaves status() OK: a
// mistake in the model's code, the same on every rank, not a reason to
// re-form.
//
// `ShardedModule<M>` wraps a module holder so `wrapped(x)` is
// `unit.Forward(x, module->forward)`. Activation recompute: `Recompute(engine,
// fn, x)` reruns fn (and the unit Forward inside it) in backward.
//
// Numerics: gradients are averaged over all ranks (shard × replicate), so each
// rank's loss should be the mean over its local batch; sharded training then
// equals single-process training on the global batch. Reshard, prefetch and
// offload choices never change the numbers (bitwise).
//
// Every rank, the same collectives, whatever the data (routed experts,
// conditional branches, a unit used several times):
//  - A parameter that gets no gradient on this rank joins its unit's
//    reduction with zeros. It gets the average over all ranks, as any other
//    parameter; it keeps an undefined grad (the optimizer skips it, as in
//    single-process training) only when no rank had a gradient for it in any
//    of the step's microbatches.
//  - Units are entered for the first time in each forward in the order they
//    were declared (FullyShard order, root first if the root wraps the
//    forward); a unit entered after a later one fails the forward with
//    FAILED_PRECONDITION naming both. A unit this rank skips (a routed expert
//    unit with no tokens here) runs its forward collectives when the next unit
//    is entered, or when the root's forward ends, and its backward ones where
//    its backward would have run: it costs the gather, never a hang.
//  - A unit entered but not reached by this rank's backward (its output did
//    not reach the loss) runs its backward collectives, with no gradients,
//    before the first unit whose forward ended earlier; a unit whose inputs
//    need no gradient finishes at the end of backward, as always.
//  - A unit may be entered again in the same forward (weight reuse across
//    depth): one gather while it stays unsharded, its gradients accumulate
//    over every call and it is reduced once, after its last call's backward.
//    The number of calls must be the same on every rank.
//
// Thread-safety: an Engine and everything it returns are thread-compatible —
// drive it from one training thread (autograd may call the hooks on its own
// worker thread while that thread waits in backward(), which is still
// serialised).
#ifndef HSDP_FULLY_SHARD_H_
#define HSDP_FULLY_SHARD_H_

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "hsdp/communicator.h"
#include "hsdp/memory_breakdown.h"
#include "hsdp/placement.h"

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace hsdp::v1 {
class StepSchedule;
class UnitInfo;
}  // namespace hsdp::v1

namespace hsdp::fsdp {

class UnitGroup;
class EngineCore;
class TraceRecorder;

// How the messages of usage errors thrown inside a forward begin.
inline constexpr char kUsageErrorPrefix[] = "hsdp engine misuse: ";

// The communicators of this rank in a replicate × shard mesh. Not owned:
// they must outlive the Engine. `replicate` may be null or of size 1 (plain
// FSDP). `host` (optional) is this rank's host group: the run of
// host->size() consecutive shard ranks it belongs to (its rank in the run is
// shard rank % host->size()), the ranks of the shard group on its host.
// Hierarchical reshard (StepSchedule.post_forward_group_size) gathers over
// it; a schedule that asks for it needs it.
struct MeshComms {
  comm::Communicator* shard = nullptr;
  comm::Communicator* replicate = nullptr;
  comm::Communicator* host = nullptr;
};

// FSDP2's MixedPrecisionPolicy. Unset dtypes mean "the parameter's own dtype".
struct MixedPrecisionPolicy {
  // Dtype of the all-gathered (compute) parameters.
  std::optional<c10::ScalarType> param_dtype;
  // Dtype gradients are reduced in (default: param_dtype).
  std::optional<c10::ScalarType> reduce_dtype;
  // Dtype a unit's unsharded gradients accumulate in until they are reduced,
  // across the microbatches of a step that do not synchronise gradients
  // (default: param_dtype, in the module parameter's own grad). kFloat with a
  // bf16 param_dtype is Megatron's fp32 main gradient: after each backward of
  // the unit its bf16 gradients are added into an fp32 copy, so precision holds
  // over many microbatches. Costs 4 bytes per unsharded element from the unit's
  // first backward of the step until its reduction (EngineStats counts them
  // with the unsharded gradients).
  std::optional<c10::ScalarType> grad_accumulation_dtype;
  // Root outputs are cast to this.
  std::optional<c10::ScalarType> output_dtype;
  // Floating inputs of each unit are cast to param_dtype.
  bool cast_forward_inputs = true;
};

// Sharded parameters and gradients live on the CPU (pinned where CUDA exists);
// the optimizer steps there and each all-gather copies the shard to the compute
// device first.
struct OffloadPolicy {
  bool offload_params = false;
};

// How each parameter's gradients combine across the ranks of the mesh
// (FSDP2's set_gradient_divide_factor and set_force_sum_reduction_for_comms;
// hyper_parallel's set_reduce_op_type). These change the numbers: every rank
// and the single-process reference must agree on them.
struct GradientReduction {
  // kAvg (the default): the average over all ranks, for a loss that is the
  // mean over each rank's samples; sharded training then equals
  // single-process training on the global batch. kSum: the sum over ranks,
  // for a loss summed over samples.
  comm::ReduceOp op = comm::ReduceOp::kAvg;
  // When set (> 0): the sum over ranks divided by this instead of by the
  // number of ranks (op is then ignored), e.g. the tokens of the global batch
  // when each rank's loss is summed over its tokens.
  std::optional<double> divide_factor;
};

struct EngineOptions {
  c10::Device device = c10::kCPU;  // compute device of the unsharded parameters
  MixedPrecisionPolicy mixed_precision;
  OffloadPolicy offload;
  GradientReduction gradient_reduction;
  // Default for units; a StepSchedule overrides it per unit and step.
  bool reshard_after_forward = true;
};

struct UnitOptions {
  // Unset: EngineOptions::reshard_after_forward.
  std::optional<bool> reshard_after_forward;
  // Parameters of the unit's modules that stay unsharded, untouched, and out of
  // Parameters(): their gradients are not reduced across ranks either (as in
  // FSDP2); the caller owns them. Pass the same list to FullyShardRoot so the
  // root does not claim them.
  std::vector<at::Tensor> ignored_params;
  // FSDP2's set_unshard_in_backward. false: backward through this unit never
  // reads its parameters (an embedding table, whose gradient is a scatter of
  // the output gradient), so a unit resharded after forward is not gathered
  // again for backward (one all-gather less per microbatch; recompute still
  // gathers). Wrong for a module whose backward reads its weights, as a
  // Linear's does: that backward would read freed storage.
  bool unshard_in_backward = true;
  // Each parameter's placement (placement.h): FSDP2's shard_placement_fn
  // (Shard(dim)) and hyper_parallel's replicate_params in one. Unset, or
  // std::nullopt for a parameter: sharded on dim 0. A shard dim out of range,
  // or a 0-dim parameter not replicated, fails FullyShard naming it.
  PlacementFn placement;
};

// Static description of a unit. ToProto gives what the worker reports when it
// joins (hsdp.v1.UnitInfo).
struct UnitLayout {
  std::string name;
  int64_t num_params = 0;  // parameter tensors
  int64_t numel = 0;       // elements of the unsharded parameters
  // Bytes of the unsharded parameters in their own (master) dtype.
  int64_t bytes = 0;
  // Bytes of the unsharded parameters in param_dtype.
  int64_t unsharded_bytes = 0;
  // Bytes of this rank's padded shards (the master copy), replicated
  // parameters whole.
  int64_t sharded_bytes = 0;
  // Bytes of the replicated parameters (master dtype): held whole on every
  // rank, in sharded_bytes too.
  int64_t replicated_bytes = 0;
  // Fully qualified names under the root module.
  std::vector<std::string> param_names;
};

// Accounting of one unit on this rank. Times are cumulative seconds since
// Create/ResetStats.
struct UnitStats {
  int64_t sharded_bytes = 0;
  // Storage bytes of the unsharded params right now.
  int64_t unsharded_bytes_alive = 0;
  // Sharded + unsharded gradient bytes right now.
  int64_t grad_bytes = 0;
  int64_t peak_unsharded_bytes = 0;
  // The all-gathers and reduce-scatters this unit issued. With comm fusion
  // one collective carries several units' bytes: it counts here once, on the
  // unit that issued it (its time too), and in fused_* on the others.
  int64_t all_gathers = 0;
  int64_t reduce_scatters = 0;
  // Comm fusion: the other units' all-gathers and reduce-scatters this
  // unit's bytes went out in.
  int64_t fused_all_gathers = 0;
  int64_t fused_reduce_scatters = 0;
  // Hierarchical reshard: all-gathers over the host group from the copy kept
  // after forward (not counted in all_gathers, which are the shard group's).
  int64_t host_all_gathers = 0;
  // HSDP all-reduces across the replicate group (none with one replica), and
  // the replicated parameters' all-reduces (one over the shard group and one
  // over the replicate group per synchronising microbatch).
  int64_t all_reduces = 0;
  double all_gather_seconds = 0;
  double reduce_scatter_seconds = 0;
  double all_reduce_seconds = 0;
};

struct EngineStats {
  std::vector<UnitStats> units;  // indexed like Units()
  int64_t sharded_bytes = 0;
  int64_t unsharded_bytes_alive = 0;
  int64_t peak_unsharded_bytes = 0;  // peak of the sum over units
  // Peak of the unsharded gradient bytes held at once (sampled at each
  // post-backward).
  int64_t peak_unsharded_grad_bytes = 0;
  // Flat communication buffers, in use or kept idle for reuse (at most one
  // largest unit's or fusion group's worth idle), now and at peak.
  int64_t comm_buffer_bytes = 0;
  int64_t peak_comm_buffer_bytes = 0;
  // The peaks above are taken separately and never coincide. This is the
  // peak of their sum, at moments when all of them exist together:
  // sampled after each all-gather's copy-out (before its flat buffer goes
  // back to the pool) and after each reduce-scatter's copy-in (before the
  // unsharded grads are dropped). Its parts are the values at that moment.
  int64_t peak_transient_bytes = 0;
  int64_t peak_transient_param_bytes = 0;
  int64_t peak_transient_grad_bytes = 0;
  int64_t peak_transient_comm_bytes = 0;
  int64_t grad_bytes = 0;
  double all_gather_seconds = 0;
  double reduce_scatter_seconds = 0;
  double all_reduce_seconds = 0;
  // Sums of the units' collective counts: the collectives issued (a fused
  // one counts once).
  int64_t all_gathers = 0;
  int64_t reduce_scatters = 0;
  int64_t all_reduces = 0;
  int64_t host_all_gathers = 0;
  // What one microbatch's forward left allocated besides the engine's own
  // bytes (the activations autograd saved, the outputs), largest over the
  // microbatches: the memory meter's growth over the root's forward minus the
  // engine's (memory_meter.h). 0 where no meter measures.
  int64_t activation_bytes = 0;
  // The meter's peak since ResetStats (memory_meter.h); -1 where none.
  int64_t measured_peak_bytes = -1;
  // The engine's accounting in the memory model's categories: the shards, the
  // sharded grads now, optimizer state by the model's AdamW rule (the
  // optimizer is not the engine's), the transient peak's parts and the
  // activations above.
  MemoryBreakdown peak_memory;
};

using TensorFn = std::function<at::Tensor(const at::Tensor&)>;
using TensorListFn =
    std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

// An all-gather started by UnitHandle::Unshard(/*async_op=*/true).
// Thread-compatible; valid while its Engine is.
class UnshardHandle {
 public:
  // Completes the gather and fills the unit's parameters (a no-op once done).
  absl::Status Wait();

 private:
  friend class UnitHandle;
  explicit UnshardHandle(UnitGroup* group) : group_(group) {}
  UnitGroup* group_;
};

// A registered unit. Owned by the Engine; references stay valid for the
// Engine's lifetime. Thread-compatible, like the Engine.
class UnitHandle {
 public:
  // Runs `fn` inside the unit: pre-forward (all-gather, prefetch, input cast),
  // fn, post-forward (reshard, backward hooks). A failed collective throws
  // c10::Error (see "Errors" above).
  at::Tensor Forward(const at::Tensor& input, const TensorFn& fn);
  std::vector<at::Tensor> Forward(const std::vector<at::Tensor>& inputs,
                                  const TensorListFn& fn);

  // Manual control (FSDP2's FSDPModule.unshard / reshard), for passes that
  // do not go through Forward, e.g. an evaluation pass over the plain modules
  // between training steps. Unshard gathers the unit's parameters; with
  // async_op it only issues the all-gather and the handle's Wait completes
  // it. Reshard frees them (completing an issued gather first). Both are
  // collectives on the shard group: every rank calls them for the same units
  // in the same order, between steps or inside a forward, never during
  // backward (FAILED_PRECONDITION). The next step's first Apply reshards
  // every unit anyway (the optimizer changed the shards).
  absl::StatusOr<UnshardHandle> Unshard(bool async_op = false);
  absl::Status Reshard();

  int index() const;
  const std::string& name() const;

 private:
  friend class Engine;
  explicit UnitHandle(UnitGroup* group) : group_(group) {}
  UnitGroup* group_;
};

class Engine {
 public:
  // `root` is the whole model: parameter names are taken relative to it, and
  // its parameters not claimed by FullyShard() become the root unit.
  static absl::StatusOr<std::unique_ptr<Engine>> Create(
      std::shared_ptr<torch::nn::Module> root, MeshComms mesh,
      EngineOptions options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Registers `modules` (one or several, all under root) as the next unit in
  // forward order and shards their parameters. Returns the unit index (1, 2,
  // ...; index 0 is reserved for root).
  absl::StatusOr<int> FullyShard(
      const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
      const std::string& name, const UnitOptions& options = {});
  // Shards the leftover parameters of root as unit 0 "root" and finishes
  // set-up. Call once, after every FullyShard(); Forward/Apply/Parameters need
  // it.
  absl::Status FullyShardRoot(const UnitOptions& options = {});

  // Sets per-unit reshard/prefetch and per-microbatch gradient sync from the
  // schedule. Call before each microbatch's forward. Microbatch 0 starts a
  // step: units left unsharded by the previous step are resharded (the
  // optimizer changed the shards). A schedule with no microbatches means one
  // synchronising microbatch. INVALID_ARGUMENT if the unit list does not match.
  absl::Status Apply(const hsdp::v1::StepSchedule& schedule, int microbatch);

  // Unit 0 is root. Valid after FullyShardRoot().
  UnitHandle& Root();
  UnitHandle& Unit(int index);
  int num_units() const;
  std::vector<UnitLayout> Units() const;
  EngineStats Stats() const;
  void ResetStats();

  // The local shards (plain leaf tensors) for the optimizer, in unit then
  // parameter order.
  std::vector<at::Tensor> Parameters() const;
  // Same, with their fully qualified names.
  std::vector<std::pair<std::string, at::Tensor>> NamedParameters() const;

  // First collective error since Create or the last Rebind (sticky): once
  // set, the engine stops issuing collectives.
  absl::Status status() const;

  // For error messages: the unit the current forward entered last and the
  // first unit declared after it ("" where there is none). A sharded unit's
  // parameters read outside its forward (its module called directly) fail in
  // LibTorch without a name; in a forward that enters units in order, the
  // culprit is most likely the next one.
  std::pair<std::string, std::string> ForwardPosition() const;

  // Elastic recovery: abandons the interrupted step and continues on `comms`.
  // Call on the training thread, between steps (after the failed step's
  // forward/backward was left by its c10::Error and every tensor of it —
  // loss, outputs — was dropped), and only once the old communicators were
  // aborted and Abort returned OK (comm::Communicator::Abort: then no
  // collective touches the engine's buffers any more).
  //
  // Drops, without waiting: every all-gather, reduce-scatter and all-reduce
  // in flight, the flat buffers, the unsharded parameter storage (every unit
  // back to sharded, as after a normal reshard), the unsharded and sharded
  // gradients (the failed step is discarded: sharded grads become undefined),
  // pending and partial (not yet all-reduced) reductions, the per-pass flags,
  // recompute state and the sticky error. Keeps: the sharded parameters
  // exactly as the last completed optimizer step left them (so an optimizer
  // holding Parameters() keeps working), the units, options and stats.
  //
  // The shard group must keep its size and this rank's place in it (the
  // shards are not redistributed): FAILED_PRECONDITION naming both
  // otherwise, and nothing changes. The replicate group may differ in size
  // and rank (or be null); gradients are then averaged over the new mesh, so
  // keep the global batch fixed by giving each rank its new share.
  // `comms` is not owned and must outlive the engine (or the next Rebind).
  // The old communicators are not used, but the dropped works were theirs:
  // destroy them only after Rebind returned.
  absl::Status Rebind(MeshComms comms);

  // Records per-unit spans (forward, backward, collective waits, collectives
  // in flight) into `recorder` until set back to null (the default: nothing
  // recorded). `recorder` must outlive its use; set it between steps.
  void SetTraceRecorder(TraceRecorder* recorder);

 private:
  friend EngineCore& CoreOf(Engine& engine);
  friend const EngineCore& CoreOf(const Engine& engine);
  explicit Engine(std::unique_ptr<EngineCore> core);
  std::unique_ptr<EngineCore> core_;
  std::vector<std::unique_ptr<UnitHandle>> handles_;
};

// A module holder wrapped so that calling it enters its unit:
//   ShardedModule<Block> block(engine->Unit(1), model->layers[0]);
//   at::Tensor y = block(x);
// Thread-compatible, like the Engine whose unit it enters.
template <typename ModuleHolder>
class ShardedModule {
 public:
  ShardedModule(UnitHandle& unit, ModuleHolder module)
      : unit_(&unit), module_(std::move(module)) {}
  at::Tensor operator()(const at::Tensor& x) {
    return unit_->Forward(
        x, [this](const at::Tensor& in) { return module_->forward(in); });
  }
  ModuleHolder& module() { return module_; }

 private:
  UnitHandle* unit_;
  ModuleHolder module_;
};

// Activation recomputation: runs fn without saving activations and reruns it in
// backward. Units entered inside fn are re-gathered during the recompute
// without forward prefetch. `input` must require grad (as a block's hidden
// state does), or no backward runs through fn; fn may run again after the
// caller returned, so capture by value what does not outlive the step.
at::Tensor Recompute(Engine& engine, const TensorFn& fn,
                     const at::Tensor& input);

// What FullyShard / FullyShardRoot record for a unit of these parameters (fully
// qualified names under the root; any device, meta included; the master dtype),
// for `shard_size` ranks and the unit's `placement`, without sharding
// anything: Engine::Units() reports exactly this for every unit.
UnitLayout DescribeUnit(
    const std::string& name,
    const std::vector<std::pair<std::string, at::Tensor>>& params,
    const EngineOptions& options, int shard_size,
    const PlacementFn& placement = nullptr);

// The unit as the coordinator sees it: name, elements, master bytes.
hsdp::v1::UnitInfo ToProto(const UnitLayout& info);

// Clips the sharded gradients so the global norm over all shards is at most
// max_norm (a collective on the shard communicator: call it on every rank).
// Returns the norm before clipping.
absl::StatusOr<double> ClipGradNormGlobal(Engine& engine, double max_norm);

// The unsharded fp32 parameters by name, gathered on global rank 0 (a
// collective: every rank calls it; ranks other than 0 get an empty map).
absl::StatusOr<std::map<std::string, at::Tensor>> FullStateDict(Engine& engine);
// Loads a full state dict held by global rank 0 into every rank's shards (a
// collective; other ranks pass an empty map). NOT_FOUND / INVALID_ARGUMENT on a
// missing name or a shape mismatch.
absl::Status LoadFullStateDict(Engine& engine,
                               const std::map<std::string, at::Tensor>& state);

// One rank's shard of one parameter with what is needed to place it.
struct ShardedTensor {
  // This rank's rows (unpadded): slices [row_offset, row_offset + n) of the
  // parameter along shard_dim, in the parameter's orientation. A copy in
  // ShardedStateDict; the optimizer's own leaf in ShardLayouts.
  at::Tensor local;
  std::vector<int64_t> global_shape;
  int64_t row_offset = 0;  // first global row (slice along shard_dim) held here
  int64_t shard_dim = 0;
  // Held whole on every rank (row_offset 0, every row).
  bool replicated = false;
  int shard_rank = 0;
  int shard_size = 1;
};
std::map<std::string, ShardedTensor> ShardedStateDict(const Engine& engine);
// Every parameter's shard and layout in NamedParameters() order, without
// copying: `local` is the optimizer's leaf (Parameters()), for checkpoints,
// whose optimizer state is keyed by it.
std::vector<std::pair<std::string, ShardedTensor>> ShardLayouts(
    const Engine& engine);
// Local only (no collectives): the layout must match this rank's.
absl::Status LoadShardedStateDict(
    Engine& engine, const std::map<std::string, ShardedTensor>& state);

}  // namespace hsdp::fsdp

#endif  // HSDP_FULLY_SHARD_H_
