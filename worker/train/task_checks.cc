#include "worker/train/task_checks.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/nn/module.h>

#include <unordered_set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/policy.h"
#include "common/status_util.h"

namespace hsdp::train {
namespace {

// Autograd nodes that only move or reshape data: naming one says little about
// where a tensor is used.
bool IsLayoutOnly(absl::string_view node_name) {
  for (absl::string_view prefix :
       {"TBackward", "TransposeBackward", "PermuteBackward", "ViewBackward",
        "ReshapeAliasBackward", "ExpandBackward", "UnsqueezeBackward",
        "SqueezeBackward", "ToCopyBackward"}) {
    if (absl::StartsWith(node_name, prefix)) return true;
  }
  return false;
}

}  // namespace

absl::Status CheckUnitGlob(absl::string_view flag, const std::string& glob,
                           const std::vector<std::string>& unit_names) {
  if (glob.empty()) return absl::OkStatus();
  for (const std::string& name : unit_names) {
    if (GlobMatch(glob, name)) return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat(flag, " '", glob, "' matches none of this task's units (",
                   unit_names.empty() ? std::string("it has none but the root")
                                      : absl::StrJoin(unit_names, ", "),
                   ")"));
}

absl::Status CheckDeterministicBatch(Task& task, const BatchRequest& request,
                                     const Batch& first) {
  HSDP_ASSIGN_OR_RETURN(Batch again, task.GetBatch(request));
  auto same = [](const at::Tensor& a, const at::Tensor& b) {
    if (a.defined() != b.defined()) return false;
    return !a.defined() ||
           (a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() &&
            a.cpu().equal(b.cpu()));
  };
  if (same(first.input, again.input) && same(first.target, again.target)) {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "Task::GetBatch gave other samples for the same request the second time "
      "(step ",
      request.step, ", samples [", request.first_sample, ", ",
      request.first_sample + request.sample_count,
      ")): batches must be a pure function of the request (seed, step, "
      "index), or every rank and the reference train on different data"));
}

std::vector<GradLeaf> GradLeaves(const at::Tensor& loss) {
  std::vector<GradLeaf> leaves;
  if (!loss.defined() || loss.grad_fn() == nullptr) return leaves;
  // Each node with the nearest node above it that computes (a Linear's
  // weight is reached through a transpose, from the matmul).
  std::vector<std::pair<torch::autograd::Node*, std::string>> stack = {
      {loss.grad_fn().get(), "the loss"}};
  std::unordered_set<const torch::autograd::Node*> seen = {
      loss.grad_fn().get()};
  while (!stack.empty()) {
    auto [node, used_by] = std::move(stack.back());
    stack.pop_back();
    if (const auto* acc =
            dynamic_cast<const torch::autograd::AccumulateGrad*>(node)) {
      leaves.push_back({acc->variable, std::move(used_by)});
      continue;
    }
    const std::string name = node->name();
    if (!IsLayoutOnly(name)) used_by = name;
    for (const torch::autograd::Edge& edge : node->next_edges()) {
      if (edge.function != nullptr && seen.insert(edge.function.get()).second)
        stack.emplace_back(edge.function.get(), used_by);
    }
  }
  return leaves;
}

absl::Status CheckRegistered(const std::vector<GradLeaf>& leaves,
                             const torch::nn::Module& model) {
  std::unordered_set<const c10::TensorImpl*> params;
  for (const at::Tensor& p : model.parameters(/*recurse=*/true))
    params.insert(p.unsafeGetTensorImpl());
  for (const GradLeaf& leaf : leaves) {
    if (params.count(leaf.tensor.unsafeGetTensorImpl())) continue;
    return absl::FailedPreconditionError(absl::StrCat(
        "a tensor of shape ", c10::str(leaf.tensor.sizes()),
        " that requires grad reaches the loss (through ", leaf.used_by,
        ") but is not a parameter registered under Task::Model(): a submodule "
        "built but not passed to register_module, or a tensor not passed to "
        "register_parameter. Register it, so that it is sharded, reduced and "
        "trained like the others"));
  }
  return absl::OkStatus();
}

absl::Status CheckLossGraph(const at::Tensor& loss,
                            const torch::nn::Module& model) {
  return CheckRegistered(GradLeaves(loss), model);
}

}  // namespace hsdp::train
