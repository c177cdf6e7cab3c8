// Helpers that need every shard: global-norm gradient clipping and full /
// sharded state dicts.
#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cmath>
#include <set>

#include "absl/strings/str_cat.h"
#include "hsdp/fully_shard.h"
#include "worker/fsdp/collectives.h"
#include "worker/fsdp/unit_group.h"

namespace hsdp::fsdp {
namespace {

constexpr double kClipEpsilon = 1e-6;  // as torch::nn::utils::clip_grad_norm_

std::vector<ShardedParam*> AllShardedParams(const EngineCore& core) {
  std::vector<ShardedParam*> out;
  for (const auto& unit : core.units) {
    if (unit == nullptr) continue;
    for (ShardedParam* p : unit->params()) out.push_back(p);
  }
  return out;
}

absl::Status RunCollective(
    comm::Communicator* comm, const at::Tensor& t,
    const std::function<std::unique_ptr<comm::Work>(const comm::Buffer&)>&
        issue) {
  if (comm == nullptr || comm->size() == 1) return absl::OkStatus();
  absl::StatusOr<comm::Buffer> buffer = ToBuffer(t);
  if (!buffer.ok()) return buffer.status();
  return issue(*buffer)->Wait();
}

// Parameters of root that no unit manages (ignored ones), by name.
std::vector<std::pair<std::string, at::Tensor>> UnmanagedParams(
    const EngineCore& core) {
  std::set<const c10::TensorImpl*> managed;
  for (ShardedParam* p : AllShardedParams(core)) {
    managed.insert(p->module_param().unsafeGetTensorImpl());
  }
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : core.root->named_parameters(/*recurse=*/true)) {
    if (!managed.count(item.value().unsafeGetTensorImpl())) {
      out.emplace_back(item.key(), item.value());
    }
  }
  return out;
}

template <typename Fn>
absl::Status Guard(Fn&& fn) {
  try {
    return fn();
  } catch (const c10::Error& e) {
    return absl::InternalError(e.what_without_backtrace());
  }
}

}  // namespace

absl::StatusOr<double> ClipGradNormGlobal(Engine& engine, double max_norm) {
  EngineCore& core = CoreOf(engine);
  double norm = 0;
  absl::Status s = Guard([&]() -> absl::Status {
    at::NoGradGuard no_grad;
    at::Tensor sum_sq = at::zeros({1}, at::TensorOptions().dtype(at::kDouble));
    for (ShardedParam* p : AllShardedParams(core)) {
      const at::Tensor& g = p->sharded().grad();
      // A replicated parameter's whole gradient is on every rank of the shard
      // group: counted once, by its first rank.
      if (p->replicated() && core.shard_rank() != 0) continue;
      if (g.defined()) sum_sq += g.to(at::kCPU, at::kDouble).pow(2).sum();
    }
    // Replicas hold identical sharded grads after the all-reduce: the shard
    // group suffices.
    absl::Status r =
        RunCollective(core.mesh.shard, sum_sq, [&](const comm::Buffer& b) {
          return core.mesh.shard->AllReduce(b, comm::ReduceOp::kSum);
        });
    if (!r.ok()) return r;
    norm = std::sqrt(sum_sq.item<double>());
    const double coef = max_norm / (norm + kClipEpsilon);
    if (coef < 1.0) {
      for (ShardedParam* p : AllShardedParams(core)) {
        if (p->sharded().grad().defined())
          p->sharded().mutable_grad().mul_(coef);
      }
    }
    return absl::OkStatus();
  });
  if (!s.ok()) return s;
  return norm;
}

absl::StatusOr<std::map<std::string, at::Tensor>> FullStateDict(
    Engine& engine) {
  EngineCore& core = CoreOf(engine);
  std::map<std::string, at::Tensor> out;
  const bool keep = core.global_rank() == 0;
  absl::Status s = Guard([&]() -> absl::Status {
    at::NoGradGuard no_grad;
    for (ShardedParam* p : AllShardedParams(core)) {
      // A replicated parameter is whole here already.
      const int size = p->layout_size();
      const at::Tensor shard = p->sharded_padded().to(at::kCPU).contiguous();
      at::Tensor gathered =
          size == 1 ? shard
                    : at::empty({shard.numel() * size}, shard.options());
      if (size > 1) {
        absl::StatusOr<comm::Buffer> in = ToBuffer(shard);
        absl::StatusOr<comm::Buffer> all = ToBuffer(gathered);
        if (!in.ok()) return in.status();
        if (!all.ok()) return all.status();
        absl::Status r = core.mesh.shard->AllGather(*in, *all)->Wait();
        if (!r.ok()) return r;
      }
      if (keep) {
        std::vector<int64_t> shape = p->frame_shape();
        shape[0] = p->padded_rows_per_rank() * size;
        // A copy: with one rank (or a replicated parameter) `gathered` is
        // the shard itself.
        out[p->fqn()] =
            p->FromFrame(gathered.view(shape).narrow(0, 0, p->rows()))
                .clone(at::MemoryFormat::Contiguous);
      }
    }
    if (keep) {
      for (const auto& [name, t] : UnmanagedParams(core))
        out[name] = t.detach().to(at::kCPU).clone();
    }
    return absl::OkStatus();
  });
  if (!s.ok()) return s;
  return out;
}

