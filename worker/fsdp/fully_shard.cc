#include "hsdp/fully_shard.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <set>
#include <unordered_map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "hsdp/mesh.h"
#include "hsdp/v1/common.pb.h"
#include "hsdp/v1/schedule.pb.h"
#include "worker/fsdp/engine_core.h"
#include "worker/fsdp/hooks.h"
#include "worker/fsdp/unit_group.h"

namespace hsdp::fsdp {
namespace {

// Runs `fn`, converting a c10::Error (how the engine leaves autograd) to a
// Status.
template <typename Fn>
absl::Status CatchTorch(EngineCore& core, Fn&& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    if (!core.status.ok()) return core.status;
    return absl::InternalError(e.what_without_backtrace());
  }
  return core.status;
}

std::vector<at::Tensor> CastFloating(std::vector<at::Tensor> tensors,
                                     c10::ScalarType dtype) {
  for (at::Tensor& t : tensors) {
    if (t.defined() && t.is_floating_point() && t.scalar_type() != dtype)
      t = t.to(dtype);
  }
  return tensors;
}

}  // namespace

// ---- UnitHandle
// -------------------------------------------------------------------------------

std::vector<at::Tensor> UnitHandle::Forward(
    const std::vector<at::Tensor>& inputs, const TensorListFn& fn) {
  EngineCore& core = group_->core();
  TORCH_CHECK(core.finalized, kUsageErrorPrefix,
              "call FullyShardRoot() before forward");
  group_->PreForward();
  std::vector<at::Tensor> in = inputs;
  const MixedPrecisionPolicy& mp = core.options.mixed_precision;
  if (mp.cast_forward_inputs && mp.param_dtype.has_value())
    in = CastFloating(in, *mp.param_dtype);
  in = AttachPostBackward(group_, std::move(in));
  std::vector<at::Tensor> out = fn(in);
  group_->PostForward();
  out = AttachPreBackward(group_, std::move(out));
  if (group_->index() == 0 && mp.output_dtype.has_value()) {
    out = CastFloating(std::move(out), *mp.output_dtype);
  }
  return out;
}

at::Tensor UnitHandle::Forward(const at::Tensor& input, const TensorFn& fn) {
  return Forward(std::vector<at::Tensor>{input},
                 [&fn](const std::vector<at::Tensor>& in) {
                   return std::vector<at::Tensor>{fn(in[0])};
                 })[0];
}

absl::StatusOr<UnshardHandle> UnitHandle::Unshard(bool async_op) {
  EngineCore& core = group_->core();
  if (!core.finalized) {
    return absl::FailedPreconditionError("Unshard before FullyShardRoot");
  }
  if (core.pass.callback_queued) {
    return absl::FailedPreconditionError(
        absl::StrCat("Unshard of unit ", group_->name(), " during backward"));
  }
  absl::Status s = CatchTorch(core, [&] {
    group_->Unshard();
    if (!async_op) group_->WaitForUnshard();
  });
  if (!s.ok()) return s;
  return UnshardHandle(group_);
}

absl::Status UnitHandle::Reshard() {
  EngineCore& core = group_->core();
  if (core.pass.callback_queued) {
    return absl::FailedPreconditionError(
        absl::StrCat("Reshard of unit ", group_->name(), " during backward"));
  }
  return CatchTorch(core, [&] { group_->Reshard(); });
}

absl::Status UnshardHandle::Wait() {
  EngineCore& core = group_->core();
  return CatchTorch(core, [&] { group_->WaitForUnshard(); });
}

int UnitHandle::index() const { return group_->index(); }
const std::string& UnitHandle::name() const { return group_->name(); }

// ---- Engine
// -----------------------------------------------------------------------------------

Engine::Engine(std::unique_ptr<EngineCore> core) : core_(std::move(core)) {}
Engine::~Engine() = default;

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(
    std::shared_ptr<torch::nn::Module> root, MeshComms mesh,
    EngineOptions options) {
  if (root == nullptr)
    return absl::InvalidArgumentError("Engine::Create: null root module");
  if (mesh.shard == nullptr)
    return absl::InvalidArgumentError("Engine::Create: null shard comm");
  const std::optional<double>& divide =
      options.gradient_reduction.divide_factor;
  if (divide.has_value() && !(*divide > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("Engine::Create: gradient_reduction.divide_factor ",
                     *divide, " is not positive"));
  }
  const std::optional<c10::ScalarType>& accumulation =
      options.mixed_precision.grad_accumulation_dtype;
  if (accumulation.has_value() && !c10::isFloatingType(*accumulation)) {
    return absl::InvalidArgumentError(
        absl::StrCat("Engine::Create: mixed_precision.grad_accumulation_dtype ",
                     c10::toString(*accumulation), " is not a floating dtype"));
  }
  auto core = std::make_unique<EngineCore>(std::move(root), mesh, options);
  core->units.emplace_back(nullptr);  // slot 0: root, filled by FullyShardRoot
  return std::unique_ptr<Engine>(new Engine(std::move(core)));
}

