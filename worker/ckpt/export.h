// Whole tensors out of a v1 checkpoint: read one full tensor, and write the
// model as safetensors or as a LibTorch pickle archive that Python's
// torch.load reads (a dict of name -> tensor).
//
// Thread-compatible: pure functions over files.
#ifndef HSDP_WORKER_CKPT_EXPORT_H_
#define HSDP_WORKER_CKPT_EXPORT_H_

#include <ATen/core/Tensor.h>

#include <string>

#include "absl/status/statusor.h"
#include "worker/ckpt/format.h"

namespace hsdp::ckpt {

absl::StatusOr<at::Tensor> ReadFullTensor(const std::string& step_dir,
                                          const Metadata& metadata,
                                          const TensorEntry& tensor);

// Parameters only, unless `with_optimizer` (then also optimizer/... tensors).
// Safetensors: 8-byte little-endian header length, JSON header (dtype, shape,
// data_offsets per tensor; __metadata__ with the step, model and mesh), raw
// little-endian bytes. Writes one tensor at a time.
absl::Status ExportSafetensors(const std::string& step_dir,
                               const Metadata& metadata,
                               const std::string& out_path,
                               bool with_optimizer);
absl::Status ExportTorch(const std::string& step_dir, const Metadata& metadata,
                         const std::string& out_path, bool with_optimizer);

}  // namespace hsdp::ckpt

#endif  // HSDP_WORKER_CKPT_EXPORT_H_
