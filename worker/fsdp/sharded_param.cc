#include "worker/fsdp/sharded_param.h"

#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>
#include <torch/csrc/autograd/generated/variable_factories.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace hsdp::fsdp {
namespace {

// Frees a tensor's storage bytes but keeps the StorageImpl (and so every tensor
// and autograd saved variable sharing it) alive; see PLATFORM-NOTES.
void FreeStorageBytes(const at::Tensor& t) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  storage->set_nbytes(static_cast<size_t>(0));
}

void AllocStorageBytes(const at::Tensor& t, size_t nbytes) {
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(storage->allocator()->allocate(nbytes));
  storage->set_nbytes(nbytes);
}

int64_t TensorBytes(const at::Tensor& t) {
  return t.defined() ? static_cast<int64_t>(t.numel() * t.element_size()) : 0;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ShardedParam>> ShardedParam::Create(
    std::string fqn, at::Tensor module_param, const ShardedParamSpec& spec) {
  if (!module_param.defined()) {
    return absl::InvalidArgumentError(
        absl::StrCat("parameter ", fqn, " is undefined"));
  }
  const bool replicated = spec.placement.replicated;
  const int64_t dims = module_param.dim();
  int64_t shard_dim = 0;
  if (!replicated) {
    if (dims == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter ", fqn,
          ": a 0-dim parameter cannot be sharded; place it replicated "
          "(ParamPlacement::replicated)"));
    }
    shard_dim = spec.placement.shard_dim;
    if (shard_dim < -dims || shard_dim >= dims) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter ", fqn, ": shard dim ", shard_dim,
                       " is out of range for its ", dims, " dims (shape ",
                       c10::str(module_param.sizes()), ")"));
    }
    if (shard_dim < 0) shard_dim += dims;
  }
  if (!module_param.is_leaf()) {
    return absl::InvalidArgumentError(
        absl::StrCat("parameter ", fqn, " is not a leaf"));
  }
  if (spec.shard_size < 1 || spec.shard_rank < 0 ||
      spec.shard_rank >= spec.shard_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad shard rank/size for ", fqn));
  }
  std::unique_ptr<ShardedParam> p(new ShardedParam(std::move(fqn), spec));
  at::NoGradGuard no_grad;
  const at::Tensor full = module_param.detach();
  p->global_shape_ = full.sizes().vec();
  p->shard_dim_ = shard_dim;
  p->frame_shape_ = p->ToFrame(full).sizes().vec();
  // A replicated parameter is one shard of every row.
  const int64_t size = replicated ? 1 : spec.shard_size;
  const int64_t rank = replicated ? 0 : spec.shard_rank;
  p->layout_size_ = static_cast<int>(size);
  const int64_t rows = p->frame_shape_[0];
  p->padded_rows_ = (rows + size - 1) / size;
  p->row_numel_ = 1;
  for (size_t d = 1; d < p->frame_shape_.size(); ++d)
    p->row_numel_ *= p->frame_shape_[d];
  p->row_offset_ = std::min<int64_t>(rows, rank * p->padded_rows_);
  p->valid_rows_ =
      std::clamp<int64_t>(rows - p->row_offset_, 0, p->padded_rows_);

  std::vector<int64_t> shard_shape = p->frame_shape_;
  shard_shape[0] = p->padded_rows_;
  const at::ScalarType master_dtype = full.scalar_type();
  p->sharded_padded_ =
      at::zeros(shard_shape, at::TensorOptions()
                                 .dtype(master_dtype)
                                 .device(spec.shard_device)
                                 .pinned_memory(spec.pin_memory));
  p->sharded_padded_.narrow(0, 0, p->valid_rows_)
      .copy_(p->ToFrame(full).narrow(0, p->row_offset_, p->valid_rows_));
  // A leaf aliasing the valid rows: what the optimizer updates in place.
  p->sharded_ =
      p->FromFrame(p->sharded_padded_.narrow(0, 0, p->valid_rows_)).detach();
  // Frozen parameters stay frozen: no sharded grad, and the optimizer skips
  // them.
  p->sharded_.set_requires_grad(module_param.requires_grad());

  // One shard in the compute dtype on the compute device: the unsharded
  // parameter can simply alias the shard — no copies, no extra bytes (world 1
  // or a 2x1 mesh run as fast as plain LibTorch, and a replicated parameter
  // costs nothing more than its shard).
  p->aliases_shard_ = size == 1 && spec.param_dtype == master_dtype &&
                      spec.compute_device == spec.shard_device &&
                      !spec.pin_memory;
  if (p->aliases_shard_) {
    p->unsharded_padded_ = p->sharded_padded_;
    p->unsharded_allocated_ = true;
    p->module_param_ = module_param;
    p->module_param_.set_data(
        p->FromFrame(p->sharded_padded_.narrow(0, 0, rows)));
    return p;
  }
  std::vector<int64_t> unsharded_shape = p->frame_shape_;
  unsharded_shape[0] = p->padded_rows_ * size;
  p->unsharded_padded_ = at::empty(
      unsharded_shape,
      at::TensorOptions().dtype(spec.param_dtype).device(spec.compute_device));
  p->unsharded_allocated_ = true;
  // The module parameter keeps its identity (and requires_grad) but now shares
  // the unsharded buffer's StorageImpl; its old full-size storage is released
  // with `full`.
  p->module_param_ = module_param;
  p->module_param_.set_data(
      p->FromFrame(p->unsharded_padded_.narrow(0, 0, rows)));
  p->FreeUnsharded();
  return p;
}

