#include "worker/ckpt/shard_io.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/file_util.h"
#include "worker/ckpt/crc32c.h"

namespace hsdp::ckpt {
namespace {

namespace fs = std::filesystem;

constexpr absl::Duration kPublishPoll = absl::Milliseconds(20);

// Checkpoint file errors keep codes of their own whatever the errno (a failed
// read NOT_FOUND, a failed write INTERNAL): the runner reads ABORTED,
// UNAVAILABLE and DEADLINE_EXCEEDED, which ESTALE, EINTR or ETIMEDOUT would
// map to, as a peer that went away rather than a broken checkpoint.
absl::Status WriteError(const absl::Status& s) {
  return s.ok() ? s : absl::InternalError(s.message());
}

absl::StatusOr<std::string> ReadSmallFile(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFile(path);
  if (!text.ok()) return absl::NotFoundError(text.status().message());
  return text;
}

std::string Rows(int64_t begin, int64_t end) {
  return absl::StrCat("rows [", begin, ", ", end, ")");
}

}  // namespace

std::string DtypeName(c10::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return "float32";
    case at::kDouble:
      return "float64";
    case at::kHalf:
      return "float16";
    case at::kBFloat16:
      return "bfloat16";
    case at::kLong:
      return "int64";
    case at::kInt:
      return "int32";
    case at::kChar:
      return "int8";
    case at::kByte:
      return "uint8";
    case at::kBool:
      return "bool";
    default:
      return "unsupported";
  }
}

absl::StatusOr<c10::ScalarType> ScalarTypeOf(const std::string& dtype) {
  static const auto* kTypes = new std::map<std::string, c10::ScalarType>{
      {"float32", at::kFloat}, {"float64", at::kDouble},
      {"float16", at::kHalf},  {"bfloat16", at::kBFloat16},
      {"int64", at::kLong},    {"int32", at::kInt},
      {"int8", at::kChar},     {"uint8", at::kByte},
      {"bool", at::kBool}};
  auto it = kTypes->find(dtype);
  if (it == kTypes->end())
    return absl::InvalidArgumentError(absl::StrCat("unknown dtype ", dtype));
  return it->second;
}

absl::StatusOr<ShardIndex> WriteShardFile(
    const std::string& step_dir, const std::string& file_name,
    const std::vector<LocalTensor>& tensors,
    const std::map<std::string, int64_t>& optimizer_steps) {
  ShardIndex index;
  index.file.name = file_name;
  index.optimizer_steps = optimizer_steps;
  AtomicFileWriter data(absl::StrCat(step_dir, "/", file_name));
  absl::Status s = WriteError(data.Open());
  if (!s.ok()) return s;
  int64_t offset = 0;
  for (const LocalTensor& t : tensors) {
    if (t.tensor.device().type() != c10::kCPU) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", t.name, " is not a CPU tensor"));
    }
    TensorEntry e;
    e.name = t.name;
    e.dtype = DtypeName(t.tensor.scalar_type());
    e.shape = t.global_shape;
    e.shard_dim = e.shape.empty() ? 0 : t.shard_dim;
    const int64_t dims = static_cast<int64_t>(e.shape.size());
    if (DtypeSize(e.dtype) == 0 || t.tensor.dim() != dims ||
        (dims > 0 && (e.shard_dim < 0 || e.shard_dim >= dims))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", t.name, ": dtype ", c10::toString(t.tensor.scalar_type()),
          " with ", t.tensor.dim(), " dims, global shape ",
          c10::str(c10::IntArrayRef(e.shape)), " and shard dim ", t.shard_dim,
          " cannot be checkpointed"));
    }
    // The bytes go out in the row frame: the shard dim first, row-major.
    const at::Tensor frame =
        (dims == 0 ? t.tensor.reshape({1}) : t.tensor.movedim(e.shard_dim, 0))
            .contiguous();
    const int64_t row_bytes =
        RowNumel(e.shape, e.shard_dim) * DtypeSize(e.dtype);
    const int64_t rows = frame.size(0);
    Chunk c;
    c.file = file_name;
    c.row_begin = t.row_offset;
    c.row_end = t.row_offset + rows;
    c.offset = offset;
    c.bytes = rows * row_bytes;
    c.block_rows = BlockRows(row_bytes);
    if (c.bytes != static_cast<int64_t>(frame.nbytes())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", t.name, ": local shape ", c10::str(t.tensor.sizes()),
          " does not match rows of ", c10::str(c10::IntArrayRef(e.shape)),
          " along dim ", e.shard_dim));
    }
    const char* bytes = static_cast<const char*>(frame.data_ptr());
    for (int64_t r = 0; r < rows; r += c.block_rows) {
      const int64_t n = std::min(c.block_rows, rows - r) * row_bytes;
      c.crc32c.push_back(Crc32c(bytes + r * row_bytes, static_cast<size_t>(n)));
    }
    s = WriteError(
        data.Append(absl::string_view(bytes, static_cast<size_t>(c.bytes))));
    if (!s.ok()) return s;
    offset += c.bytes;
    e.chunks.push_back(std::move(c));
    index.tensors.push_back(std::move(e));
  }
  index.file.bytes = offset;
  s = WriteError(data.Commit());
  if (s.ok()) {
    s = WriteError(WriteFileAtomically(
        absl::StrCat(step_dir, "/", ShardIndexName(file_name)),
        ShardIndexToJson(index)));
  }
  if (!s.ok()) return s;
  return index;
}