namespace {

struct ClaimContext {
  std::unordered_map<const c10::TensorImpl*, std::string>
      names;                                 // every root parameter
  std::set<const c10::TensorImpl*> claimed;  // in some unit already
};

ClaimContext MakeClaimContext(const EngineCore& core) {
  ClaimContext ctx;
  for (const auto& item : core.root->named_parameters(/*recurse=*/true)) {
    ctx.names.emplace(item.value().unsafeGetTensorImpl(), item.key());
  }
  for (const auto& unit : core.units) {
    if (unit == nullptr) continue;
    for (const ShardedParam* p : unit->params()) {
      ctx.claimed.insert(p->module_param().unsafeGetTensorImpl());
    }
  }
  return ctx;
}

absl::StatusOr<std::unique_ptr<UnitGroup>> BuildUnit(
    EngineCore& core, int index, const std::string& name,
    const std::vector<at::Tensor>& candidates, const UnitOptions& options) {
  ClaimContext ctx = MakeClaimContext(core);
  std::set<const c10::TensorImpl*> ignored;
  for (const at::Tensor& t : options.ignored_params)
    ignored.insert(t.unsafeGetTensorImpl());
  ShardedParamSpec spec;
  spec.shard_rank = core.shard_rank();
  spec.shard_size = core.shard_size();
  spec.compute_device = core.options.device;
  const bool offload = core.options.offload.offload_params;
  spec.shard_device = offload ? c10::Device(c10::kCPU) : core.options.device;
  spec.pin_memory = offload && core.options.device.is_cuda();
  std::vector<std::unique_ptr<ShardedParam>> params;
  std::set<const c10::TensorImpl*> seen;
  for (const at::Tensor& t : candidates) {
    const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    if (ctx.claimed.count(impl) || ignored.count(impl) ||
        !seen.insert(impl).second)
      continue;
    auto it = ctx.names.find(impl);
    if (it == ctx.names.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "unit ", name, ": a parameter is not under the root module"));
    }
    spec.param_dtype = core.param_dtype(t.scalar_type());
    spec.placement = ParamPlacement();
    if (options.placement) {
      std::optional<ParamPlacement> placement;
      try {
        placement = options.placement(it->second, t);
      } catch (const std::exception& e) {
        return absl::InvalidArgumentError(
            absl::StrCat("unit ", name, ": the placement of ", it->second,
                         " threw: ", e.what()));
      }
      if (placement.has_value()) spec.placement = *placement;
    }
    absl::StatusOr<std::unique_ptr<ShardedParam>> p;
    try {
      p = ShardedParam::Create(it->second, t, spec);
    } catch (const c10::Error& e) {
      return absl::InternalError(absl::StrCat("sharding ", it->second, ": ",
                                              e.what_without_backtrace()));
    }
    if (!p.ok()) {
      return absl::Status(
          p.status().code(),
          absl::StrCat("unit ", name, ": ", p.status().message()));
    }
    params.push_back(std::move(*p));
  }
  return std::make_unique<UnitGroup>(&core, index, name, std::move(params),
                                     options.reshard_after_forward.value_or(
                                         core.options.reshard_after_forward),
                                     options.unshard_in_backward);
}

bool UnderPrefix(const std::string& name, const std::string& prefix) {
  return prefix.empty() || (name.size() > prefix.size() &&
                            name.compare(0, prefix.size(), prefix) == 0 &&
                            name[prefix.size()] == '.');
}

