#include "worker/models/data.h"

#include <ATen/ATen.h>

#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"

namespace hsdp::models {

// Defined in the generated builtin_corpus.cc (see
// worker/models/CMakeLists.txt).
extern const unsigned char kBuiltinCorpusBytes[];
extern const size_t kBuiltinCorpusSize;

namespace {

// Shortest text we accept: enough for a few distinct windows of the largest
// named seq_len.
constexpr size_t kMinBytes = 2048;

// SplitMix64: a tiny, well-mixed, portable hash so offsets never depend on a
// library's RNG.
uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

absl::string_view BuiltinCorpus() {
  return absl::string_view(reinterpret_cast<const char*>(kBuiltinCorpusBytes),
                           kBuiltinCorpusSize);
}

TextDataset::TextDataset(std::string bytes, std::string source)
    : bytes_(std::move(bytes)), source_(std::move(source)) {}

TextDataset TextDataset::Builtin() {
  return TextDataset(std::string(BuiltinCorpus()), "builtin");
}

absl::StatusOr<TextDataset> TextDataset::FromFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    return absl::NotFoundError(
        absl::StrCat("cannot open data file '", path, "'"));
  std::ostringstream buf;
  buf << in.rdbuf();
  std::string bytes = buf.str();
  if (bytes.size() < kMinBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("data file '", path, "' has ", bytes.size(),
                     " bytes; need at least ", kMinBytes));
  }
  return TextDataset(std::move(bytes), path);
}

absl::StatusOr<TextDataset> TextDataset::Open(const std::string& path) {
  if (path.empty()) return Builtin();
  return FromFile(path);
}

int64_t TextDataset::Offset(uint64_t seed, int64_t step, int64_t index,
                            int64_t seq_len) const {
  const uint64_t span = bytes_.size() - static_cast<uint64_t>(seq_len) - 1;
  const uint64_t h =
      SplitMix64(SplitMix64(SplitMix64(seed) ^ static_cast<uint64_t>(step)) ^
                 static_cast<uint64_t>(index));
  return static_cast<int64_t>(h % span);
}

TokenBatch TextDataset::GlobalSlice(uint64_t seed, int64_t step, int64_t first,
                                    int64_t count, int64_t seq_len) const {
  TORCH_CHECK(bytes_.size() > static_cast<size_t>(seq_len) + 1, "data '",
              source_, "' (", bytes_.size(),
              " bytes) is shorter than seq_len + 1 = ", seq_len + 1);
  at::Tensor window = at::empty({count, seq_len + 1}, at::kLong);
  int64_t* out = window.data_ptr<int64_t>();
  const auto* data = reinterpret_cast<const unsigned char*>(bytes_.data());
  for (int64_t i = 0; i < count; ++i) {
    const int64_t off = Offset(seed, step, first + i, seq_len);
    for (int64_t j = 0; j <= seq_len; ++j)
      out[i * (seq_len + 1) + j] = data[off + j];
  }
  return TokenBatch{window.slice(1, 0, seq_len).contiguous(),
                    window.slice(1, 1, seq_len + 1).contiguous()};
}

TokenBatch TextDataset::RankMicrobatch(uint64_t seed, int64_t step, int rank,
                                       int microbatches, int microbatch,
                                       int64_t microbatch_size,
                                       int64_t seq_len) const {
  const int64_t first =
      (static_cast<int64_t>(rank) * microbatches + microbatch) *
      microbatch_size;
  return GlobalSlice(seed, step, first, microbatch_size, seq_len);
}

}  // namespace hsdp::models
