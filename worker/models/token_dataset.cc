#include "hsdp/models/token_dataset.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace hsdp::models {

// Defined in the generated builtin_corpus.cc (see
// worker/models/CMakeLists.txt).
extern const unsigned char kBuiltinCorpusBytes[];
extern const size_t kBuiltinCorpusSize;

namespace {

constexpr char kTextPrefix[] = "text:";
constexpr char kLlmcPrefix[] = "tokens:";
constexpr char kU16Prefix[] = "tokens-u16:";
constexpr char kU32Prefix[] = "tokens-u32:";
constexpr int32_t kLlmcVersionU16 = 1;
constexpr int32_t kLlmcVersionU32 = 2;
constexpr int64_t kLlmcHeaderBytes = kLlmcHeaderInts * sizeof(int32_t);
constexpr int64_t kByteVocab = 256;

// SplitMix64: a tiny, well-mixed, portable hash so offsets never depend on a
// library's RNG.
uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Little-endian load of `width` bytes (the machines here are little-endian;
// this keeps the file format explicit regardless).
int64_t LoadLe(const unsigned char* p, int width) {
  uint64_t v = 0;
  for (int b = width - 1; b >= 0; --b) v = (v << 8) | p[b];
  return static_cast<int64_t>(v);
}

enum class Format { kText, kLlmc, kU16, kU32 };

}  // namespace

// The bytes a dataset reads: a string (text, built-in corpus) or a read-only
// memory mapping of the whole file.
class TokenDataset::Storage {
 public:
  explicit Storage(std::string bytes) : bytes_(std::move(bytes)) {}
  Storage(void* map, size_t length) : map_(map), map_length_(length) {}
  ~Storage() {
    if (map_ != nullptr) munmap(map_, map_length_);
  }
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  const unsigned char* data() const {
    return map_ != nullptr
               ? static_cast<const unsigned char*>(map_)
               : reinterpret_cast<const unsigned char*>(bytes_.data());
  }
  size_t size() const { return map_ != nullptr ? map_length_ : bytes_.size(); }

 private:
  std::string bytes_;
  void* map_ = nullptr;
  size_t map_length_ = 0;
};

absl::string_view BuiltinCorpus() {
  return absl::string_view(reinterpret_cast<const char*>(kBuiltinCorpusBytes),
                           kBuiltinCorpusSize);
}

TokenDataset::TokenDataset(std::shared_ptr<const Storage> storage, int width,
                           int64_t size, std::string source)
    : storage_(std::move(storage)),
      width_(width),
      size_(size),
      source_(std::move(source)) {
  data_ = storage_->data() + (storage_->size() - size_ * width_);
}

TokenDataset TokenDataset::Builtin() {
  auto storage = std::make_shared<const Storage>(std::string(BuiltinCorpus()));
  const int64_t size = static_cast<int64_t>(storage->size());
  return TokenDataset(std::move(storage), 1, size, "builtin");
}

absl::StatusOr<TokenDataset> TokenDataset::Open(const std::string& spec,
                                                int64_t vocab_size,
                                                int64_t seq_len) {
  Format format = Format::kText;
  std::string path = spec;
  for (const auto& [prefix, f] :
       {std::pair<const char*, Format>{kTextPrefix, Format::kText},
        {kLlmcPrefix, Format::kLlmc},
        {kU16Prefix, Format::kU16},
        {kU32Prefix, Format::kU32}}) {
    if (absl::StartsWith(spec, prefix)) {
      format = f;
      path = spec.substr(std::strlen(prefix));
      break;
    }
  }
  std::shared_ptr<const Storage> storage;
  if (path.empty() && format == Format::kText) {
    storage = std::make_shared<const Storage>(std::string(BuiltinCorpus()));
    path = "builtin";
  } else {
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      return absl::NotFoundError(
          absl::StrCat("data file '", path, "': ", std::strerror(errno)));
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      close(fd);
      return absl::InvalidArgumentError(
          absl::StrCat("data file '", path, "' is not a regular file"));
    }
    const size_t length = static_cast<size_t>(st.st_size);
    void* map = length == 0 ? nullptr
                            : mmap(nullptr, length, PROT_READ, MAP_PRIVATE, fd,
                                   /*offset=*/0);
    close(fd);
    if (map == MAP_FAILED) {
      return absl::InternalError(
          absl::StrCat("data file '", path, "': mmap: ", std::strerror(errno)));
    }
    storage = map == nullptr ? std::make_shared<const Storage>(std::string())
                             : std::make_shared<const Storage>(map, length);
  }

