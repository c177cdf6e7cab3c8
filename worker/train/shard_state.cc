#include "worker/train/shard_state.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "worker/ckpt/crc32c.h"
#include "worker/ckpt/state.h"

namespace hsdp::train {
namespace {

// Per parameter in the layout message: has state, step counter, amsgrad.
constexpr int kLayoutFields = 3;

comm::Buffer BytesOf(const at::Tensor& t) {
  // Raw bytes: the heal copies them as they are, whatever the dtype.
  return comm::Buffer{t.data_ptr(), static_cast<int64_t>(t.nbytes()),
                      comm::DataType::kUInt8};
}

bool IsTarget(const comm::HealRoles& roles, int rank) {
  return std::find(roles.targets.begin(), roles.targets.end(), rank) !=
         roles.targets.end();
}

}  // namespace

std::vector<comm::Buffer> ShardStateBuffers(
    const std::vector<at::Tensor>& params, torch::optim::Optimizer& optimizer) {
  const std::vector<ckpt::ParamState> states =
      ckpt::ParamStates(optimizer, params);
  std::vector<comm::Buffer> out;
  for (size_t i = 0; i < params.size(); ++i) {
    out.push_back(BytesOf(params[i]));
    for (const at::Tensor& t : states[i].tensors) out.push_back(BytesOf(t));
  }
  return out;
}

uint32_t ShardStateCrc32c(const std::vector<at::Tensor>& params,
                          torch::optim::Optimizer& optimizer) {
  const std::vector<ckpt::ParamState> states =
      ckpt::ParamStates(optimizer, params);
  uint32_t crc = 0;
  auto add = [&](const at::Tensor& t) {
    const at::Tensor host = t.detach().to(at::kCPU).contiguous();
    crc = ckpt::Crc32cExtend(crc, host.data_ptr(), host.nbytes());
  };
  for (size_t i = 0; i < params.size(); ++i) {
    add(params[i]);
    const int64_t step = states[i].present ? states[i].step : -1;
    crc = ckpt::Crc32cExtend(crc, &step, sizeof(step));
    for (const at::Tensor& t : states[i].tensors) add(t);
  }
  return crc;
}

absl::Status HealShardState(comm::Communicator& group,
                            const comm::HealRoles& roles,
                            const std::vector<at::Tensor>& params,
                            torch::optim::Optimizer& optimizer) {
  // Bytes move as they lie: a shard on a dim other than 0 is a permuted but
  // dense view, whose state tensors share its strides on every rank.
  for (const at::Tensor& p : params) {
    if (!p.is_non_overlapping_and_dense()) {
      return absl::InternalError(
          absl::StrCat("heal: a parameter shard of shape ", c10::str(p.sizes()),
                       " is not dense"));
    }
  }
  const bool target = IsTarget(roles, group.rank());
  // The layout travels first (every rank knows its size: one row per
  // parameter), so a target holds the sources' tensors before their bytes
  // come.
  std::vector<int64_t> layout(params.size() * kLayoutFields, 0);
  const std::vector<ckpt::ParamState> states =
      ckpt::ParamStates(optimizer, params);
  for (size_t i = 0; i < params.size(); ++i) {
    layout[i * kLayoutFields] = states[i].present ? 1 : 0;
    layout[i * kLayoutFields + 1] = states[i].step;
    layout[i * kLayoutFields + 2] = states[i].amsgrad ? 1 : 0;
  }
  absl::Status s = comm::HealState(
      group, roles,
      {comm::Buffer{layout.data(), static_cast<int64_t>(layout.size()),
                    comm::DataType::kInt64}});
  if (!s.ok()) return s;
  if (target) {
    for (size_t i = 0; i < params.size(); ++i) {
      ckpt::ParamState like;
      like.present = layout[i * kLayoutFields] != 0;
      like.step = layout[i * kLayoutFields + 1];
      like.amsgrad = layout[i * kLayoutFields + 2] != 0;
      ckpt::SetParamState(optimizer, params[i], like);
    }
  }
  at::NoGradGuard no_grad;
  return comm::HealState(group, roles, ShardStateBuffers(params, optimizer));
}

}  // namespace hsdp::train
