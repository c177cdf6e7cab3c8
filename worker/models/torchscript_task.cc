#include "worker/models/torchscript_task.h"

#include <torch/csrc/jit/runtime/graph_executor.h>
#include <torch/csrc/jit/serialization/import.h>

#include <cstdint>
#include <fstream>
#include <optional>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status_util.h"
#include "worker/models/placement_rule.h"
#include "worker/models/unit_rule.h"

namespace hsdp::models {
namespace {

constexpr char kEmbed[] = "embed";
constexpr char kHeadLoss[] = "head_loss";
constexpr char kForward[] = "forward";
constexpr char kVocabSize[] = "vocab_size";
constexpr char kSeqLen[] = "seq_len";
constexpr char kConventionDoc[] = "see examples/torchscript/README.md";
// forward and the chained stages run the same ops when the units are right;
// the tolerance only admits a forward written differently (fused, reordered).
constexpr double kChainRtol = 1e-5;
constexpr double kChainAtol = 1e-6;

// The first line of an exception's message (LibTorch's carry backtraces).
std::string FirstLine(const std::string& text) {
  return std::string(text.substr(0, text.find('\n')));
}

// One line saying what went wrong: a c10::Error's message without its
// backtrace; for an error raised inside scripted code, the last line of the
// interpreter's report ("RuntimeError: mat1 and mat2 shapes ...") rather
// than its first ("The following operation failed ...").
std::string ErrorText(const std::exception& e) {
  if (const auto* c10 = dynamic_cast<const c10::Error*>(&e)) {
    return FirstLine(c10->what_without_backtrace());
  }
  const std::string text = e.what();
  if (text.find("TorchScript interpreter") != std::string::npos) {
    std::vector<absl::string_view> lines =
        absl::StrSplit(text, '\n', absl::SkipWhitespace());
    if (!lines.empty()) return std::string(lines.back());
  }
  return FirstLine(text);
}

// FNV-1a of the file's bytes, folded to a positive int: workers that loaded
// different contents report different versions and the coordinator refuses
// the odd one out.
absl::StatusOr<int> ContentVersion(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat("--model torchscript:", path, ": cannot open the file"));
  }
  uint64_t h = 1469598103934665603ULL;
  char buffer[1 << 16];
  while (in.read(buffer, sizeof(buffer)) || in.gcount() > 0) {
    for (std::streamsize i = 0; i < in.gcount(); ++i) {
      h = (h ^ static_cast<unsigned char>(buffer[i])) * 1099511628211ULL;
    }
  }
  const int v = static_cast<int>((h ^ (h >> 32)) & 0x7fffffffULL);
  return v == 0 ? 1 : v;
}

// Method `method` of `module` (named `where` in messages) exists and takes
// `tensor_args` Tensors (after self) and returns one Tensor.
absl::Status CheckMethod(const torch::jit::Module& module,
                         const std::string& where, const std::string& method,
                         int tensor_args, const std::string& want) {
  c10::optional<torch::jit::Method> m = module.find_method(method);
  if (!m.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, " has no method ", want, " (", kConventionDoc,
        "; mark it @torch.jit.export if forward does not call it)"));
  }
  const c10::FunctionSchema& schema = m->function().getSchema();
  const auto& args = schema.arguments();
  bool ok = static_cast<int>(args.size()) == tensor_args + 1 &&
            schema.returns().size() == 1 &&
            schema.returns()[0].type()->kind() == c10::TypeKind::TensorType;
  for (size_t i = 1; ok && i < args.size(); ++i) {
    ok = args[i].type()->kind() == c10::TypeKind::TensorType;
  }
  if (!ok) {
    std::ostringstream got;
    got << schema;
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": method '", method, "' has the wrong signature: ", got.str(),
        "; want ", want));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> IntAttribute(const torch::jit::Module& module,
                                     const std::string& where,
                                     const std::string& name) {
  if (!module.hasattr(name) || !module.attr(name).isInt()) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, " has no int attribute '", name, "' (", kConventionDoc, ")"));
  }
  const int64_t v = module.attr(name).toInt();
  if (v <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": attribute '", name, "' is ", v, "; want > 0"));
  }
  return v;
}

// A torch::nn::Module tree with `module`'s structure whose parameters and
// buffers are `module`'s own tensors (shared TensorImpls, not copies).
std::shared_ptr<torch::nn::Module> Mirror(const torch::jit::Module& module,
                                          const std::string& name) {
  auto mirror = std::make_shared<torch::nn::Module>(name);
  for (const auto& p : module.named_parameters(/*recurse=*/false)) {
    mirror->register_parameter(p.name, p.value, p.value.requires_grad());
  }
  for (const auto& b : module.named_buffers(/*recurse=*/false)) {
    mirror->register_buffer(b.name, b.value);
  }
  for (const auto& c : module.named_children()) {
    mirror->register_module(c.name, Mirror(c.value, c.name));
  }
  return mirror;
}

