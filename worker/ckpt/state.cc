#include "worker/ckpt/state.h"

#include <ATen/ATen.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace hsdp::ckpt {
namespace {

constexpr char kExpAvg[] = "exp_avg";
constexpr char kExpAvgSq[] = "exp_avg_sq";
constexpr char kMaxExpAvgSq[] = "max_exp_avg_sq";
constexpr char kMomentum[] = "momentum_buffer";

std::string StateKey(const at::Tensor& p) {
  return c10::guts::to_string(p.unsafeGetTensorImpl());
}

LocalTensor Like(const LocalTensor& param, const std::string& state,
                 const at::Tensor& t) {
  return LocalTensor{OptimizerTensorName(state, param.name), t,
                     param.global_shape, param.row_offset, param.shard_dim};
}

// The named state tensors of one parameter's state (defined ones only).
std::vector<std::pair<std::string, at::Tensor*>> StateTensors(
    torch::optim::OptimizerParamState& base) {
  std::vector<std::pair<std::string, at::Tensor*>> out;
  auto add = [&](const char* name, at::Tensor& t) {
    if (t.defined()) out.emplace_back(name, &t);
  };
  if (auto* s = dynamic_cast<torch::optim::AdamWParamState*>(&base)) {
    add(kExpAvg, const_cast<at::Tensor&>(s->exp_avg()));
    add(kExpAvgSq, const_cast<at::Tensor&>(s->exp_avg_sq()));
    add(kMaxExpAvgSq, const_cast<at::Tensor&>(s->max_exp_avg_sq()));
  } else if (auto* a = dynamic_cast<torch::optim::AdamParamState*>(&base)) {
    add(kExpAvg, const_cast<at::Tensor&>(a->exp_avg()));
    add(kExpAvgSq, const_cast<at::Tensor&>(a->exp_avg_sq()));
    add(kMaxExpAvgSq, const_cast<at::Tensor&>(a->max_exp_avg_sq()));
  } else if (auto* g = dynamic_cast<torch::optim::SGDParamState*>(&base)) {
    add(kMomentum, const_cast<at::Tensor&>(g->momentum_buffer()));
  }
  return out;
}

int64_t StepOf(torch::optim::OptimizerParamState& base) {
  if (auto* s = dynamic_cast<torch::optim::AdamWParamState*>(&base))
    return s->step();
  if (auto* a = dynamic_cast<torch::optim::AdamParamState*>(&base))
    return a->step();
  return 0;
}

bool HasState(const Metadata& m, const std::string& state,
              const std::string& param) {
  const std::string name = OptimizerTensorName(state, param);
  return std::any_of(m.tensors.begin(), m.tensors.end(),
                     [&](const TensorEntry& t) { return t.name == name; });
}

// A fresh state of the optimizer's type `type` for a parameter like `like`:
// zeros (with max_exp_avg_sq when `amsgrad`) and step counter `step`.
std::unique_ptr<torch::optim::OptimizerParamState> NewState(
    const std::string& type, const at::Tensor& like, int64_t step,
    bool amsgrad) {
  // The layout the optimizers give their own state (a shard on a dim other
  // than 0 is strided): heals move these bytes as they lie.
  auto zeros = [&] { return at::zeros_like(like, at::MemoryFormat::Preserve); };
  if (type == "adamw") {
    auto s = std::make_unique<torch::optim::AdamWParamState>();
    s->step(step);
    s->exp_avg(zeros());
    s->exp_avg_sq(zeros());
    if (amsgrad) s->max_exp_avg_sq(zeros());
    return s;
  }
  if (type == "adam") {
    auto s = std::make_unique<torch::optim::AdamParamState>();
    s->step(step);
    s->exp_avg(zeros());
    s->exp_avg_sq(zeros());
    if (amsgrad) s->max_exp_avg_sq(zeros());
    return s;
  }
  auto s = std::make_unique<torch::optim::SGDParamState>();
  s->momentum_buffer(zeros());
  return s;
}

void SetStep(torch::optim::OptimizerParamState& base, int64_t step) {
  if (auto* s = dynamic_cast<torch::optim::AdamWParamState*>(&base))
    s->step(step);
  if (auto* a = dynamic_cast<torch::optim::AdamParamState*>(&base))
    a->step(step);
}

}  // namespace

std::string OptimizerType(const torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<const torch::optim::AdamW*>(&optimizer)) return "adamw";
  if (dynamic_cast<const torch::optim::Adam*>(&optimizer)) return "adam";
  if (dynamic_cast<const torch::optim::SGD*>(&optimizer)) return "sgd";
  return "none";
}

absl::StatusOr<std::vector<LocalTensor>> OptimizerShards(
    torch::optim::Optimizer& optimizer, const std::vector<LocalTensor>& params,
    std::map<std::string, int64_t>* steps) {
  std::vector<LocalTensor> out;
  auto& state = optimizer.state();
  for (const LocalTensor& p : params) {
    auto it = state.find(StateKey(p.tensor));
    if (it == state.end()) continue;
    for (const auto& [name, t] : StateTensors(*it->second)) {
      if (t->sizes() != p.tensor.sizes()) {
        return absl::InternalError(absl::StrCat(
            "optimizer state ", name, " of ", p.name, " has shape ",
            c10::str(t->sizes()), ", its shard ", c10::str(p.tensor.sizes())));
      }
      out.push_back(Like(p, name, *t));
    }
    (*steps)[p.name] = StepOf(*it->second);
  }
  return out;
}