  const int64_t bytes = static_cast<int64_t>(storage->size());
  int width = 1;
  int64_t header = 0;
  int64_t declared = -1;
  switch (format) {
    case Format::kText:
      if (vocab_size < kByteVocab) {
        return absl::InvalidArgumentError(absl::StrCat(
            "data file '", path, "' is text (byte tokens 0..255) but the ",
            "vocabulary size is ", vocab_size));
      }
      break;
    case Format::kU16:
      width = 2;
      break;
    case Format::kU32:
      width = 4;
      break;
    case Format::kLlmc: {
      if (bytes < kLlmcHeaderBytes) {
        return absl::InvalidArgumentError(
            absl::StrCat("data file '", path, "' has ", bytes,
                         " bytes, less than the 1024-byte llm.c header"));
      }
      const unsigned char* h = storage->data();
      const int64_t magic = LoadLe(h, 4);
      const int64_t version = LoadLe(h + 4, 4);
      if (magic != kLlmcMagic) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "data file '%s': unknown header (magic %d; an llm.c token file "
            "starts with %d; headerless files are tokens-u16:PATH or "
            "tokens-u32:PATH)",
            path, magic, kLlmcMagic));
      }
      if (version == kLlmcVersionU16) {
        width = 2;
      } else if (version == kLlmcVersionU32) {
        width = 4;
      } else {
        return absl::InvalidArgumentError(absl::StrFormat(
            "data file '%s': unknown llm.c header version %d (known: 1 = "
            "uint16 tokens, 2 = uint32 tokens)",
            path, version));
      }
      header = kLlmcHeaderBytes;
      declared = LoadLe(h + 8, 4);
      break;
    }
  }
  const int64_t payload = bytes - header;
  if (payload % width != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data file '", path, "': ", payload, " bytes of tokens is not a ",
        "whole number of ", width, "-byte tokens"));
  }
  const int64_t count = payload / width;
  if (declared >= 0 && declared != count) {
    return absl::InvalidArgumentError(
        absl::StrCat("data file '", path, "': the header declares ", declared,
                     " tokens, the file holds ", count, " (truncated?)"));
  }
  if (count < seq_len + 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data file '", path, "' holds ", count, " tokens, too short for one ",
        "window of seq_len + 1 = ", seq_len + 1, " tokens"));
  }
  TokenDataset data(std::move(storage), width, count, path);
  if (width > 1) {
    for (int64_t i = 0; i < count; ++i) {
      const int64_t token = data.Token(i);
      if (token >= vocab_size) {
        return absl::InvalidArgumentError(
            absl::StrCat("data file '", path, "': token ", i, " is ", token,
                         ", not below the vocabulary size ", vocab_size,
                         " (set --vocab-size)"));
      }
    }
  }
  return data;
}

int64_t TokenDataset::Token(int64_t index) const {
  return width_ == 1 ? data_[index] : LoadLe(data_ + index * width_, width_);
}

int64_t TokenDataset::Offset(uint64_t seed, int64_t step, int64_t index,
                             int64_t seq_len) const {
  // Every start whose window of seq_len + 1 tokens fits.
  const uint64_t span = static_cast<uint64_t>(size_ - seq_len);
  const uint64_t h =
      SplitMix64(SplitMix64(SplitMix64(seed) ^ static_cast<uint64_t>(step)) ^
                 static_cast<uint64_t>(index));
  return static_cast<int64_t>(h % span);
}

TokenBatch TokenDataset::GlobalSlice(uint64_t seed, int64_t step, int64_t first,
                                     int64_t count, int64_t seq_len) const {
  TORCH_CHECK(size_ >= seq_len + 1, "data '", source_, "' (", size_,
              " tokens) is shorter than seq_len + 1 = ", seq_len + 1);
  at::Tensor window = at::empty({count, seq_len + 1}, at::kLong);
  int64_t* out = window.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    const int64_t off = Offset(seed, step, first + i, seq_len);
    for (int64_t j = 0; j <= seq_len; ++j)
      out[i * (seq_len + 1) + j] = Token(off + j);
  }
  return TokenBatch{window.slice(1, 0, seq_len).contiguous(),
                    window.slice(1, 1, seq_len + 1).contiguous()};
}

}  // namespace hsdp::models
