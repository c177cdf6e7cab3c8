#include "worker/ckpt/format.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <type_traits>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace hsdp::ckpt {
namespace {

using nlohmann::json;

constexpr char kIndexSuffix[] = ".index.json";

json ChunkToJson(const Chunk& c) {
  return json{{"file", c.file},
              {"rows", {c.row_begin, c.row_end}},
              {"offset", c.offset},
              {"bytes", c.bytes},
              {"block_rows", c.block_rows},
              {"crc32c", c.crc32c}};
}

json TensorToJson(const TensorEntry& t) {
  json chunks = json::array();
  for (const Chunk& c : t.chunks) chunks.push_back(ChunkToJson(c));
  json j{{"name", t.name},
         {"dtype", t.dtype},
         {"shape", t.shape},
         {"chunks", chunks}};
  if (t.shard_dim != 0) j["shard_dim"] = t.shard_dim;
  return j;
}

// The integer type at the leaves of a field's C++ type (int64_t for
// std::map<std::string, int64_t>), or the type itself.
template <typename T>
struct Leaf {
  using type = T;
};
template <typename T>
struct Leaf<std::vector<T>> {
  using type = typename Leaf<T>::type;
};
template <typename K, typename V>
struct Leaf<std::map<K, V>> {
  using type = typename Leaf<V>::type;
};

// True when every number in `v` (recursively) is an integer that fits T.
// nlohmann's get<T>() would cast a float or an out-of-range integer silently
// (a float past T's range is undefined behaviour), so a file saying
// "step": 1e300 or "mesh": {"shard": 4294967297} would load as garbage.
template <typename T>
bool IntegersFit(const json& v) {
  if (v.is_array() || v.is_object()) {
    for (const json& e : v) {
      if (!IntegersFit<T>(e)) return false;
    }
    return true;
  }
  if (v.is_number_float()) return false;
  if (v.is_number_unsigned()) {
    return v.get<uint64_t>() <=
           static_cast<uint64_t>(std::numeric_limits<T>::max());
  }
  if (v.is_number_integer()) {
    const int64_t x = v.get<int64_t>();
    if (x < 0) {
      if constexpr (std::is_signed_v<T>) {
        return x >= std::numeric_limits<T>::min();
      } else {
        return false;
      }
    }
    return static_cast<uint64_t>(x) <=
           static_cast<uint64_t>(std::numeric_limits<T>::max());
  }
  return true;  // strings, booleans, null: get<T>() decides
}

// Field access that turns nlohmann's exceptions into one-line errors naming
// the file and the field.
class Reader {
 public:
  explicit Reader(std::string path) : path_(std::move(path)) {}
  const std::string& path() const { return path_; }

  template <typename T>
  absl::Status Get(const json& obj, const char* key, T* out,
                   const std::string& where = "") const {
    auto it = obj.find(key);
    if (it == obj.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path_, ": ", where, "no field \"", key, "\""));
    }
    using L = typename Leaf<T>::type;
    if constexpr (std::is_integral_v<L> && !std::is_same_v<L, bool>) {
      if (!IntegersFit<L>(*it)) {
        return absl::InvalidArgumentError(
            absl::StrCat(path_, ": ", where, "field \"", key,
                         "\" holds a number that is not an integer in range"));
      }
    }
    try {
      *out = it->template get<T>();
    } catch (const json::exception& e) {
      return absl::InvalidArgumentError(absl::StrCat(
          path_, ": ", where, "field \"", key, "\" has the wrong type"));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<TensorEntry> Tensor(const json& t) const {
    TensorEntry e;
    absl::Status s = Get(t, "name", &e.name);
    const std::string where = absl::StrCat("tensor ", e.name, ": ");
    if (s.ok()) s = Get(t, "dtype", &e.dtype, where);
    if (s.ok()) s = Get(t, "shape", &e.shape, where);
    if (s.ok() && t.contains("shard_dim")) {
      s = Get(t, "shard_dim", &e.shard_dim, where);
    }
    json chunks;
    if (s.ok()) s = Get(t, "chunks", &chunks, where);
    if (!s.ok()) return s;
    if (!chunks.is_array()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path_, ": ", where, "\"chunks\" is not an array"));
    }
    for (const json& c : chunks) {
      Chunk k;
      std::vector<int64_t> rows;
      for (absl::Status cs :
           {Get(c, "file", &k.file, where), Get(c, "rows", &rows, where),
            Get(c, "offset", &k.offset, where),
            Get(c, "bytes", &k.bytes, where),
            Get(c, "block_rows", &k.block_rows, where),
            Get(c, "crc32c", &k.crc32c, where)}) {
        if (!cs.ok()) return cs;
      }
      if (rows.size() != 2) {
        return absl::InvalidArgumentError(
            absl::StrCat(path_, ": ", where, "\"rows\" must be [begin, end)"));
      }
      k.row_begin = rows[0];
      k.row_end = rows[1];
      e.chunks.push_back(std::move(k));
    }
    return e;
  }

 private:
  std::string path_;
};

