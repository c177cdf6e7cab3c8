#include "worker/ckpt/export.h"

#include <ATen/ATen.h>
#include <torch/serialize.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "worker/ckpt/shard_io.h"

namespace hsdp::ckpt {
namespace {

bool Wanted(const TensorEntry& t, bool with_optimizer) {
  return with_optimizer || !absl::StartsWith(t.name, kOptimizerPrefix);
}

std::string SafetensorsDtype(const std::string& dtype) {
  static const auto* kNames = new std::map<std::string, std::string>{
      {"float32", "F32"},   {"float64", "F64"}, {"float16", "F16"},
      {"bfloat16", "BF16"}, {"int64", "I64"},   {"int32", "I32"},
      {"int8", "I8"},       {"uint8", "U8"},    {"bool", "BOOL"}};
  return kNames->at(dtype);
}

}  // namespace

absl::StatusOr<at::Tensor> ReadFullTensor(const std::string& step_dir,
                                          const Metadata& metadata,
                                          const TensorEntry& tensor) {
  absl::StatusOr<c10::ScalarType> type = ScalarTypeOf(tensor.dtype);
  if (!type.ok()) return type.status();
  LocalTensor full{tensor.name, at::empty(tensor.shape, at::dtype(*type)),
                   tensor.shape, 0, tensor.shard_dim};
  RowReader reader(step_dir, metadata);
  absl::Status s = reader.Read(full);
  if (!s.ok()) return s;
  return full.tensor;
}

absl::Status ExportSafetensors(const std::string& step_dir,
                               const Metadata& metadata,
                               const std::string& out_path,
                               bool with_optimizer) {
  nlohmann::json header = nlohmann::json::object();
  header["__metadata__"] = {
      {"format", "pt"},
      {"hsdp_step", std::to_string(metadata.step)},
      {"hsdp_model", metadata.model_name},
      {"hsdp_mesh", absl::StrCat(metadata.replicate, "x", metadata.shard)}};
  int64_t offset = 0;
  for (const TensorEntry& t : metadata.tensors) {
    if (!Wanted(t, with_optimizer)) continue;
    int64_t bytes = DtypeSize(t.dtype);
    for (int64_t d : t.shape) bytes *= d;
    header[t.name] = {{"dtype", SafetensorsDtype(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  // The data starts 8-byte aligned (safetensors pads the header with spaces).
  while ((text.size() + 8) % 8 != 0) text.push_back(' ');
  std::ofstream out(out_path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::PermissionDeniedError("cannot write " + out_path);
  uint64_t n = text.size();
  char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  out.write(len, 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const TensorEntry& t : metadata.tensors) {
    if (!Wanted(t, with_optimizer)) continue;
    absl::StatusOr<at::Tensor> full = ReadFullTensor(step_dir, metadata, t);
    if (!full.ok()) return full.status();
    out.write(static_cast<const char*>(full->data_ptr()),
              static_cast<std::streamsize>(full->nbytes()));
  }
  out.close();
  if (!out) return absl::InternalError("writing " + out_path + " failed");
  return absl::OkStatus();
}

absl::Status ExportTorch(const std::string& step_dir, const Metadata& metadata,
                         const std::string& out_path, bool with_optimizer) {
  c10::Dict<std::string, at::Tensor> dict;
  for (const TensorEntry& t : metadata.tensors) {
    if (!Wanted(t, with_optimizer)) continue;
    absl::StatusOr<at::Tensor> full = ReadFullTensor(step_dir, metadata, t);
    if (!full.ok()) return full.status();
    dict.insert(t.name, *full);
  }
  try {
    const std::vector<char> bytes = torch::pickle_save(c10::IValue(dict));
    std::ofstream out(out_path, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.close();
    if (!out) return absl::InternalError("writing " + out_path + " failed");
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("pickling ", out_path, ": ", e.what_without_backtrace()));
  }
  return absl::OkStatus();
}

}  // namespace hsdp::ckpt