at::Tensor ShardedParam::ToFrame(const at::Tensor& t) const {
  if (global_shape_.empty()) return t.reshape({1});
  return shard_dim_ == 0 ? t : t.movedim(shard_dim_, 0);
}

at::Tensor ShardedParam::FromFrame(const at::Tensor& t) const {
  if (global_shape_.empty()) return t.reshape({});
  return shard_dim_ == 0 ? t : t.movedim(0, shard_dim_);
}

at::Tensor ShardedParam::unsharded_grad_rows() const {
  const at::Tensor grad = unsharded_grad();
  return grad.defined() ? ToFrame(grad) : grad;
}

int64_t ShardedParam::unsharded_bytes() const {
  if (aliases_shard_) return 0;
  return padded_rows_ * layout_size_ * row_numel_ *
         static_cast<int64_t>(c10::elementSize(spec_.param_dtype));
}

int64_t ShardedParam::sharded_bytes() const {
  return TensorBytes(sharded_padded_);
}

void ShardedParam::AllocUnsharded() {
  if (aliases_shard_ || unsharded_allocated_) return;
  AllocStorageBytes(unsharded_padded_, static_cast<size_t>(unsharded_bytes()));
  unsharded_allocated_ = true;
}

void ShardedParam::FreeUnsharded() {
  if (aliases_shard_ || !unsharded_allocated_) return;
  FreeStorageBytes(unsharded_padded_);
  unsharded_allocated_ = false;
}

void ShardedParam::FoldIntoMainGrad(c10::ScalarType dtype) {
  const at::Tensor grad = module_param_.grad();
  if (!grad.defined()) return;
  at::NoGradGuard no_grad;
  if (main_grad_.defined()) {
    main_grad_.add_(grad);  // upcast in the add
  } else {
    main_grad_ = grad.to(dtype, /*non_blocking=*/false, /*copy=*/true);
  }
  module_param_.mutable_grad().reset();
}

void ShardedParam::ClearUnshardedGrad() {
  if (module_param_.grad().defined()) module_param_.mutable_grad().reset();
  main_grad_.reset();
}

int64_t ShardedParam::grad_bytes() const {
  return TensorBytes(sharded_.grad()) + unsharded_grad_bytes();
}

int64_t ShardedParam::unsharded_grad_bytes() const {
  return TensorBytes(module_param_.grad()) + TensorBytes(main_grad_);
}

void ShardedParam::AccumulateShardedGrad(const at::Tensor& reduced,
                                         bool may_steal) {
  at::NoGradGuard no_grad;
  at::Tensor r =
      FromFrame(reduced.to(sharded_.device(), sharded_.scalar_type()));
  at::Tensor& grad = sharded_.mutable_grad();
  if (grad.defined()) {
    grad.add_(r);
  } else if (may_steal && !r.is_view() && r.sizes() == sharded_.sizes() &&
             r.strides() == sharded_.strides()) {
    // Not a view (the row frame of a shard dim other than 0 makes one): the
    // optimizer's zero_grad detaches grads in place, which views refuse.
    grad = r;
  } else {
    // Own the bytes: `reduced` may alias a flat communication buffer.
    grad = at::empty_like(sharded_,
                          at::TensorOptions().pinned_memory(spec_.pin_memory));
    grad.copy_(r);
  }
}

}  // namespace hsdp::fsdp