absl::StatusOr<json> Parse(const std::string& text, const std::string& path) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::DataLossError(
        absl::StrCat(path, ": not a JSON object (truncated or corrupt)"));
  }
  return j;
}

}  // namespace

std::string StepDirName(int64_t step) {
  return absl::StrFormat("%s%08d", kStepDirPrefix, step);
}

bool ParseStepDirName(const std::string& name, int64_t* step) {
  return absl::StartsWith(name, kStepDirPrefix) &&
         absl::SimpleAtoi(name.substr(std::strlen(kStepDirPrefix)), step) &&
         *step >= 0;
}

std::string ShardFileName(int shard, int shards) {
  return absl::StrFormat("shard-%05d-of-%05d.bin", shard, shards);
}

std::string ShardIndexName(const std::string& shard_file) {
  return shard_file + kIndexSuffix;
}

std::string OptimizerTensorName(const std::string& state,
                                const std::string& param) {
  return absl::StrCat(kOptimizerPrefix, state, "/", param);
}

int64_t DtypeSize(const std::string& dtype) {
  static const auto* kSizes = new std::map<std::string, int64_t>{
      {"float32", 4},  {"float64", 8}, {"float16", 2},
      {"bfloat16", 2}, {"int64", 8},   {"int32", 4},
      {"int8", 1},     {"uint8", 1},   {"bool", 1}};
  auto it = kSizes->find(dtype);
  return it == kSizes->end() ? 0 : it->second;
}

std::vector<int64_t> FrameShape(const std::vector<int64_t>& shape,
                                int64_t shard_dim) {
  if (shape.empty()) return {1};
  std::vector<int64_t> frame = shape;
  if (shard_dim > 0 && shard_dim < static_cast<int64_t>(shape.size())) {
    frame.erase(frame.begin() + shard_dim);
    frame.insert(frame.begin(), shape[shard_dim]);
  }
  return frame;
}

int64_t RowCount(const std::vector<int64_t>& shape, int64_t shard_dim) {
  return FrameShape(shape, shard_dim)[0];
}

int64_t RowNumel(const std::vector<int64_t>& shape, int64_t shard_dim) {
  const std::vector<int64_t> frame = FrameShape(shape, shard_dim);
  int64_t n = 1;
  for (size_t i = 1; i < frame.size(); ++i) n *= frame[i];
  return n;
}

int RequiredFormatVersion(const std::vector<TensorEntry>& tensors) {
  for (const TensorEntry& t : tensors) {
    if (t.shard_dim != 0 || t.shape.empty()) return 2;
  }
  return kMinFormatVersion;
}

int64_t BlockRows(int64_t row_bytes) {
  return std::max<int64_t>(1, kBlockBytes / std::max<int64_t>(1, row_bytes));
}

std::string MetadataToJson(const Metadata& m) {
  json files = json::array();
  for (const FileEntry& f : m.files)
    files.push_back(json{{"name", f.name}, {"bytes", f.bytes}});
  json tensors = json::array();
  for (const TensorEntry& t : m.tensors) tensors.push_back(TensorToJson(t));
  json j{{"format", kFormatName},
         {"format_version", m.format_version},
         {"step", m.step},
         {"data",
          {{"next_step", m.next_step},
           {"samples_consumed", m.samples_consumed},
           {"global_batch_samples", m.global_batch_samples}}},
         {"seed", m.seed},
         {"model", {{"name", m.model_name}, {"version", m.model_version}}},
         {"policy_version", m.policy_version},
         {"mesh", {{"replicate", m.replicate}, {"shard", m.shard}}},
         {"optimizer", {{"type", m.optimizer}, {"steps", m.optimizer_steps}}},
         {"job", m.job},
         {"files", files},
         {"tensors", tensors}};
  return j.dump(1) + "\n";
}

