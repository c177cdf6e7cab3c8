#include "hsdp/communicator.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_util.h"

namespace hsdp::comm {
namespace {

class DoneWork final : public Work {
 public:
  explicit DoneWork(absl::Status status) : status_(std::move(status)) {}
  absl::Status Wait() override { return status_; }
  bool IsCompleted() override { return true; }
  double ElapsedSeconds() const override { return 0; }

 private:
  const absl::Status status_;
};

std::unique_ptr<Work> Unsupported(const Communicator& comm, const char* what) {
  return CompletedWork(absl::UnimplementedError(
      absl::StrCat(what, " is not supported by ", comm.name())));
}

absl::Status CheckSegmentLists(const std::string& where,
                               const std::vector<Buffer>& reference,
                               const std::vector<std::vector<Buffer>>& lists,
                               int size, bool same_counts) {
  if (lists.size() != static_cast<size_t>(size)) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": needs one segment list per rank (", size,
                     "), got ", lists.size()));
  }
  for (size_t r = 0; r < lists.size(); ++r) {
    if (lists[r].size() != reference.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": rank ", r, "'s list has ", lists[r].size(),
                       " segments, expected ", reference.size()));
    }
    for (size_t k = 0; k < reference.size(); ++k) {
      const Buffer& b = lists[r][k];
      if (b.dtype != reference[k].dtype || b.count < 0 ||
          (same_counts && b.count != reference[k].count) ||
          (b.count > 0 && b.data == nullptr)) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": segment ", k, " for rank ", r, " (", b.count, " ",
            DataTypeName(b.dtype), ") does not match (", reference[k].count,
            " ", DataTypeName(reference[k].dtype), ")"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

std::unique_ptr<Work> CompletedWork(absl::Status status) {
  return std::make_unique<DoneWork>(std::move(status));
}

int64_t TotalCount(const std::vector<Buffer>& segments) {
  int64_t total = 0;
  for (const Buffer& b : segments) total += b.count;
  return total;
}

size_t TotalBytes(const std::vector<Buffer>& segments) {
  size_t total = 0;
  for (const Buffer& b : segments) total += b.bytes();
  return total;
}

absl::Status CheckAllGatherSegments(
    const std::string& where, const std::vector<Buffer>& inputs,
    const std::vector<std::vector<Buffer>>& outputs, int size) {
  return CheckSegmentLists(where, inputs, outputs, size, /*same_counts=*/true);
}

absl::Status CheckReduceScatterSegments(
    const std::string& where, const std::vector<std::vector<Buffer>>& inputs,
    const std::vector<Buffer>& outputs, int rank, int size) {
  // Contributions to a peer have that peer's counts, which only it knows; ours
  // must match our outputs.
  HSDP_RETURN_IF_ERROR(
      CheckSegmentLists(where, outputs, inputs, size, /*same_counts=*/false));
  for (size_t k = 0; k < outputs.size(); ++k) {
    if (inputs[rank][k].count != outputs[k].count) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": this rank's input segment ", k, " has ",
          inputs[rank][k].count, " elements, its output ", outputs[k].count));
    }
  }
  return absl::OkStatus();
}

std::unique_ptr<Work> Communicator::AllGatherSegments(
    const std::vector<Buffer>&, const std::vector<std::vector<Buffer>>&) {
  return Unsupported(*this, "AllGatherSegments");
}

std::unique_ptr<Work> Communicator::ReduceScatterSegments(
    const std::vector<std::vector<Buffer>>&, const std::vector<Buffer>&,
    const Buffer&, ReduceOp) {
  return Unsupported(*this, "ReduceScatterSegments");
}

std::unique_ptr<Work> Communicator::SendRecv(const std::vector<PeerTransfer>&,
                                             const std::vector<PeerTransfer>&) {
  return Unsupported(*this, "SendRecv");
}

absl::Status Communicator::Abort(absl::string_view) {
  return absl::UnimplementedError(
      absl::StrCat("Abort is not supported by ", name()));
}

absl::Status CheckSendRecv(const std::string& where,
                           const std::vector<Communicator::PeerTransfer>& sends,
                           const std::vector<Communicator::PeerTransfer>& recvs,
                           int rank, int size) {
  for (const auto* list : {&sends, &recvs}) {
    const char* kind = list == &sends ? "send" : "receive";
    for (size_t i = 0; i < list->size(); ++i) {
      const Communicator::PeerTransfer& t = (*list)[i];
      if (t.peer < 0 || t.peer >= size || t.peer == rank) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": ", kind, " ", i, " names peer ", t.peer,
                         " (ranks are [0, ", size, "), this is ", rank, ")"));
      }
      for (size_t k = 0; k < t.buffers.size(); ++k) {
        const Buffer& b = t.buffers[k];
        if (b.count < 0 || (b.count > 0 && b.data == nullptr)) {
          return absl::InvalidArgumentError(absl::StrCat(
              where, ": ", kind, " ", i, " buffer ", k, " (", b.count, " ",
              DataTypeName(b.dtype), ") has no memory"));
        }
      }
    }
  }
  return absl::OkStatus();
}

size_t ElementSize(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32:
    case DataType::kInt32:
      return 4;
    case DataType::kFloat64:
    case DataType::kInt64:
      return 8;
    case DataType::kBFloat16:
    case DataType::kFloat16:
      return 2;
    case DataType::kUInt8:
      return 1;
  }
  return 0;
}

const char* DataTypeName(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32:
      return "float32";
    case DataType::kFloat64:
      return "float64";
    case DataType::kBFloat16:
      return "bfloat16";
    case DataType::kFloat16:
      return "float16";
    case DataType::kInt32:
      return "int32";
    case DataType::kInt64:
      return "int64";
    case DataType::kUInt8:
      return "uint8";
  }
  return "unknown";
}

}  // namespace hsdp::comm