absl::Status CheckModel(const Metadata& metadata, const std::string& step_dir,
                        const std::string& model_name,
                        const std::vector<LocalTensor>& params,
                        const torch::optim::Optimizer& optimizer) {
  const std::string path = absl::StrCat(step_dir, "/", kMetadataFile);
  if (metadata.model_name != model_name) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, " is a checkpoint of model \"", metadata.model_name,
                     "\"; this job trains \"", model_name, "\""));
  }
  std::map<std::string, const TensorEntry*> by_name;
  for (const TensorEntry& t : metadata.tensors) by_name[t.name] = &t;
  std::set<std::string> ours;
  for (const LocalTensor& p : params) {
    ours.insert(p.name);
    auto it = by_name.find(p.name);
    if (it == by_name.end()) {
      return absl::FailedPreconditionError(absl::StrCat(
          path, " has no tensor ", p.name, " (another model's checkpoint?)"));
    }
    if (it->second->shape != p.global_shape ||
        it->second->dtype != DtypeName(p.tensor.scalar_type())) {
      return absl::FailedPreconditionError(
          absl::StrCat(path, ": tensor ", p.name, " is ", it->second->dtype,
                       c10::str(c10::IntArrayRef(it->second->shape)),
                       ", this model's is ", DtypeName(p.tensor.scalar_type()),
                       c10::str(c10::IntArrayRef(p.global_shape))));
    }
  }
  bool has_optimizer_state = false;
  for (const TensorEntry& t : metadata.tensors) {
    if (absl::StartsWith(t.name, kOptimizerPrefix)) {
      has_optimizer_state = true;
    } else if (!ours.count(t.name)) {
      return absl::FailedPreconditionError(absl::StrCat(
          path, " has tensor ", t.name, ", which this model lacks"));
    }
  }
  const std::string type = OptimizerType(optimizer);
  if (has_optimizer_state && metadata.optimizer != type) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, " holds ", metadata.optimizer,
                     " state; this job's optimizer is ", type));
  }
  return absl::OkStatus();
}

absl::Status LoadShards(const std::string& step_dir, const Metadata& metadata,
                        const std::vector<LocalTensor>& params,
                        torch::optim::Optimizer& optimizer, ReadStats* stats) {
  at::NoGradGuard no_grad;
  RowReader reader(step_dir, metadata);
  for (const LocalTensor& p : params) {
    absl::Status s = reader.Read(p);
    if (!s.ok()) return s;
  }
  const std::string type = OptimizerType(optimizer);
  auto& state = optimizer.state();
  for (const LocalTensor& p : params) {
    const bool saved = HasState(metadata, kExpAvg, p.name) ||
                       HasState(metadata, kMomentum, p.name);
    if (!saved || type == "none") continue;
    auto it = state.find(StateKey(p.tensor));
    if (it == state.end()) {
      auto step = metadata.optimizer_steps.find(p.name);
      it = state
               .emplace(StateKey(p.tensor),
                        NewState(type, p.tensor,
                                 step == metadata.optimizer_steps.end()
                                     ? 0
                                     : step->second,
                                 HasState(metadata, kMaxExpAvgSq, p.name)))
               .first;
    }
    auto step = metadata.optimizer_steps.find(p.name);
    if (step != metadata.optimizer_steps.end())
      SetStep(*it->second, step->second);
    for (const auto& [name, t] : StateTensors(*it->second)) {
      absl::Status s = reader.Read(Like(p, name, *t));
      if (!s.ok()) return s;
    }
  }
  if (stats != nullptr) *stats = reader.stats();
  return absl::OkStatus();
}

std::vector<ParamState> ParamStates(torch::optim::Optimizer& optimizer,
                                    const std::vector<at::Tensor>& params) {
  std::vector<ParamState> out;
  auto& state = optimizer.state();
  for (const at::Tensor& p : params) {
    ParamState ps;
    auto it = state.find(StateKey(p));
    if (it != state.end()) {
      ps.present = true;
      ps.step = StepOf(*it->second);
      for (const auto& [name, t] : StateTensors(*it->second)) {
        if (name == std::string(kMaxExpAvgSq)) ps.amsgrad = true;
        ps.tensors.push_back(*t);
      }
    }
    out.push_back(std::move(ps));
  }
  return out;
}

void SetParamState(torch::optim::Optimizer& optimizer, const at::Tensor& param,
                   const ParamState& like) {
  auto& state = optimizer.state();
  const std::string key = StateKey(param);
  const std::string type = OptimizerType(optimizer);
  if (!like.present || type == "none") {
    state.erase(key);
    return;
  }
  state[key] = NewState(type, param, like.step, like.amsgrad);
}

}  // namespace hsdp::ckpt