// A unit's parameters are gathered only while the unit runs: one that a module
// outside the unit also uses (another unit, or the root's own modules) would
// be read while freed. Such shared (tied) parameters must belong to the root
// unit, which stays gathered through the whole forward and backward.
absl::Status CheckNotShared(
    const EngineCore& core,
    const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
    const std::string& name) {
  std::set<const torch::nn::Module*> wanted;
  for (const auto& m : modules) wanted.insert(m.get());
  std::vector<std::string> prefixes;
  std::set<const torch::nn::Module*> found;
  for (const auto& item : core.root->named_modules()) {
    if (wanted.count(item.value().get()) &&
        found.insert(item.value().get()).second)
      prefixes.push_back(item.key());
  }
  if (found.size() != wanted.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "unit ", name, ": a module is not registered under the root module"));
  }
  std::set<const c10::TensorImpl*> params;
  for (const auto& m : modules) {
    for (const at::Tensor& t : m->parameters(/*recurse=*/true))
      params.insert(t.unsafeGetTensorImpl());
  }
  const ClaimContext ctx = MakeClaimContext(core);
  for (const auto& item : core.root->named_parameters(/*recurse=*/true)) {
    const c10::TensorImpl* impl = item.value().unsafeGetTensorImpl();
    if (!params.count(impl)) continue;
    if (ctx.claimed.count(impl)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "unit ", name, ": parameter ", item.key(),
          " already belongs to an earlier unit; a parameter shared by several "
          "units must belong to the root unit"));
    }
    bool inside = false;
    for (const std::string& prefix : prefixes)
      inside = inside || UnderPrefix(item.key(), prefix);
    if (!inside) {
      return absl::InvalidArgumentError(absl::StrCat(
          "unit ", name, ": one of its parameters is also ", item.key(),
          ", outside the unit; a parameter shared with other modules must "
          "belong to the root unit"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<int> Engine::FullyShard(
    const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
    const std::string& name, const UnitOptions& options) {
  if (core_->finalized) {
    return absl::FailedPreconditionError("FullyShard after FullyShardRoot");
  }
  if (modules.empty())
    return absl::InvalidArgumentError("FullyShard: no modules");
  for (const auto& unit : core_->units) {
    if (unit != nullptr && unit->name() == name) {
      return absl::AlreadyExistsError(
          absl::StrCat("unit name ", name, " used twice"));
    }
  }
  std::vector<at::Tensor> candidates;
  for (const auto& m : modules) {
    if (m == nullptr)
      return absl::InvalidArgumentError("FullyShard: null module");
    for (const at::Tensor& t : m->parameters(/*recurse=*/true))
      candidates.push_back(t);
  }
  if (absl::Status s = CheckNotShared(*core_, modules, name); !s.ok()) return s;
  const int index = static_cast<int>(core_->units.size());
  absl::StatusOr<std::unique_ptr<UnitGroup>> unit =
      BuildUnit(*core_, index, name, candidates, options);
  if (!unit.ok()) return unit.status();
  core_->units.push_back(std::move(*unit));
  return index;
}

absl::Status Engine::FullyShardRoot(const UnitOptions& options) {
  if (core_->finalized)
    return absl::FailedPreconditionError("FullyShardRoot called twice");
  absl::StatusOr<std::unique_ptr<UnitGroup>> root = BuildUnit(
      *core_, 0, "root", core_->root->parameters(/*recurse=*/true), options);
  if (!root.ok()) return root.status();
  core_->units[0] = std::move(*root);
  for (const auto& unit : core_->units) {
    handles_.push_back(std::unique_ptr<UnitHandle>(new UnitHandle(unit.get())));
  }
  core_->SetFusionGroups({});
  core_->finalized = true;
  return absl::OkStatus();
}

absl::Status Engine::Apply(const hsdp::v1::StepSchedule& schedule,
                           int microbatch) {
  if (!core_->finalized)
    return absl::FailedPreconditionError("Apply before FullyShardRoot");
  if (!core_->status.ok()) return core_->status;
  const int n = num_units();
  if (schedule.units_size() != 0 && schedule.units_size() != n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "schedule has ", schedule.units_size(), " units, the engine has ", n));
  }
  for (int i = 0; i < schedule.units_size(); ++i) {
    const hsdp::v1::UnitSchedule& u = schedule.units(i);
    if (u.unit_index() != i) {
      return absl::InvalidArgumentError(absl::StrCat(
          "schedule unit ", i, " has unit_index ", u.unit_index()));
    }
    if (!u.unit_name().empty() && u.unit_name() != core_->units[i]->name()) {
      return absl::InvalidArgumentError(
          absl::StrCat("schedule unit ", i, " is named ", u.unit_name(),
                       ", the engine's is ", core_->units[i]->name()));
    }
    for (int j : u.forward_prefetch()) {
      if (j < 0 || j >= n)
        return absl::InvalidArgumentError(absl::StrCat("bad prefetch ", j));
    }
    for (int j : u.backward_prefetch()) {
      if (j < 0 || j >= n)
        return absl::InvalidArgumentError(absl::StrCat("bad prefetch ", j));
    }
  }
  std::vector<std::vector<int>> fusion_groups;
  std::vector<bool> fused(static_cast<size_t>(n), false);
  for (int g = 0; g < schedule.fusion_groups_size(); ++g) {
    const hsdp::v1::FusionGroup& group = schedule.fusion_groups(g);
    const std::string field = absl::StrCat("schedule fusion_groups[", g, "]");
    if (group.units_size() < 2) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " has ", group.units_size(),
                       " units; a fusion group has at least two"));
    }
    for (int k = 0; k < group.units_size(); ++k) {
      const int j = group.units(k);
      if (j < 0 || j >= n) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, ": unit ", j, " is out of range (", n, " units)"));
      }
      if (k > 0 && j <= group.units(k - 1)) {
        return absl::InvalidArgumentError(
            absl::StrCat(field, ": unit ", j, " after unit ",
                         group.units(k - 1), " (indices must increase)"));
      }
      if (fused[j]) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, ": unit ", j, " is in an earlier fusion group too"));
      }
      fused[j] = true;
    }
    fusion_groups.emplace_back(group.units().begin(), group.units().end());
  }
  const int host_group = schedule.post_forward_group_size();
  if (host_group != 0) {
    const int shards = core_->shard_size();
    if (host_group < 2 || host_group >= shards || shards % host_group != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("schedule post_forward_group_size ", host_group,
                       ": must be 0 or a divisor of the shard group size (",
                       shards, ") in [2, ", shards, ")"));
    }
    const comm::Communicator* host = core_->mesh.host;
    if (host == nullptr || host->size() != host_group ||
        host->rank() != core_->shard_rank() % host_group) {
      return absl::FailedPreconditionError(absl::StrCat(
          "schedule post_forward_group_size ", host_group,
          " needs a host group of ", host_group,
          " consecutive shard ranks; this rank's is ",
          host == nullptr ? std::string("missing")
                          : absl::StrCat(host->size(), " ranks, rank ",
                                         host->rank(), " of them (shard rank ",
                                         core_->shard_rank(), ")")));
    }
  }
  const int num_mb = schedule.microbatches_size();
  if (microbatch < 0 || microbatch >= std::max(num_mb, 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "microbatch ", microbatch, " out of range (", num_mb, " in schedule)"));
  }
  if (core_->pass.callback_queued) {
    return absl::FailedPreconditionError("Apply during backward");
  }
  absl::Status s = CatchTorch(*core_, [&] {
    // A forward without backward (evaluation) still owes the collectives of
    // the units it skipped at its end.
    core_->CompleteForward();
    if (microbatch == 0) {
      // A new step: the optimizer has changed the shards since any unsharded
      // copy was made.
      for (auto& unit : core_->units) unit->Reshard();
    }
  });
  if (!s.ok()) return s;
  core_->ResetPassFlags();
  core_->SetFusionGroups(fusion_groups);
  core_->microbatch = microbatch;
  core_->post_forward_group_size = host_group;
  for (int i = 0; i < schedule.units_size(); ++i) {
    const hsdp::v1::UnitSchedule& u = schedule.units(i);
    UnitGroup& unit = *core_->units[i];
    unit.reshard_after_forward = u.reshard_after_forward();
    unit.reshard_after_backward = u.reshard_after_backward();
    unit.forward_prefetch.assign(u.forward_prefetch().begin(),
                                 u.forward_prefetch().end());
    unit.backward_prefetch.assign(u.backward_prefetch().begin(),
                                  u.backward_prefetch().end());
  }
  if (num_mb == 0) {
    core_->requires_grad_sync = core_->requires_all_reduce =
        core_->is_last_backward = true;
  } else {
    const hsdp::v1::MicrobatchSchedule& mb = schedule.microbatches(microbatch);
    core_->requires_grad_sync = mb.requires_grad_sync();
    core_->requires_all_reduce = mb.requires_all_reduce();
    core_->is_last_backward = mb.is_last_backward();
  }
  return absl::OkStatus();
}

