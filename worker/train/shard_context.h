// The two ShardContexts the runner hands a Task: units entered through the
// sharding engine, or run directly (the single-process reference).
#ifndef HSDP_WORKER_TRAIN_SHARD_CONTEXT_H_
#define HSDP_WORKER_TRAIN_SHARD_CONTEXT_H_

#include <memory>
#include <vector>

#include "worker/fsdp/fully_shard.h"
#include "worker/train/task.h"

namespace hsdp::train {

// Task unit i is engine unit i + 1 (engine unit 0 is the root). Units whose
// `recompute` flag is set run under fsdp::Recompute when their input requires
// grad (without a grad-requiring input there is no backward to recompute in,
// so they run normally). Thread-compatible; does not own the engine.
class EngineShardContext : public ShardContext {
 public:
  EngineShardContext(fsdp::Engine& engine, std::vector<bool> recompute);

  int num_units() const override;
  at::Tensor Forward(int unit, const at::Tensor& input,
                     const UnitFn& fn) override;
  std::vector<at::Tensor> Forward(int unit,
                                  const std::vector<at::Tensor>& inputs,
                                  const UnitListFn& fn) override;

 private:
  fsdp::UnitHandle& Handle(int unit);

  fsdp::Engine& engine_;
  const std::vector<bool> recompute_;
};

// Runs every unit directly: no sharding, no recompute (which never changes
// the numbers). Thread-compatible.
class DirectShardContext : public ShardContext {
 public:
  explicit DirectShardContext(int num_units) : num_units_(num_units) {}

  int num_units() const override { return num_units_; }
  at::Tensor Forward(int unit, const at::Tensor& input,
                     const UnitFn& fn) override;
  std::vector<at::Tensor> Forward(int unit,
                                  const std::vector<at::Tensor>& inputs,
                                  const UnitListFn& fn) override;

 private:
  void Check(int unit) const;
  const int num_units_;
};

// Points a task's Unit<> wrappers (unit.h) at a context, task unit i at unit
// i, until Clear() or destruction: keep it no longer than the context.
// Thread-compatible.
class UnitBindings {
 public:
  UnitBindings() = default;
  ~UnitBindings() { Clear(); }
  UnitBindings(const UnitBindings&) = delete;
  UnitBindings& operator=(const UnitBindings&) = delete;

  // `bindings[i]` (null where the task gave none) for unit i.
  void Bind(std::vector<std::shared_ptr<UnitBinding>> bindings,
            ShardContext* context);
  void Clear();

 private:
  std::vector<std::shared_ptr<UnitBinding>> bindings_;
};

}  // namespace hsdp::train

#endif  // HSDP_WORKER_TRAIN_SHARD_CONTEXT_H_
