// How a task's Loss() enters its units: the two ShardContexts the runner hands
// a Task (units entered through the sharding engine, or run directly in the
// single-process reference) and the binding of its Unit<> wrappers to one.
#ifndef HSDP_WORKER_TRAIN_UNIT_ENTRY_H_
#define HSDP_WORKER_TRAIN_UNIT_ENTRY_H_

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "hsdp/fully_shard.h"
#include "hsdp/task.h"
#include "worker/train/task_checks.h"

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
                                  const UnitTensorsFn& fn) override;

 private:
  fsdp::UnitHandle& Handle(int unit);

  fsdp::Engine& engine_;
  const std::vector<bool> recompute_;
};

// Runs every unit directly: no sharding, no recompute (which never changes
// the numbers). It checks what a sharded run would refuse, so that the
// reference refuses it alike: a unit entered for the first time in a forward
// after a later unit (Forward throws c10::Error, misuse() says why), and a
// unit's parameters used although the forward never entered it
// (CheckEntered). Thread-compatible.
class DirectShardContext : public ShardContext {
 public:
  // Units named "unit 0", "unit 1", ..., owning no parameters.
  explicit DirectShardContext(int num_units);
  // `units` as BuildUnit gave them: their names, and their modules'
  // parameters.
  explicit DirectShardContext(const std::vector<UnitSpec>& units);

  int num_units() const override { return static_cast<int>(names_.size()); }
  at::Tensor Forward(int unit, const at::Tensor& input,
                     const UnitFn& fn) override;
  std::vector<at::Tensor> Forward(int unit,
                                  const std::vector<at::Tensor>& inputs,
                                  const UnitTensorsFn& fn) override;

  // A new forward (one Loss() call) begins: no unit entered yet.
  void BeginForward();
  // FAILED_PRECONDITION once a Forward call threw for entering units out of
  // order; OK otherwise.
  const absl::Status& misuse() const { return misuse_; }
  // FAILED_PRECONDITION naming the first unit that owns one of `leaves` (what
  // autograd reaches from this forward's loss, task_checks.h) although this
  // forward never entered it: its module was called directly.
  absl::Status CheckEntered(const std::vector<GradLeaf>& leaves) const;

 private:
  void Enter(int unit);

  std::vector<std::string> names_;
  // Each parameter's unit.
  std::unordered_map<const c10::TensorImpl*, int> owner_;
  // This forward: the units entered, and the highest of them (-1: none).
  std::vector<bool> entered_;
  int last_entered_ = -1;
  absl::Status misuse_;
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

#endif  // HSDP_WORKER_TRAIN_UNIT_ENTRY_H_