absl::Status PublishMetadata(const std::string& step_dir, Metadata base,
                             int shard_files, absl::Duration timeout,
                             const std::atomic<bool>* cancelled) {
  const absl::Time deadline = absl::Now() + timeout;
  std::map<std::string, TensorEntry> tensors;
  for (int i = 0; i < shard_files; ++i) {
    const std::string file = ShardFileName(i, shard_files);
    const std::string index_path =
        absl::StrCat(step_dir, "/", ShardIndexName(file));
    std::error_code ec;
    while (!fs::exists(index_path, ec)) {
      if (cancelled != nullptr && cancelled->load()) {
        return absl::CancelledError(
            absl::StrCat("checkpoint ", step_dir,
                         " not published: the worker is exiting "
                         "before ",
                         file, " was complete"));
      }
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            "checkpoint ", step_dir, " not published: ", file,
            " was not complete after ", absl::FormatDuration(timeout),
            " (its writer failed or died, or the directory is not shared by "
            "every rank)"));
      }
      absl::SleepFor(kPublishPoll);
    }
    absl::StatusOr<std::string> text = ReadSmallFile(index_path);
    if (!text.ok()) return text.status();
    absl::StatusOr<ShardIndex> index = ShardIndexFromJson(*text, index_path);
    if (!index.ok()) return index.status();
    base.files.push_back(index->file);
    for (const auto& [param, step] : index->optimizer_steps)
      base.optimizer_steps.emplace(param, step);
    for (TensorEntry& t : index->tensors) {
      auto [it, fresh] = tensors.emplace(t.name, t);
      if (!fresh) {
        for (Chunk& c : t.chunks) it->second.chunks.push_back(std::move(c));
      }
    }
  }
  for (auto& [name, t] : tensors) {
    // Empty chunks (ranks past the last row) carry nothing.
    std::vector<Chunk> chunks;
    for (Chunk& c : t.chunks) {
      if (c.row_end > c.row_begin) chunks.push_back(std::move(c));
    }
    std::sort(chunks.begin(), chunks.end(), [](const Chunk& a, const Chunk& b) {
      return a.row_begin < b.row_begin;
    });
    t.chunks = std::move(chunks);
    base.tensors.push_back(std::move(t));
  }
  base.format_version = RequiredFormatVersion(base.tensors);
  const std::string path = absl::StrCat(step_dir, "/", kMetadataFile);
  absl::Status s = ValidateMetadata(base, path);
  if (!s.ok()) return s;
  return WriteError(WriteFileAtomically(path, MetadataToJson(base)));
}

absl::StatusOr<Metadata> ReadMetadata(const std::string& step_dir) {
  const std::string path = absl::StrCat(step_dir, "/", kMetadataFile);
  absl::StatusOr<std::string> text = ReadSmallFile(path);
  if (!text.ok()) return text.status();
  absl::StatusOr<Metadata> m = MetadataFromJson(*text, path);
  if (!m.ok()) return m.status();
  absl::Status s = ValidateMetadata(*m, path);
  if (!s.ok()) return s;
  return m;
}

RowReader::RowReader(std::string step_dir, const Metadata& metadata)
    : step_dir_(std::move(step_dir)), metadata_(metadata) {
  for (const TensorEntry& t : metadata_.tensors) by_name_[t.name] = &t;
  for (const FileEntry& f : metadata_.files) file_bytes_[f.name] = f.bytes;
}