UnitHandle& Engine::Root() { return *handles_.at(0); }
UnitHandle& Engine::Unit(int index) {
  return *handles_.at(static_cast<size_t>(index));
}
int Engine::num_units() const { return static_cast<int>(core_->units.size()); }

std::vector<UnitLayout> Engine::Units() const {
  std::vector<UnitLayout> out;
  for (const auto& unit : core_->units) {
    if (unit != nullptr) out.push_back(unit->Info());
  }
  return out;
}

EngineStats Engine::Stats() const { return core_->Stats(); }

void Engine::ResetStats() { core_->ResetStats(); }

std::vector<at::Tensor> Engine::Parameters() const {
  std::vector<at::Tensor> out;
  for (const auto& [name, t] : NamedParameters()) out.push_back(t);
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> Engine::NamedParameters()
    const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& unit : core_->units) {
    if (unit == nullptr) continue;
    for (ShardedParam* p : unit->params())
      out.emplace_back(p->fqn(), p->sharded());
  }
  return out;
}

absl::Status Engine::status() const { return core_->status; }

std::pair<std::string, std::string> Engine::ForwardPosition() const {
  const int last = core_->pass.max_entered;
  const int n = static_cast<int>(core_->units.size());
  return {last >= 0 && last < n ? core_->units[last]->name() : "",
          last + 1 < n ? core_->units[last + 1]->name() : ""};
}

