// Token data for language-model tasks: plain text read as bytes, or
// pre-tokenized corpora as memory-mapped flat token files.
//
// `--data` spellings (see worker/README.md):
//   PATH or text:PATH   the file's bytes are the tokens (vocabulary 256)
//   tokens:PATH         an llm.c token file: a 256 x int32 header (magic
//                       20240520; version 1: uint16 tokens, version 2: uint32
//                       tokens; header[2]: token count), then the tokens
//   tokens-u16:PATH     headerless little-endian uint16 tokens (nanoGPT's
//   tokens-u32:PATH     train.bin), or uint32
// Open() refuses, in one line naming the file: a missing file, an unknown
// header, a file too short for one window of seq_len + 1 tokens, a size that
// is not a whole number of tokens, and any token id >= the vocabulary size
// (the whole file is checked once at open).
//
// Sampling: step `s` has a deterministic global batch; sample `g` of it is the
// window of seq_len + 1 tokens starting at a hash of (seed, s, g). Any mesh,
// and the single-process reference, reading the same sample indices reads the
// same tokens.
//
// Thread-safety: immutable after Open; safe to share across threads.
#ifndef HSDP_MODELS_TOKEN_DATASET_H_
#define HSDP_MODELS_TOKEN_DATASET_H_

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace hsdp::models {

// The llm.c token file header: 256 int32 values.
inline constexpr int32_t kLlmcMagic = 20240520;
inline constexpr int kLlmcHeaderInts = 256;

// Inputs and next-token targets, int64 [batch, seq_len], on CPU.
struct TokenBatch {
  at::Tensor tokens;
  at::Tensor targets;
};

// The small public-domain text shipped with the repo (Aesop's fables,
// worker/models/data/), compiled into the binary so the demo runs offline from
// any directory.
absl::string_view BuiltinCorpus();

class TokenDataset {
 public:
  // The built-in corpus (bytes).
  static TokenDataset Builtin();
  // `spec` as above; empty: the built-in corpus. Checks every token against
  // `vocab_size` and the length against one window of `seq_len` + 1 tokens.
  static absl::StatusOr<TokenDataset> Open(const std::string& spec,
                                           int64_t vocab_size, int64_t seq_len);

  // Number of tokens.
  int64_t size() const { return size_; }
  // "builtin", or the path.
  const std::string& source() const { return source_; }
  // Bytes per token (1 for text).
  int token_bytes() const { return width_; }

  // Samples [first, first + count) of step `step`'s global batch.
  TokenBatch GlobalSlice(uint64_t seed, int64_t step, int64_t first,
                         int64_t count, int64_t seq_len) const;

 private:
  class Storage;
  TokenDataset(std::shared_ptr<const Storage> storage, int width, int64_t size,
               std::string source);
  int64_t Token(int64_t index) const;
  int64_t Offset(uint64_t seed, int64_t step, int64_t index,
                 int64_t seq_len) const;

  // Owns the bytes (a string or a read-only mapping); shared by copies.
  std::shared_ptr<const Storage> storage_;
  const unsigned char* data_ = nullptr;  // first token
  int width_ = 1;
  int64_t size_ = 0;
  std::string source_;
};

}  // namespace hsdp::models

#endif  // HSDP_MODELS_TOKEN_DATASET_H_
