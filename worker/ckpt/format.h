// Checkpoint format v1 (README.md describes it for other programs): the
// metadata and per-file index structures, their JSON form, and the names of
// the files in a checkpoint directory. No torch here: the format is bytes.
//
// Thread-safe: plain values and pure functions.
#ifndef HSDP_WORKER_CKPT_FORMAT_H_
#define HSDP_WORKER_CKPT_FORMAT_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace hsdp::ckpt {

// Version 2 adds a tensor's shard_dim and 0-dim tensors; a checkpoint that
// uses neither is written as version 1, which every earlier build reads.
inline constexpr int kFormatVersion = 2;
inline constexpr int kMinFormatVersion = 1;
inline constexpr char kFormatName[] = "hsdp-checkpoint";
inline constexpr char kMetadataFile[] = "metadata.json";
inline constexpr char kStepDirPrefix[] = "step-";
// Blocks of one chunk hold at most this many bytes (at least one row): the
// unit of checksums and of reads, so a rank reading a few rows reads at most
// one block more than it needs at each end of each chunk. Smaller blocks read
// closer to the minimum when resharding; larger ones keep metadata.json short
// (one CRC per block: ~16K per GiB at 64 KiB).
inline constexpr int64_t kBlockBytes = int64_t{64} << 10;
// Optimizer-state tensors are named kOptimizerPrefix + state + "/" + param.
inline constexpr char kOptimizerPrefix[] = "optimizer/";

// Rows [row_begin, row_end) of one tensor, stored contiguously (row-major,
// little-endian) at [offset, offset + bytes) of `file`, in blocks of
// `block_rows` rows, each with its CRC-32C.
struct Chunk {
  std::string file;
  int64_t row_begin = 0;
  int64_t row_end = 0;
  int64_t offset = 0;
  int64_t bytes = 0;
  int64_t block_rows = 1;
  std::vector<uint32_t> crc32c;  // one per block, in row order
};

struct TensorEntry {
  std::string name;            // parameter FQN, or optimizer/<state>/<FQN>
  std::string dtype;           // "float32", "bfloat16", ... (DtypeSize)
  std::vector<int64_t> shape;  // global shape
  std::vector<Chunk> chunks;   // sorted by row_begin
  // Rows are the slices along this dim, stored in the row frame (FrameShape):
  // the tensor with shard_dim moved first, row-major. 0 (dim 0, the tensor's
  // own layout) unless the parameter was sharded on another dim.
  int64_t shard_dim = 0;
};

struct FileEntry {
  std::string name;  // relative to the step directory
  int64_t bytes = 0;
};

// What one writer wrote: its data file, and per tensor one chunk. Written next
// to the data file as <file>.index.json once the data file is durable; its
// presence marks the file complete.
struct ShardIndex {
  FileEntry file;
  std::vector<TensorEntry> tensors;
  // Optimizer step counter per parameter (AdamW's bias correction).
  std::map<std::string, int64_t> optimizer_steps;
};

struct Metadata {
  // What PublishMetadata writes: kMinFormatVersion unless a tensor needs 2.
  int format_version = kMinFormatVersion;
  int64_t step = 0;
  // Data position: the next step to run; samples of the fixed global batch
  // consumed so far; the global batch it was saved with.
  int64_t next_step = 0;
  int64_t samples_consumed = 0;
  int64_t global_batch_samples = 0;
  // Model init and data order (the data stream is a function of seed, step and
  // sample index: there is no other RNG state to carry).
  uint64_t seed = 0;
  std::string model_name;
  std::string model_version;
  int64_t policy_version = -1;  // -1: unknown
  int replicate = 1;            // the mesh it was saved on, R x S
  int shard = 1;
  std::string optimizer;  // "adamw", "adam", "sgd" or "none"
  std::map<std::string, int64_t> optimizer_steps;
  std::map<std::string, std::string> job;  // the job's settings, for people
  std::vector<FileEntry> files;
  std::vector<TensorEntry> tensors;  // sorted by name
};

// "step-00000012"
std::string StepDirName(int64_t step);
// Parses StepDirName's form; false otherwise.
bool ParseStepDirName(const std::string& name, int64_t* step);
// "shard-00001-of-00004.bin": the data of shard index `shard` of `shards`.
std::string ShardFileName(int shard, int shards);
std::string ShardIndexName(const std::string& shard_file);
std::string OptimizerTensorName(const std::string& state,
                                const std::string& param);

// Bytes per element; 0 for an unknown name.
int64_t DtypeSize(const std::string& dtype);
// The row frame: `shape` with `shard_dim` moved first; {1} for a 0-dim
// shape (one row of one element).
std::vector<int64_t> FrameShape(const std::vector<int64_t>& shape,
                                int64_t shard_dim = 0);
// Rows (FrameShape()[0]) and elements per row (the product of the rest).
int64_t RowCount(const std::vector<int64_t>& shape, int64_t shard_dim = 0);
int64_t RowNumel(const std::vector<int64_t>& shape, int64_t shard_dim = 0);
// The version a checkpoint of these tensors needs.
int RequiredFormatVersion(const std::vector<TensorEntry>& tensors);

// Rows per block for a row of `row_bytes`.
int64_t BlockRows(int64_t row_bytes);

std::string MetadataToJson(const Metadata& m);
// `path` names the file in errors.
absl::StatusOr<Metadata> MetadataFromJson(const std::string& text,
                                          const std::string& path);
std::string ShardIndexToJson(const ShardIndex& index);
absl::StatusOr<ShardIndex> ShardIndexFromJson(const std::string& text,
                                              const std::string& path);

// Checks that `m` is self-consistent: known dtypes, chunks inside their files,
// block checksums counted right, every tensor's rows covered exactly once.
// Errors name `path` and the tensor.
absl::Status ValidateMetadata(const Metadata& m, const std::string& path);

}  // namespace hsdp::ckpt

#endif  // HSDP_WORKER_CKPT_FORMAT_H_
