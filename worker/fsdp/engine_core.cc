#include "worker/fsdp/engine_core.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>

#include "common/memory_model.h"
#include "worker/fsdp/hooks.h"
#include "worker/fsdp/memory_meter.h"
#include "worker/fsdp/unit_group.h"

namespace hsdp::fsdp {

EngineCore::EngineCore(std::shared_ptr<torch::nn::Module> root_module,
                       MeshComms mesh_comms, EngineOptions engine_options)
    : root(std::move(root_module)),
      mesh(mesh_comms),
      layout_shard_rank(mesh_comms.shard->rank()),
      layout_shard_size(mesh_comms.shard->size()),
      options(engine_options) {}

EngineCore::~EngineCore() = default;

void EngineCore::Fail(const absl::Status& error) {
  if (status.ok()) status = error;
  TORCH_CHECK(false, "hsdp engine: ", status.ToString());
  __builtin_unreachable();
}

void EngineCore::CheckOk() const {
  TORCH_CHECK(status.ok(), "hsdp engine: ", status.ToString());
}

void MemoryAccount::AddUnsharded(int64_t delta) {
  unsharded_bytes_alive += delta;
  peak_unsharded_bytes = std::max(peak_unsharded_bytes, unsharded_bytes_alive);
}

int64_t EngineCore::UnshardedGradBytes() const {
  int64_t bytes = 0;
  for (const auto& unit : units) {
    if (unit == nullptr) continue;
    for (const ShardedParam* p : unit->params()) {
      bytes += p->unsharded_grad_bytes();
    }
  }
  return bytes + memory.in_flight_grad_bytes;
}

int64_t EngineCore::SampleUnshardedGradBytes() {
  const int64_t bytes = UnshardedGradBytes();
  memory.peak_unsharded_grad_bytes =
      std::max(memory.peak_unsharded_grad_bytes, bytes);
  return bytes;
}

void EngineCore::SampleTransientBytes() {
  const int64_t grads = SampleUnshardedGradBytes();
  const int64_t total = memory.unsharded_bytes_alive + grads + buffers.bytes();
  if (total <= memory.peak_transient_bytes) return;
  memory.peak_transient_bytes = total;
  memory.peak_transient_param_bytes = memory.unsharded_bytes_alive;
  memory.peak_transient_grad_bytes = grads;
  memory.peak_transient_comm_bytes = buffers.bytes();
}

int64_t EngineCore::OwnedTransientBytes() const {
  return memory.unsharded_bytes_alive + UnshardedGradBytes() + buffers.bytes();
}

void EngineCore::BeginForwardMeasure() {
  memory.forward_start_meter = MeterCurrentBytes(options.device);
  if (memory.forward_start_meter)
    memory.forward_start_owned = OwnedTransientBytes();
}

void EngineCore::EndForwardMeasure() {
  if (!memory.forward_start_meter) return;
  const std::optional<int64_t> now = MeterCurrentBytes(options.device);
  if (!now) return;
  const int64_t grown = (*now - *memory.forward_start_meter) -
                        (OwnedTransientBytes() - memory.forward_start_owned);
  memory.activation_bytes = std::max(memory.activation_bytes, grown);
  memory.forward_start_meter.reset();
}

EngineStats EngineCore::Stats() const {
  EngineStats s;
  int64_t sharded_grads = 0;
  for (const auto& unit : units) {
    if (unit == nullptr) continue;
    UnitStats u = unit->Stats();
    s.sharded_bytes += u.sharded_bytes;
    s.unsharded_bytes_alive += u.unsharded_bytes_alive;
    s.grad_bytes += u.grad_bytes;
    s.all_gather_seconds += u.all_gather_seconds;
    s.reduce_scatter_seconds += u.reduce_scatter_seconds;
    s.all_reduce_seconds += u.all_reduce_seconds;
    s.all_gathers += u.all_gathers;
    s.reduce_scatters += u.reduce_scatters;
    s.all_reduces += u.all_reduces;
    s.host_all_gathers += u.host_all_gathers;
    s.units.push_back(u);
    for (const ShardedParam* p : unit->params()) {
      const at::Tensor g = p->sharded().grad();
      if (g.defined()) sharded_grads += static_cast<int64_t>(g.nbytes());
    }
  }
  s.peak_unsharded_bytes = memory.peak_unsharded_bytes;
  s.peak_unsharded_grad_bytes = memory.peak_unsharded_grad_bytes;
  s.comm_buffer_bytes = buffers.bytes();
  s.peak_comm_buffer_bytes = buffers.peak_bytes();
  s.peak_transient_bytes = memory.peak_transient_bytes;
  s.peak_transient_param_bytes = memory.peak_transient_param_bytes;
  s.peak_transient_grad_bytes = memory.peak_transient_grad_bytes;
  s.peak_transient_comm_bytes = memory.peak_transient_comm_bytes;
  s.activation_bytes = memory.activation_bytes;
  s.measured_peak_bytes = MeterPeakBytes(options.device).value_or(-1);
  MemoryBreakdown& m = s.peak_memory;
  m.shards = s.sharded_bytes;
  m.optimizer_state = s.sharded_bytes * kAdamWStateCopies;
  m.sharded_grads = sharded_grads;
  m.unsharded_params = memory.peak_transient_param_bytes;
  m.unsharded_grads = memory.peak_transient_grad_bytes;
  m.comm_buffers = memory.peak_transient_comm_bytes;
  m.activations = memory.activation_bytes;
  return s;
}

void EngineCore::ResetStats() {
  for (auto& unit : units) {
    if (unit != nullptr) unit->ResetStats();
  }
  memory.peak_unsharded_bytes = memory.unsharded_bytes_alive;
  memory.peak_unsharded_grad_bytes = 0;
  buffers.ResetPeak();
  memory.peak_transient_bytes = 0;
  memory.activation_bytes = 0;
  ResetMeterPeak(options.device);
}

void EngineCore::FinishPendingReductions() {
  std::vector<UnitGroup*> pending;
  pending.swap(pending_reductions);
  for (UnitGroup* unit : pending) unit->FinishReduction();
}

void EngineCore::QueueEndOfBackwardOnce() {
  if (pass.callback_queued) return;
  pass.callback_queued = true;
  QueueEndOfBackwardCallback(this);
}

void EngineCore::EndOfBackward() {
  // Reverse forward order is the order the hooks would have fired in. A unit
  // this backward never reached on this rank runs its pre-backward too, as
  // on the ranks where it was reached.
  for (auto it = units.rbegin(); it != units.rend(); ++it) {
    UnitGroup& unit = **it;
    if (!unit.forwarded || unit.post_backward_done) continue;
    if (!unit.pre_backward_done && unit.backward_calls == 0) unit.PreBackward();
    unit.FinishBackward();
  }
  FinishPendingReductions();
  if (is_last_backward) {
    for (auto& unit : units) unit->ResolveUnusedGrads();
  }
  // A gather still in flight (prefetched for a unit backward never reached)
  // reads the shards the optimizer is about to update: complete it.
  for (auto& unit : units) {
    if (unit->is_gathering()) unit->WaitForUnshard();
  }
  ResetPassFlags();
}

void EngineCore::BeforeFirstEntry(int index) {
  while (pass.max_entered + 1 < index)
    units[pass.max_entered + 1]->SkipForward();
  pass.max_entered = index;
}

void EngineCore::CompleteForward() {
  if (pass.forward_completed || pass.max_entered < 0) return;
  pass.forward_completed = true;
  while (pass.max_entered + 1 < static_cast<int>(units.size()))
    units[pass.max_entered + 1]->SkipForward();
}

void EngineCore::FinishUnreachedAfter(int exit) {
  std::vector<UnitGroup*> unreached;
  for (auto& unit : units) {
    if (unit->forwarded && unit->last_exit > exit && !unit->pre_backward_done &&
        !unit->post_backward_done && unit->backward_calls == 0)
      unreached.push_back(unit.get());
  }
  std::sort(unreached.begin(), unreached.end(),
            [](const UnitGroup* a, const UnitGroup* b) {
              return a->last_exit > b->last_exit;
            });
  for (UnitGroup* unit : unreached) {
    unit->PreBackward();
    unit->FinishBackward();
  }
}

void EngineCore::ResetPassFlags() {
  pass = PassState();
  for (auto& unit : units) {
    unit->forwarded = false;
    unit->pre_backward_done = false;
    unit->post_backward_done = false;
    unit->forward_calls = 0;
    unit->backward_calls = 0;
    unit->last_exit = -1;
    unit->skipped = false;
  }
}

void EngineCore::SetFusionGroups(const std::vector<std::vector<int>>& groups) {
  if (finalized && groups == fusion_groups) return;
  fusion_groups = groups;
  for (auto& unit : units) unit->set_fusion_peers({}, {});
  int64_t largest_flat = 0;
  for (const auto& unit : units)
    largest_flat = std::max(largest_flat, unit->FlatBufferBytes());
  const bool fused_reduce_scatter =
      mesh.shard->SupportsSegments() || shard_size() <= 2;
  for (const std::vector<int>& group : groups) {
    if (shard_size() == 1) break;
    std::vector<std::vector<UnitGroup*>> runs;
    for (int index : group) {
      UnitGroup* unit = units[static_cast<size_t>(index)].get();
      if (!unit->has_sharded_params()) continue;
      if (runs.empty() ||
          runs.back().front()->compute_dtype() != unit->compute_dtype() ||
          runs.back().front()->reduce_dtype() != unit->reduce_dtype()) {
        runs.emplace_back();
      }
      runs.back().push_back(unit);
    }
    for (const std::vector<UnitGroup*>& run : runs) {
      if (run.size() < 2) continue;
      int64_t flat = 0;
      for (UnitGroup* unit : run) {
        unit->set_fusion_peers(
            run, fused_reduce_scatter ? run : std::vector<UnitGroup*>());
        flat += unit->FlatBufferBytes();
      }
      largest_flat = std::max(largest_flat, flat);
    }
  }
  buffers.set_limit(largest_flat);
}

void EngineCore::DiscardStep() {
  for (auto& unit : units) {
    if (unit != nullptr) unit->DiscardStep();
  }
  pending_reductions.clear();
  pass = PassState();
  recompute_depth = 0;
  recompute_fns.clear();
  memory.forward_start_meter.reset();
  memory.in_flight_grad_bytes = 0;
  status = absl::OkStatus();
}

}  // namespace hsdp::fsdp