absl::Status Engine::Rebind(MeshComms comms) {
  if (comms.shard == nullptr) {
    return absl::InvalidArgumentError("Rebind: MeshComms.shard is null");
  }
  const int old_size = core_->layout_shard_size;
  const int old_rank = core_->layout_shard_rank;
  if (comms.shard->size() != old_size || comms.shard->rank() != old_rank) {
    return absl::FailedPreconditionError(absl::StrCat(
        "Rebind: the new shard group is rank ", comms.shard->rank(), " of ",
        comms.shard->size(), ", the engine's shards are rank ", old_rank,
        " of ", old_size, " (only the replicate group may change)"));
  }
  core_->DiscardStep();
  core_->mesh = comms;
  return absl::OkStatus();
}

void Engine::SetTraceRecorder(TraceRecorder* recorder) {
  core_->trace = recorder;
}

at::Tensor Recompute(Engine& engine, const TensorFn& fn,
                     const at::Tensor& input) {
  return RecomputeApply(&CoreOf(engine), fn, input);
}

EngineCore& CoreOf(Engine& engine) { return *engine.core_; }
const EngineCore& CoreOf(const Engine& engine) { return *engine.core_; }

UnitLayout DescribeUnit(
    const std::string& name,
    const std::vector<std::pair<std::string, at::Tensor>>& params,
    const EngineOptions& options, int shard_size,
    const PlacementFn& placement) {
  UnitLayout info;
  info.name = name;
  info.num_params = static_cast<int64_t>(params.size());
  for (const auto& [fqn, t] : params) {
    const int64_t numel = t.numel();
    const c10::ScalarType master = t.scalar_type();
    const c10::ScalarType compute =
        options.mixed_precision.param_dtype.value_or(master);
    info.numel += numel;
    info.bytes += numel * static_cast<int64_t>(c10::elementSize(master));
    info.unsharded_bytes +=
        numel * static_cast<int64_t>(c10::elementSize(compute));
    ParamPlacement where;
    if (placement) where = placement(fqn, t).value_or(ParamPlacement());
    const int64_t master_size = static_cast<int64_t>(c10::elementSize(master));
    if (where.replicated) {
      info.sharded_bytes += numel * master_size;
      info.replicated_bytes += numel * master_size;
      info.param_names.push_back(fqn);
      continue;
    }
    const int64_t dim =
        where.shard_dim < 0 ? where.shard_dim + t.dim() : where.shard_dim;
    const int64_t rows = t.dim() == 0                ? 1
                         : dim >= 0 && dim < t.dim() ? t.size(dim)
                                                     : t.size(0);
    const int64_t row_numel = rows == 0 ? 0 : numel / rows;
    info.sharded_bytes +=
        PaddedShardRows(rows, shard_size) * row_numel * master_size;
    info.param_names.push_back(fqn);
  }
  return info;
}

hsdp::v1::UnitInfo ToProto(const UnitLayout& info) {
  hsdp::v1::UnitInfo out;
  out.set_name(info.name);
  out.set_param_count(info.numel);
  out.set_param_bytes(info.bytes);
  out.set_replicated_bytes(info.replicated_bytes);
  return out;
}

}  // namespace hsdp::fsdp
