// Byte-level text data for the built-in models.
//
// Every step has a deterministic *global batch*: `global_batch` sequences of
// seq_len + 1 bytes whose start offsets are a pure function of (seed, step,
// sequence index). A rank reads only its own slice, so the single-process
// reference can rebuild the exact same global batch from the same numbers.
//
// Global ordering of sequences within a step (world W, microbatches M,
// microbatch size B):
//   global index g = (rank * M + microbatch) * B + i,  i in [0, B)
// i.e. each rank owns a contiguous block of M * B sequences, split into its
// microbatches in order.
//
// Thread-safety: TextDataset is immutable after construction and safe to share
// across threads.
#ifndef HSDP_WORKER_MODELS_DATA_H_
#define HSDP_WORKER_MODELS_DATA_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace hsdp::models {

// Inputs and next-token targets, int64 [batch, seq_len], on CPU.
struct TokenBatch {
  at::Tensor tokens;
  at::Tensor targets;
};

// The small public-domain text shipped with the repo (Aesop's fables,
// worker/models/data/), compiled into the binary so the demo runs offline from
// any directory.
absl::string_view BuiltinCorpus();

class TextDataset {
 public:
  // The built-in corpus.
  static TextDataset Builtin();
  // All bytes of `path`; NOT_FOUND / INVALID_ARGUMENT (too short) with the path
  // in the message.
  static absl::StatusOr<TextDataset> FromFile(const std::string& path);
  // `path` empty -> built-in corpus.
  static absl::StatusOr<TextDataset> Open(const std::string& path);

  explicit TextDataset(std::string bytes, std::string source);

  size_t size() const { return bytes_.size(); }
  const std::string& source() const { return source_; }

  // Sequences [first, first + count) of step `step`'s global batch.
  TokenBatch GlobalSlice(uint64_t seed, int64_t step, int64_t first,
                         int64_t count, int64_t seq_len) const;
  // Microbatch `microbatch` of `rank` (see the ordering above).
  TokenBatch RankMicrobatch(uint64_t seed, int64_t step, int rank,
                            int microbatches, int microbatch,
                            int64_t microbatch_size, int64_t seq_len) const;

 private:
  // Start offset of global sequence `index` of `step`.
  int64_t Offset(uint64_t seed, int64_t step, int64_t index,
                 int64_t seq_len) const;

  std::string bytes_;
  std::string source_;
};

}  // namespace hsdp::models

#endif  // HSDP_WORKER_MODELS_DATA_H_
