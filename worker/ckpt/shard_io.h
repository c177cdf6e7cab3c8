// Reading and writing the bytes of a v1 checkpoint (format.h): one writer's
// shard file and its index, the metadata published last, and reads of any row
// range of any tensor with its blocks' checksums verified.
//
// Thread-compatible: a RowReader belongs to one thread; the free functions
// touch only the files they are given.
#ifndef HSDP_WORKER_CKPT_SHARD_IO_H_
#define HSDP_WORKER_CKPT_SHARD_IO_H_

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/ckpt/format.h"

namespace hsdp::ckpt {

// One rank's rows of one global tensor: `tensor` holds rows [row_offset,
// row_offset + n) of a tensor of `global_shape`, rows being the slices along
// `shard_dim` (n = tensor.size(shard_dim); 0 rows is fine). `tensor` is in
// the global tensor's orientation, any strides. A 0-dim tensor is one row.
struct LocalTensor {
  std::string name;
  at::Tensor tensor;
  std::vector<int64_t> global_shape;
  int64_t row_offset = 0;
  int64_t shard_dim = 0;
};

std::string DtypeName(c10::ScalarType type);
absl::StatusOr<c10::ScalarType> ScalarTypeOf(const std::string& dtype);

// Writes `tensors` (CPU tensors) as `file_name` in `step_dir`, then
// its index (ShardIndexName), both atomically: the index appears only after
// the data file is durable. Returns the index.
absl::StatusOr<ShardIndex> WriteShardFile(
    const std::string& step_dir, const std::string& file_name,
    const std::vector<LocalTensor>& tensors,
    const std::map<std::string, int64_t>& optimizer_steps);

// Waits (up to `timeout`) for the index of every one of `shard_files` shard
// files, merges them into `base` (files, tensors, optimizer steps), checks the
// result and writes metadata.json atomically. DEADLINE_EXCEEDED naming the
// missing file when a writer never finished, CANCELLED when `cancelled` turns
// true while waiting: then no metadata is written.
absl::Status PublishMetadata(const std::string& step_dir, Metadata base,
                             int shard_files, absl::Duration timeout,
                             const std::atomic<bool>* cancelled = nullptr);

// Parses and checks step_dir/metadata.json.
absl::StatusOr<Metadata> ReadMetadata(const std::string& step_dir);

struct ReadStats {
  int64_t bytes_read = 0;    // read from files (whole blocks)
  int64_t bytes_needed = 0;  // the rows asked for
};

// Fills local tensors from a checkpoint, reading only the blocks that overlap
// their rows, through one reusable buffer (one block). Every block read is
// checked against its CRC-32C.
class RowReader {
 public:
  RowReader(std::string step_dir, const Metadata& metadata);
  ~RowReader();
  RowReader(const RowReader&) = delete;
  RowReader& operator=(const RowReader&) = delete;

  // Copies rows [row_offset, row_offset + rows) of the tensor named
  // target.name into target.tensor (any device). Rows along a shard dim
  // other than the checkpoint's are cut from the whole tensor, which is read
  // for it. Errors name the file and the tensor: missing, truncated, checksum
  // mismatch, shape or dtype mismatch.
  absl::Status Read(const LocalTensor& target);
  const ReadStats& stats() const { return stats_; }

 private:
  absl::StatusOr<int> Open(const std::string& file, const TensorEntry& tensor);
  // Rows [begin, begin + frame.size(0)) of `e` in its row frame into `frame`
  // (a contiguous CPU tensor of the frame's shape with that many rows).
  absl::Status ReadRows(const TensorEntry& e, int64_t begin,
                        const at::Tensor& frame);

  std::string step_dir_;
  const Metadata& metadata_;
  std::map<std::string, const TensorEntry*> by_name_;
  std::map<std::string, int64_t> file_bytes_;
  std::map<std::string, int> fds_;
  std::vector<char> buffer_;
  ReadStats stats_;
};

// Reads every block of every tensor and checks sizes and checksums. The first
// problem, naming file and tensor.
absl::Status VerifyCheckpoint(const std::string& step_dir,
                              const Metadata& metadata);

// The newest checkpoint under `root`: the newest step directory with a
// metadata.json. Directories passed over (no metadata: an interrupted save)
// are listed in `skipped` as one-line reasons. step -1 when there is none.
// FAILED_PRECONDITION when the only checkpoints are of the pre-v1 per-rank
// .pt format.
struct FoundCheckpoint {
  int64_t step = -1;
  std::string dir;
  std::vector<std::string> skipped;
};
absl::StatusOr<FoundCheckpoint> FindLatestCheckpoint(const std::string& root);

// Complete checkpoints (with metadata) under `root`, oldest first.
std::vector<int64_t> CompleteCheckpointSteps(const std::string& root);

}  // namespace hsdp::ckpt

#endif  // HSDP_WORKER_CKPT_SHARD_IO_H_