RowReader::~RowReader() {
  for (const auto& [name, fd] : fds_) ::close(fd);
}

absl::StatusOr<int> RowReader::Open(const std::string& file,
                                    const TensorEntry& tensor) {
  auto it = fds_.find(file);
  if (it != fds_.end()) return it->second;
  const std::string path = absl::StrCat(step_dir_, "/", file);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::DataLossError(
        absl::StrCat("checkpoint file ", path, " is missing (tensor ",
                     tensor.name, " has rows there): ", std::strerror(errno)));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || st.st_size != file_bytes_[file]) {
    ::close(fd);
    return absl::DataLossError(
        absl::StrCat("checkpoint file ", path, " is truncated or resized: ",
                     static_cast<int64_t>(st.st_size), " bytes, metadata says ",
                     file_bytes_[file], " (reading tensor ", tensor.name, ")"));
  }
  fds_[file] = fd;
  return fd;
}

absl::Status RowReader::Read(const LocalTensor& target) {
  auto it = by_name_.find(target.name);
  if (it == by_name_.end()) {
    return absl::NotFoundError(absl::StrCat(step_dir_, "/", kMetadataFile,
                                            " has no tensor ", target.name));
  }
  const TensorEntry& e = *it->second;
  if (e.shape != target.global_shape ||
      e.dtype != DtypeName(target.tensor.scalar_type())) {
    return absl::FailedPreconditionError(absl::StrCat(
        step_dir_, "/", kMetadataFile, ": tensor ", target.name, " is ",
        e.dtype, c10::str(c10::IntArrayRef(e.shape)), ", this model's is ",
        DtypeName(target.tensor.scalar_type()),
        c10::str(c10::IntArrayRef(target.global_shape))));
  }
  const int64_t dims = static_cast<int64_t>(e.shape.size());
  const int64_t want_dim = dims == 0 ? 0 : target.shard_dim;
  auto to_frame = [dims](const at::Tensor& t, int64_t dim) {
    return dims == 0 ? t.reshape({1}) : t.movedim(dim, 0);
  };
  const at::TensorOptions cpu = target.tensor.options().device(at::kCPU);
  if (want_dim == e.shard_dim) {
    // The checkpoint's rows are the ones wanted: read only those.
    const at::Tensor dst = to_frame(target.tensor, want_dim);
    // Staged on the CPU when the target lives elsewhere or is strided.
    const at::Tensor host = dst.device().is_cpu() && dst.is_contiguous()
                                ? dst
                                : at::empty(dst.sizes(), cpu);
    absl::Status s = ReadRows(e, target.row_offset, host);
    if (!s.ok()) return s;
    if (!host.is_same(dst)) dst.copy_(host);
    return absl::OkStatus();
  }
  // Saved as slices along another dim: every row of it holds part of the
  // wanted slices. Read the whole tensor and cut them out.
  at::Tensor whole = at::empty(FrameShape(e.shape, e.shard_dim), cpu);
  absl::Status s = ReadRows(e, 0, whole);
  if (!s.ok()) return s;
  whole = dims == 0 ? whole.reshape({}) : whole.movedim(0, e.shard_dim);
  target.tensor.copy_(
      whole.narrow(want_dim, target.row_offset, target.tensor.size(want_dim)));
  return absl::OkStatus();
}