// The submodule of `root` at dotted `path`.
template <typename M, typename Child>
M Descend(M root, const std::string& path, Child child) {
  for (absl::string_view part : absl::StrSplit(path, '.')) {
    root = child(root, std::string(part));
  }
  return root;
}

// Calls a scripted method, as the task's numerics note says.
at::Tensor Call(const torch::jit::Method& method,
                std::vector<c10::IValue> args) {
  torch::jit::GraphOptimizerEnabledGuard unoptimized(false);
  return method(std::move(args)).toTensor();
}

// The worker runs embed, the units in order, then head_loss; the model's own
// forward must compute the same loss, or the rule left out a stage (or picked
// modules the model does not run one after another). Checked without grad on
// the data's first sample.
absl::Status CheckUnitsChain(const torch::jit::Module& module,
                             const std::vector<torch::jit::Module>& units,
                             const TokenDataset& data, int64_t seq_len,
                             const std::string& where,
                             const std::string& rule) {
  at::NoGradGuard no_grad;
  const TokenBatch sample = data.GlobalSlice(/*seed=*/0, /*step=*/0,
                                             /*first=*/0, /*count=*/1, seq_len);
  at::Tensor whole, chained;
  try {
    whole = Call(module.get_method(kForward), {sample.tokens, sample.targets});
    at::Tensor x = Call(module.get_method(kEmbed), {sample.tokens});
    for (const torch::jit::Module& unit : units) {
      x = Call(unit.get_method(kForward), {x});
    }
    chained = Call(module.get_method(kHeadLoss), {x, sample.targets});
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": --units '", rule,
        "': embed, the units in order and head_loss fail on one sample (",
        ErrorText(e), "); the units must be the stages forward runs in turn"));
  }
  if (whole.numel() != 1 || chained.numel() != 1 ||
      !at::allclose(whole, chained, kChainRtol, kChainAtol)) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": --units '", rule, "': embed, the units in order and ",
        "head_loss give loss ",
        chained.numel() == 1 ? chained.item<double>() : -1.0,
        " on one sample but forward gives ",
        whole.numel() == 1 ? whole.item<double>() : -1.0,
        "; the units must be the stages forward runs in turn"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<TorchScriptTask>> TorchScriptTask::Create(
    const train::TaskArgs& args) {
  if (!absl::StartsWith(args.model, kTorchScriptModelPrefix)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--model '", args.model, "' is not torchscript:PATH"));
  }
  const std::string path =
      args.model.substr(std::string(kTorchScriptModelPrefix).size());
  const std::string where = absl::StrCat("--model torchscript:", path);
  if (path.empty()) {
    return absl::InvalidArgumentError(
        "--model torchscript:PATH: the path is empty");
  }
  if (!args.dims.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--dims ", args.dims, ": a TorchScript model has its own dims"));
  }
  std::string rule = kDefaultUnitRule;
  std::string placement_rule;
  for (const auto& [key, value] : args.options) {
    if (key == kUnitsOption) {
      rule = value;
    } else if (key == kPlacementOption) {
      placement_rule = value;
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "--task-option ", key, ": a TorchScript model knows only ",
          kUnitsOption, " (--units) and ", kPlacementOption));
    }
  }
  HSDP_ASSIGN_OR_RETURN(const int version, ContentVersion(path));

  torch::jit::Module module;
  try {
    module = torch::jit::load(path, c10::Device(c10::kCPU));
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": not a TorchScript archive (", ErrorText(e), ")"));
  }
  module.train(true);

  HSDP_RETURN_IF_ERROR(CheckMethod(module, where, kEmbed, 1,
                                   "embed(self, tokens: Tensor) -> Tensor"));
  HSDP_RETURN_IF_ERROR(
      CheckMethod(module, where, kHeadLoss, 2,
                  "head_loss(self, x: Tensor, targets: Tensor) -> Tensor"));
  HSDP_ASSIGN_OR_RETURN(const int64_t vocab_size,
                        IntAttribute(module, where, kVocabSize));
  HSDP_ASSIGN_OR_RETURN(const int64_t seq_len,
                        IntAttribute(module, where, kSeqLen));
  if (args.vocab_size != 0 && args.vocab_size != vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("--vocab-size ", args.vocab_size, ": the model at ", path,
                     " has vocab_size ", vocab_size));
  }

  std::vector<std::string> names;
  for (const auto& m : module.named_modules()) {
    if (!m.name.empty()) names.push_back(m.name);
  }
  absl::StatusOr<std::vector<std::string>> units = MatchUnitRule(rule, names);
  if (!units.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": ", units.status().message()));
  }
  std::vector<torch::jit::Module> unit_modules;
  for (const std::string& name : *units) {
    torch::jit::Module unit = Descend(
        module, name, [](const torch::jit::Module& m, const std::string& c) {
          return m.attr(c).toModule();
        });
    HSDP_RETURN_IF_ERROR(
        CheckMethod(unit, absl::StrCat(where, ": unit '", name, "'"), kForward,
                    1, "forward(self, x: Tensor) -> Tensor"));
    unit_modules.push_back(unit);
  }

  HSDP_RETURN_IF_ERROR(
      CheckMethod(module, where, kForward, 2,
                  "forward(self, tokens: Tensor, targets: Tensor) -> Tensor"));

  HSDP_ASSIGN_OR_RETURN(TokenDataset data,
                        TokenDataset::Open(args.data, vocab_size, seq_len));
  HSDP_RETURN_IF_ERROR(
      CheckUnitsChain(module, unit_modules, data, seq_len, where, rule));
  std::unique_ptr<TorchScriptTask> task(
      new TorchScriptTask(module, std::move(data)));
  task->path_ = path;
  task->name_ = absl::StrCat(kTorchScriptModelPrefix,
                             module.type()->name().has_value()
                                 ? module.type()->name()->qualifiedName()
                                 : std::string("module"));
  task->version_ = version;
  task->seq_len_ = seq_len;
  task->unit_names_ = *std::move(units);
  if (!placement_rule.empty()) {
    std::vector<std::string> param_names;
    for (const auto& p : module.named_parameters(/*recurse=*/true))
      param_names.push_back(p.name);
    absl::StatusOr<std::map<std::string, fsdp::ParamPlacement>> placements =
        MatchPlacementRule(placement_rule, param_names);
    if (!placements.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": --task-option ", placements.status().message()));
    }
    task->placements_ = *std::move(placements);
  }
  task->unit_modules_ = std::move(unit_modules);
  return task;
}