absl::StatusOr<Metadata> MetadataFromJson(const std::string& text,
                                          const std::string& path) {
  absl::StatusOr<json> parsed = Parse(text, path);
  if (!parsed.ok()) return parsed.status();
  const json& j = *parsed;
  Reader r(path);
  Metadata m;
  std::string format;
  absl::Status s = r.Get(j, "format", &format);
  if (s.ok() && format != kFormatName) {
    s = absl::InvalidArgumentError(absl::StrCat(
        path, ": \"format\" is \"", format, "\", not \"", kFormatName, "\""));
  }
  if (s.ok()) s = r.Get(j, "format_version", &m.format_version);
  if (!s.ok()) return s;
  if (m.format_version < kMinFormatVersion ||
      m.format_version > kFormatVersion) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, ": format_version ", m.format_version,
                     " is unknown (this build reads versions ",
                     kMinFormatVersion, " to ", kFormatVersion, ")"));
  }
  json data, model, mesh, optimizer, files, tensors;
  for (absl::Status fs :
       {r.Get(j, "step", &m.step), r.Get(j, "data", &data),
        r.Get(j, "seed", &m.seed), r.Get(j, "model", &model),
        r.Get(j, "policy_version", &m.policy_version), r.Get(j, "mesh", &mesh),
        r.Get(j, "optimizer", &optimizer), r.Get(j, "job", &m.job),
        r.Get(j, "files", &files), r.Get(j, "tensors", &tensors)}) {
    if (!fs.ok()) return fs;
  }
  for (absl::Status fs :
       {r.Get(data, "next_step", &m.next_step, "data: "),
        r.Get(data, "samples_consumed", &m.samples_consumed, "data: "),
        r.Get(data, "global_batch_samples", &m.global_batch_samples, "data: "),
        r.Get(model, "name", &m.model_name, "model: "),
        r.Get(model, "version", &m.model_version, "model: "),
        r.Get(mesh, "replicate", &m.replicate, "mesh: "),
        r.Get(mesh, "shard", &m.shard, "mesh: "),
        r.Get(optimizer, "type", &m.optimizer, "optimizer: "),
        r.Get(optimizer, "steps", &m.optimizer_steps, "optimizer: ")}) {
    if (!fs.ok()) return fs;
  }
  for (const json& f : files) {
    FileEntry e;
    for (absl::Status fs : {r.Get(f, "name", &e.name, "files: "),
                            r.Get(f, "bytes", &e.bytes, "files: ")}) {
      if (!fs.ok()) return fs;
    }
    m.files.push_back(std::move(e));
  }
  for (const json& t : tensors) {
    absl::StatusOr<TensorEntry> e = r.Tensor(t);
    if (!e.ok()) return e.status();
    m.tensors.push_back(*std::move(e));
  }
  return m;
}

std::string ShardIndexToJson(const ShardIndex& index) {
  json tensors = json::array();
  for (const TensorEntry& t : index.tensors) tensors.push_back(TensorToJson(t));
  json j{{"file", {{"name", index.file.name}, {"bytes", index.file.bytes}}},
         {"optimizer_steps", index.optimizer_steps},
         {"tensors", tensors}};
  return j.dump(1) + "\n";
}

absl::StatusOr<ShardIndex> ShardIndexFromJson(const std::string& text,
                                              const std::string& path) {
  absl::StatusOr<json> parsed = Parse(text, path);
  if (!parsed.ok()) return parsed.status();
  Reader r(path);
  ShardIndex index;
  json file, tensors;
  for (absl::Status s :
       {r.Get(*parsed, "file", &file), r.Get(*parsed, "tensors", &tensors),
        r.Get(*parsed, "optimizer_steps", &index.optimizer_steps)}) {
    if (!s.ok()) return s;
  }
  for (absl::Status s : {r.Get(file, "name", &index.file.name, "file: "),
                         r.Get(file, "bytes", &index.file.bytes, "file: ")}) {
    if (!s.ok()) return s;
  }
  for (const json& t : tensors) {
    absl::StatusOr<TensorEntry> e = r.Tensor(t);
    if (!e.ok()) return e.status();
    index.tensors.push_back(*std::move(e));
  }
  return index;
}