absl::Status RowReader::ReadRows(const TensorEntry& e, int64_t want_begin,
                                 const at::Tensor& frame) {
  const int64_t want_end = want_begin + frame.size(0);
  const int64_t row_bytes = RowNumel(e.shape, e.shard_dim) * DtypeSize(e.dtype);
  char* dst = static_cast<char*>(frame.data_ptr());
  stats_.bytes_needed += (want_end - want_begin) * row_bytes;
  for (const Chunk& c : e.chunks) {
    const int64_t begin = std::max(c.row_begin, want_begin);
    const int64_t end = std::min(c.row_end, want_end);
    if (begin >= end) continue;
    absl::StatusOr<int> fd = Open(c.file, e);
    if (!fd.ok()) return fd.status();
    const std::string path = absl::StrCat(step_dir_, "/", c.file);
    // Blocks of the chunk that overlap [begin, end).
    const int64_t first = (begin - c.row_begin) / c.block_rows;
    const int64_t last = (end - 1 - c.row_begin) / c.block_rows;
    for (int64_t b = first; b <= last; ++b) {
      const int64_t b_begin = c.row_begin + b * c.block_rows;
      const int64_t b_end = std::min(c.row_end, b_begin + c.block_rows);
      const int64_t n = (b_end - b_begin) * row_bytes;
      if (static_cast<int64_t>(buffer_.size()) < n) buffer_.resize(n);
      const int64_t at = c.offset + (b_begin - c.row_begin) * row_bytes;
      int64_t got = 0;
      while (got < n) {
        const ssize_t r = ::pread(*fd, buffer_.data() + got, n - got, at + got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
          return absl::DataLossError(
              absl::StrCat("checkpoint file ", path, " ends inside tensor ",
                           e.name, " ", Rows(b_begin, b_end)));
        }
        got += r;
      }
      stats_.bytes_read += n;
      if (Crc32c(buffer_.data(), n) != c.crc32c[b]) {
        return absl::DataLossError(absl::StrCat(
            "checksum mismatch in ", path, ", tensor ", e.name, " ",
            Rows(b_begin, b_end), " (bytes ", at, "..", at + n, ")"));
      }
      const int64_t copy_begin = std::max(begin, b_begin);
      const int64_t copy_end = std::min(end, b_end);
      std::memcpy(dst + (copy_begin - want_begin) * row_bytes,
                  buffer_.data() + (copy_begin - b_begin) * row_bytes,
                  (copy_end - copy_begin) * row_bytes);
    }
  }
  return absl::OkStatus();
}

absl::Status VerifyCheckpoint(const std::string& step_dir,
                              const Metadata& metadata) {
  RowReader reader(step_dir, metadata);
  for (const TensorEntry& t : metadata.tensors) {
    absl::StatusOr<c10::ScalarType> type = ScalarTypeOf(t.dtype);
    if (!type.ok()) return type.status();
    // One block at a time: never the whole tensor in memory.
    std::vector<int64_t> shape = FrameShape(t.shape, t.shard_dim);
    for (const Chunk& c : t.chunks) {
      for (int64_t r = c.row_begin; r < c.row_end; r += c.block_rows) {
        shape[0] = std::min(c.block_rows, c.row_end - r);
        at::Tensor frame = at::empty(shape, at::dtype(*type));
        LocalTensor block{
            t.name,
            t.shape.empty() ? frame.reshape({}) : frame.movedim(0, t.shard_dim),
            t.shape, r, t.shard_dim};
        absl::Status s = reader.Read(block);
        if (!s.ok()) return s;
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<FoundCheckpoint> FindLatestCheckpoint(const std::string& root) {
  FoundCheckpoint found;
  std::error_code ec;
  if (root.empty() || !fs::is_directory(root, ec)) return found;
  std::vector<std::pair<int64_t, std::string>> dirs;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    int64_t step;
    if (entry.is_directory(ec) &&
        ParseStepDirName(entry.path().filename().string(), &step)) {
      dirs.emplace_back(step, entry.path().string());
    }
  }
  std::sort(dirs.rbegin(), dirs.rend());
  std::string old_format;
  for (const auto& [step, dir] : dirs) {
    if (fs::exists(absl::StrCat(dir, "/", kMetadataFile), ec)) {
      found.step = step;
      found.dir = dir;
      return found;
    }
    bool has_pt = false;
    for (const auto& f : fs::directory_iterator(dir, ec)) {
      const std::string name = f.path().filename().string();
      has_pt |= absl::StartsWith(name, "rank-") && absl::EndsWith(name, ".pt");
    }
    if (has_pt && old_format.empty()) old_format = dir;
    found.skipped.push_back(absl::StrCat(
        dir, has_pt ? ": per-rank .pt files of the pre-v1 format, not loadable"
                    : ": incomplete (no metadata.json; an interrupted save)"));
  }
  if (!old_format.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        old_format,
        " holds per-rank rank-R-of-W.pt files of the pre-v1 checkpoint format, "
        "which this worker cannot load (no metadata.json); finish that run "
        "with "
        "the build that wrote it, or move the directory away to start fresh"));
  }
  return found;
}

std::vector<int64_t> CompleteCheckpointSteps(const std::string& root) {
  std::vector<int64_t> steps;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return steps;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    int64_t step;
    if (ParseStepDirName(entry.path().filename().string(), &step) &&
        fs::exists(entry.path() / kMetadataFile, ec)) {
      steps.push_back(step);
    }
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

}  // namespace hsdp::ckpt