absl::Status LoadFullStateDict(Engine& engine,
                               const std::map<std::string, at::Tensor>& state) {
  EngineCore& core = CoreOf(engine);
  const bool source = core.global_rank() == 0;
  return Guard([&]() -> absl::Status {
    at::NoGradGuard no_grad;
    std::vector<std::pair<std::string, at::Tensor>>
        targets;  // name → tensor to fill
    for (ShardedParam* p : AllShardedParams(core)) {
      targets.emplace_back(p->fqn(), at::empty(p->global_shape(), at::kFloat));
    }
    for (const auto& [name, t] : UnmanagedParams(core)) {
      targets.emplace_back(name, at::empty(t.sizes(), at::kFloat));
    }
    // Rank 0 validates and tells everyone, so a bad dict fails on all ranks
    // instead of hanging.
    std::string error;
    if (source) {
      for (auto& [name, t] : targets) {
        auto it = state.find(name);
        if (it == state.end()) {
          error = absl::StrCat("state dict has no ", name);
        } else if (it->second.sizes() != t.sizes()) {
          error = absl::StrCat("state dict ", name, " has shape ",
                               c10::str(it->second.sizes()),
                               ", the model's is ", c10::str(t.sizes()));
        }
        if (!error.empty()) break;
      }
    }
    at::Tensor ok = at::full({1}, error.empty() ? 1 : 0, at::kInt);
    auto broadcast = [&](const at::Tensor& t) -> absl::Status {
      // Replicate group first: afterwards every shard-index-0 rank holds rank
      // 0's data.
      absl::Status r =
          RunCollective(core.mesh.replicate, t, [&](const comm::Buffer& b) {
            return core.mesh.replicate->Broadcast(b, 0);
          });
      if (!r.ok()) return r;
      return RunCollective(core.mesh.shard, t, [&](const comm::Buffer& b) {
        return core.mesh.shard->Broadcast(b, 0);
      });
    };
    absl::Status r = broadcast(ok);
    if (!r.ok()) return r;
    if (ok.item<int>() == 0) {
      return absl::InvalidArgumentError(
          source ? error : std::string("rank 0 rejected the full state dict"));
    }
    std::map<std::string, ShardedParam*> by_name;
    for (ShardedParam* p : AllShardedParams(core)) by_name[p->fqn()] = p;
    for (auto& [name, t] : targets) {
      if (source) t.copy_(state.at(name));
      r = broadcast(t);
      if (!r.ok()) return r;
      auto it = by_name.find(name);
      if (it != by_name.end()) {
        ShardedParam* p = it->second;
        p->sharded().copy_(p->FromFrame(
            p->ToFrame(t).narrow(0, p->row_offset(), p->valid_rows())));
      } else {
        for (const auto& [n2, param] : UnmanagedParams(core)) {
          if (n2 == name) param.detach().copy_(t);
        }
      }
    }
    return absl::OkStatus();
  });
}

std::vector<std::pair<std::string, ShardedTensor>> ShardLayouts(
    const Engine& engine) {
  const EngineCore& core = CoreOf(engine);
  std::vector<std::pair<std::string, ShardedTensor>> out;
  for (ShardedParam* p : AllShardedParams(core)) {
    ShardedTensor st;
    st.local = p->sharded();
    st.global_shape = p->global_shape();
    st.row_offset = p->row_offset();
    st.shard_dim = p->shard_dim();
    st.replicated = p->replicated();
    st.shard_rank = core.shard_rank();
    st.shard_size = core.shard_size();
    out.emplace_back(p->fqn(), std::move(st));
  }
  return out;
}

std::map<std::string, ShardedTensor> ShardedStateDict(const Engine& engine) {
  std::map<std::string, ShardedTensor> out;
  at::NoGradGuard no_grad;
  for (auto& [name, st] : ShardLayouts(engine)) {
    st.local = st.local.detach().clone();
    out[name] = std::move(st);
  }
  return out;
}

absl::Status LoadShardedStateDict(
    Engine& engine, const std::map<std::string, ShardedTensor>& state) {
  EngineCore& core = CoreOf(engine);
  const std::vector<ShardedParam*> params = AllShardedParams(core);
  for (ShardedParam* p :
       params) {  // validate everything before touching anything
    auto it = state.find(p->fqn());
    if (it == state.end())
      return absl::NotFoundError(absl::StrCat("no shard for ", p->fqn()));
    const ShardedTensor& st = it->second;
    if (st.global_shape != p->global_shape() ||
        st.shard_size != core.shard_size() ||
        st.shard_rank != core.shard_rank() ||
        st.row_offset != p->row_offset() || st.shard_dim != p->shard_dim() ||
        st.replicated != p->replicated() ||
        st.local.sizes() != p->sharded().sizes()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shard layout of ", p->fqn(), " does not match this rank's"));
    }
  }
  return Guard([&]() -> absl::Status {
    at::NoGradGuard no_grad;
    for (ShardedParam* p : params) p->sharded().copy_(state.at(p->fqn()).local);
    return absl::OkStatus();
  });
}

}  // namespace hsdp::fsdp