std::optional<fsdp::ParamPlacement> TorchScriptTask::Placement(
    const std::string& fqn, const at::Tensor& /*param*/) const {
  auto it = placements_.find(fqn);
  if (it == placements_.end()) return std::nullopt;
  return it->second;
}

absl::Status TorchScriptTask::Build(const train::BuildContext& /*context*/) {
  mirror_ = Mirror(module_, "TorchScriptModel");
  unit_mirrors_.clear();
  for (const std::string& name : unit_names_) {
    unit_mirrors_.push_back(
        Descend(mirror_, name,
                [](const std::shared_ptr<torch::nn::Module>& m,
                   const std::string& c) { return m->named_children()[c]; }));
  }
  return absl::OkStatus();
}

absl::StatusOr<train::UnitSpec> TorchScriptTask::BuildUnit(int index) {
  if (index < 0 || index >= NumUnits() || mirror_ == nullptr) {
    return absl::OutOfRangeError(
        absl::StrCat("TorchScriptTask::BuildUnit(", index, ")"));
  }
  return train::UnitSpec{unit_names_[index], {unit_mirrors_[index]}};
}

absl::StatusOr<train::Batch> TorchScriptTask::GetBatch(
    const train::BatchRequest& request) {
  TokenBatch batch =
      data_.GlobalSlice(request.seed, request.step, request.first_sample,
                        request.sample_count, seq_len_);
  return train::Batch{std::move(batch.tokens), std::move(batch.targets)};
}

absl::StatusOr<at::Tensor> TorchScriptTask::Loss(const train::Batch& batch) {
  if (units_ == nullptr) {
    return absl::FailedPreconditionError("TorchScriptTask::Loss before Shard");
  }
  const torch::jit::Method embed = module_.get_method(kEmbed);
  const torch::jit::Method head_loss = module_.get_method(kHeadLoss);
  at::Tensor x;
  try {
    x = Call(embed, {batch.input});
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(path_, ": embed: ", ErrorText(e)));
  }
  // Not caught here: a failed collective inside Forward must reach the runner
  // as it is (see train::ShardContext).
  for (int i = 0; i < NumUnits(); ++i) {
    const torch::jit::Method forward = unit_modules_[i].get_method(kForward);
    x = units_->Forward(
        i, x, [forward](const at::Tensor& y) { return Call(forward, {y}); });
  }
  try {
    return Call(head_loss, {x, batch.target});
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(path_, ": head_loss: ", ErrorText(e)));
  }
}

}  // namespace hsdp::models
