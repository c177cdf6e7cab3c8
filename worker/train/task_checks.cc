#include "worker/train/task_checks.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/nn/module.h>

#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/policy.h"
#include "common/status_util.h"

namespace hsdp::train {

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

absl::Status CheckLossGraph(const at::Tensor& loss,
                            const torch::nn::Module& model) {
  if (!loss.defined() || loss.grad_fn() == nullptr) return absl::OkStatus();
  std::unordered_set<const c10::TensorImpl*> params;
  for (const at::Tensor& p : model.parameters(/*recurse=*/true))
    params.insert(p.unsafeGetTensorImpl());
  std::vector<torch::autograd::Node*> stack = {loss.grad_fn().get()};
  std::unordered_set<const torch::autograd::Node*> seen = {stack.front()};
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    if (const auto* acc =
            dynamic_cast<const torch::autograd::AccumulateGrad*>(node)) {
      const at::Tensor& leaf = acc->variable;
      if (!params.count(leaf.unsafeGetTensorImpl())) {
        return absl::FailedPreconditionError(absl::StrCat(
            "a tensor of shape ", c10::str(leaf.sizes()),
            " that requires grad reaches the loss but is not a parameter "
            "registered under Task::Model(): register it (register_parameter, "
            "or register_module for the module that holds it) so that it is "
            "sharded, reduced and trained like the others"));
      }
      continue;
    }
    for (const torch::autograd::Edge& edge : node->next_edges()) {
      if (edge.function != nullptr && seen.insert(edge.function.get()).second)
        stack.push_back(edge.function.get());
    }
  }
  return absl::OkStatus();
}

}  // namespace hsdp::train