absl::Status ValidateMetadata(const Metadata& m, const std::string& path) {
  std::map<std::string, int64_t> file_bytes;
  for (const FileEntry& f : m.files) file_bytes[f.name] = f.bytes;
  std::set<std::string> names;
  for (const TensorEntry& t : m.tensors) {
    auto bad = [&](const std::string& why) {
      return absl::DataLossError(
          absl::StrCat(path, ": tensor ", t.name, ": ", why));
    };
    if (!names.insert(t.name).second) return bad("listed twice");
    const int64_t elem = DtypeSize(t.dtype);
    if (elem == 0) return bad(absl::StrCat("unknown dtype \"", t.dtype, "\""));
    const int64_t dims = static_cast<int64_t>(t.shape.size());
    if ((t.shard_dim != 0 || dims == 0) && m.format_version < 2) {
      return bad(absl::StrCat(dims == 0 ? "is 0-dim" : "has a shard_dim",
                              ", which format_version ", m.format_version,
                              " does not allow"));
    }
    if (t.shard_dim != 0 && (t.shard_dim < 0 || t.shard_dim >= dims)) {
      return bad(absl::StrCat("shard_dim ", t.shard_dim,
                              " is not a dim of its shape"));
    }
    // Row bytes, computed with overflow checks: every offset the loader
    // derives from them (RowNumel * DtypeSize, rows * row bytes) then fits in
    // int64_t.
    for (int64_t d = 0; d < dims; ++d) {
      if (t.shape[d] < 0) {
        return bad(absl::StrCat("dim ", d, " is negative (", t.shape[d], ")"));
      }
    }
    const std::vector<int64_t> frame = FrameShape(t.shape, t.shard_dim);
    int64_t row_bytes = elem;
    for (size_t d = 1; d < frame.size(); ++d) {
      if (__builtin_mul_overflow(row_bytes, frame[d], &row_bytes)) {
        return bad("its shape is too large (bytes per row overflow int64)");
      }
    }
    int64_t next_row = 0;
    for (const Chunk& c : t.chunks) {
      if (c.row_begin != next_row || c.row_end < c.row_begin) {
        return bad(absl::StrCat("chunk in ", c.file, " holds rows [",
                                c.row_begin, ", ", c.row_end, "), expected ",
                                next_row, " next"));
      }
      next_row = c.row_end;
      auto f = file_bytes.find(c.file);
      if (f == file_bytes.end())
        return bad(absl::StrCat("chunk in ", c.file, ", a file not listed"));
      // row_begin >= 0 (it starts at 0 and only grows), so rows cannot
      // overflow; the products and sums below are checked.
      const int64_t rows = c.row_end - c.row_begin;
      int64_t chunk_bytes = 0;
      if (__builtin_mul_overflow(rows, row_bytes, &chunk_bytes) ||
          c.bytes != chunk_bytes || c.offset < 0 || f->second < 0 ||
          c.offset > f->second - c.bytes) {
        return bad(absl::StrCat("chunk in ", c.file, " at offset ", c.offset,
                                " with ", c.bytes, " bytes does not fit"));
      }
      const int64_t blocks =
          c.block_rows <= 0
              ? -1
              : rows / c.block_rows + (rows % c.block_rows != 0 ? 1 : 0);
      if (blocks != static_cast<int64_t>(c.crc32c.size())) {
        return bad(absl::StrCat("chunk in ", c.file, " has ", c.crc32c.size(),
                                " checksums for ", blocks, " blocks"));
      }
    }
    if (next_row != frame[0]) {
      return bad(absl::StrCat("its chunks cover rows [0, ", next_row, ") of ",
                              frame[0]));
    }
  }
  return absl::OkStatus();
}

}  // namespace hsdp::ckpt
