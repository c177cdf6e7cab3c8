// Per-parameter sharding state (FSDP2's FSDPParam): sharding on one dim with
// padding to ceil(rows/S) rows per rank, or replication (placement.h).
//
// Rows. The engine moves bytes in the parameter's *row frame*: the parameter
// with its shard dim moved to the front (dim 0 itself for the default
// placement, where the frame is the parameter). A row is one slice along the
// shard dim; the local shard and the unsharded buffer are contiguous in the
// frame, so a rank's rows are one contiguous piece of the unsharded buffer,
// whatever the dim. A replicated parameter is laid out as a group of one: one
// shard holding every row. A 0-dim parameter's frame is one row of one
// element.
//
// The optimizer sees `sharded()`: a plain leaf tensor holding this rank's valid
// rows in the parameter's own orientation (it aliases the first rows of a
// zero-padded local buffer, so the padding is never visible and stays zero; on
// a shard dim other than 0 it is a strided view). The module's parameter keeps
// its identity and becomes, via set_data, a view of an unsharded padded buffer
// whose *storage bytes* are freed on reshard and reallocated on unshard: the
// tensor objects autograd saved stay valid and see the refilled bytes.
//
// Thread-compatible: owned and driven by one UnitGroup on the training thread.
#ifndef HSDP_WORKER_FSDP_SHARDED_PARAM_H_
#define HSDP_WORKER_FSDP_SHARDED_PARAM_H_

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "hsdp/placement.h"

namespace hsdp::fsdp {

struct ShardedParamSpec {
  int shard_rank = 0;
  int shard_size = 1;
  // The shard dim (already checked against the parameter, may be negative)
  // and replication.
  ParamPlacement placement;
  // Where the unsharded tensor lives.
  c10::Device compute_device = c10::kCPU;
  // Where the shard and its grad live (the CPU with offload).
  c10::Device shard_device = c10::kCPU;
  // Pinned shard (offload with CUDA).
  bool pin_memory = false;
  // Dtype of the unsharded tensor.
  c10::ScalarType param_dtype = c10::kFloat;
};

class ShardedParam {
 public:
  // Takes over `module_param` (a leaf parameter of a module): copies out this
  // rank's rows and points the parameter at a freed unsharded buffer.
  static absl::StatusOr<std::unique_ptr<ShardedParam>> Create(
      std::string fqn, at::Tensor module_param, const ShardedParamSpec& spec);
  ShardedParam(const ShardedParam&) = delete;
  ShardedParam& operator=(const ShardedParam&) = delete;

  const std::string& fqn() const { return fqn_; }
  // The parameter's own shape.
  const std::vector<int64_t>& global_shape() const { return global_shape_; }
  // The row frame's shape: global_shape() with the shard dim first ({1} for a
  // 0-dim parameter).
  const std::vector<int64_t>& frame_shape() const { return frame_shape_; }
  // The shard dim, normalised (0 for a 0-dim or replicated parameter).
  int64_t shard_dim() const { return shard_dim_; }
  bool replicated() const { return spec_.placement.replicated; }
  // Ranks the rows are split over: the shard group, or 1 when replicated.
  int layout_size() const { return layout_size_; }
  int64_t rows() const { return frame_shape_[0]; }
  int64_t padded_rows_per_rank() const { return padded_rows_; }
  int64_t row_numel() const { return row_numel_; }
  int64_t shard_numel() const {
    return padded_rows_ * row_numel_;
  }  // padded, per rank
  int64_t valid_rows() const { return valid_rows_; }
  int64_t row_offset() const { return row_offset_; }
  int64_t numel() const { return rows() * row_numel_; }
  const ShardedParamSpec& spec() const { return spec_; }

  // A tensor in the parameter's orientation (its shape, or a shard of it along
  // the shard dim) as a view in the row frame, and back.
  at::Tensor ToFrame(const at::Tensor& t) const;
  at::Tensor FromFrame(const at::Tensor& t) const;

  // The optimizer's leaf (valid rows, fp32 master copy). Its grad is the
  // sharded grad.
  at::Tensor& sharded() { return sharded_; }
  const at::Tensor& sharded() const { return sharded_; }
  // The zero-padded local shard sharded() aliases.
  const at::Tensor& sharded_padded() const { return sharded_padded_; }
  // The module's parameter (unsharded view; storage may be freed).
  const at::Tensor& module_param() const { return module_param_; }
  // [S * padded_rows, ...] in param_dtype on the compute device; storage may be
  // freed.
  const at::Tensor& unsharded_padded() const { return unsharded_padded_; }

  bool unsharded_allocated() const { return unsharded_allocated_; }
  // The unsharded tensor is a view of the shard (one shard, same dtype and
  // device): unsharding and resharding are free, and cost no bytes.
  bool aliases_shard() const { return aliases_shard_; }
  int64_t unsharded_bytes() const;  // bytes when allocated (0 when aliasing)
  int64_t sharded_bytes() const;    // padded shard bytes
  void AllocUnsharded();            // no-op when allocated
  void FreeUnsharded();             // no-op when freed

  // The unsharded gradient of this step so far (may be undefined): what
  // autograd accumulated on the module parameter, or, once
  // FoldIntoMainGrad() ran, the main gradient (which then holds it all).
  at::Tensor unsharded_grad() const {
    return main_grad_.defined() ? main_grad_ : module_param_.grad();
  }
  // The same in the row frame (undefined when there is none).
  at::Tensor unsharded_grad_rows() const;
  // Moves the module parameter's gradient into the main gradient, in `dtype`
  // (fp32 for bf16 parameters: precision holds across many microbatches),
  // adding to what it holds; the module parameter is left without a grad.
  void FoldIntoMainGrad(c10::ScalarType dtype);
  // Drops the module parameter's gradient and the main gradient.
  void ClearUnshardedGrad();
  // Sharded + unsharded (module and main) grad bytes currently held.
  int64_t grad_bytes() const;
  // The unsharded part of grad_bytes(): module and main gradient.
  int64_t unsharded_grad_bytes() const;
  // Adds `reduced` (this rank's valid rows in the row frame, any dtype/device)
  // into sharded().grad(). With `may_steal` (the caller hands over a tensor
  // nothing else uses) it becomes the grad when there is none yet, instead of
  // being copied.
  void AccumulateShardedGrad(const at::Tensor& reduced, bool may_steal = false);

 private:
  ShardedParam(std::string fqn, const ShardedParamSpec& spec)
      : fqn_(std::move(fqn)), spec_(spec) {}

  std::string fqn_;
  ShardedParamSpec spec_;
  std::vector<int64_t> global_shape_;
  std::vector<int64_t> frame_shape_;
  int64_t shard_dim_ = 0;
  int layout_size_ = 1;
  int64_t padded_rows_ = 0;
  int64_t row_numel_ = 1;
  int64_t valid_rows_ = 0;
  int64_t row_offset_ = 0;
  at::Tensor sharded_padded_;
  at::Tensor sharded_;
  at::Tensor module_param_;
  at::Tensor unsharded_padded_;
  // Unsharded, like module_param_.grad(); undefined unless folded into.
  at::Tensor main_grad_;
  bool unsharded_allocated_ = false;
  bool aliases_shard_ = false;
};

}  // namespace hsdp::fsdp

#endif  // HSDP_WORKER_FSDP_SHARDED_PARAM_H_
