// hsdp-ckpt: looks at checkpoints of format v1 (README.md).
//   hsdp-ckpt inspect DIR          steps under DIR (a --checkpoint-dir) or one
//                                  step directory: mesh, data position, tensors
//   hsdp-ckpt verify STEP_DIR      recomputes every block's CRC-32C
//   hsdp-ckpt export STEP_DIR OUT [--safetensors] [--with-optimizer]
//                                  the full model as a torch.load-able archive
//                                  (default) or safetensors
// Exit status: 0 fine, 1 a bad checkpoint (the error names file and tensor),
// 2 usage.
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "worker/ckpt/export.h"
#include "worker/ckpt/format.h"
#include "worker/ckpt/shard_io.h"

namespace {

namespace fs = std::filesystem;
using hsdp::ckpt::Metadata;

constexpr int kExitBad = 1;
constexpr int kExitUsage = 2;

int Usage() {
  std::cerr << "usage: hsdp-ckpt inspect DIR | verify STEP_DIR | export "
               "STEP_DIR OUT [--safetensors] [--with-optimizer]\n";
  return kExitUsage;
}

int Fail(const absl::Status& s) {
  std::cerr << "hsdp-ckpt: " << s.message() << "\n";
  return kExitBad;
}

bool IsStepDir(const std::string& dir) {
  return fs::exists(fs::path(dir) / hsdp::ckpt::kMetadataFile);
}

int InspectStep(const std::string& dir) {
  absl::StatusOr<Metadata> m = hsdp::ckpt::ReadMetadata(dir);
  if (!m.ok()) return Fail(m.status());
  std::cout << absl::StrFormat(
      "%s\n  step %d, next step %d, samples consumed %d (global batch %d)\n"
      "  model %s v%s, seed %d, policy version %d\n  saved on %dx%d, "
      "optimizer %s, %d files\n",
      dir, m->step, m->next_step, m->samples_consumed, m->global_batch_samples,
      m->model_name, m->model_version, m->seed, m->policy_version, m->replicate,
      m->shard, m->optimizer, m->files.size());
  std::cout << absl::StrFormat("  %-48s %-9s %-16s %s\n", "tensor", "dtype",
                               "shape", "rows per file");
  for (const hsdp::ckpt::TensorEntry& t : m->tensors) {
    std::vector<std::string> parts;
    for (const hsdp::ckpt::Chunk& c : t.chunks) {
      parts.push_back(absl::StrCat(c.file.substr(6, 5), ":[", c.row_begin, ",",
                                   c.row_end, ")"));
    }
    std::cout << absl::StrFormat(
        "  %-48s %-9s %-16s %s\n", t.name, t.dtype,
        absl::StrCat("[", absl::StrJoin(t.shape, ","), "]"),
        absl::StrJoin(parts, " "));
  }
  return 0;
}

int Inspect(const std::string& dir) {
  if (IsStepDir(dir)) return InspectStep(dir);
  std::vector<std::pair<int64_t, std::string>> steps;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    int64_t step;
    if (hsdp::ckpt::ParseStepDirName(e.path().filename().string(), &step))
      steps.emplace_back(step, e.path().string());
  }
  if (ec)
    return Fail(absl::NotFoundError(absl::StrCat(dir, ": ", ec.message())));
  std::sort(steps.begin(), steps.end());
  std::string newest;
  for (const auto& [step, path] : steps) {
    const bool complete = IsStepDir(path);
    std::cout << absl::StrFormat(
        "step %d  %s\n", step,
        complete ? "complete" : "incomplete (no metadata.json)");
    if (complete) newest = path;
  }
  if (newest.empty()) {
    std::cout << "no complete checkpoint in " << dir << "\n";
    return 0;
  }
  std::cout << "newest complete:\n";
  return InspectStep(newest);
}

int Verify(const std::string& dir) {
  absl::StatusOr<Metadata> m = hsdp::ckpt::ReadMetadata(dir);
  if (!m.ok()) return Fail(m.status());
  absl::Status s = hsdp::ckpt::VerifyCheckpoint(dir, *m);
  if (!s.ok()) return Fail(s);
  std::cout << dir << ": OK (" << m->tensors.size() << " tensors in "
            << m->files.size() << " files)\n";
  return 0;
}

int Export(const std::string& dir, const std::string& out, bool safetensors,
           bool with_optimizer) {
  absl::StatusOr<Metadata> m = hsdp::ckpt::ReadMetadata(dir);
  if (!m.ok()) return Fail(m.status());
  absl::Status s =
      safetensors ? hsdp::ckpt::ExportSafetensors(dir, *m, out, with_optimizer)
                  : hsdp::ckpt::ExportTorch(dir, *m, out, with_optimizer);
  if (!s.ok()) return Fail(s);
  std::cout << "wrote " << out << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  bool safetensors = false, with_optimizer = false;
  std::vector<std::string> positional;
  for (const std::string& a : args) {
    if (a == "--safetensors") {
      safetensors = true;
    } else if (a == "--with-optimizer") {
      with_optimizer = true;
    } else if (a.rfind("--", 0) == 0) {
      return Usage();
    } else {
      positional.push_back(a);
    }
  }
  if (positional.size() == 2 && positional[0] == "inspect")
    return Inspect(positional[1]);
  if (positional.size() == 2 && positional[0] == "verify")
    return Verify(positional[1]);
  if (positional.size() == 3 && positional[0] == "export")
    return Export(positional[1], positional[2], safetensors, with_optimizer);
  return Usage();
}
