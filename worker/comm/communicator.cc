#include "worker/comm/communicator.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace hsdp::comm {
namespace {

// A Work that finished before it was returned (argument errors, unsupported
// calls).
class CompletedWork final : public Work {
 public:
  explicit CompletedWork(absl::Status status) : status_(std::move(status)) {}
  absl::Status Wait() override { return status_; }
  bool IsCompleted() override { return true; }
  double ElapsedSeconds() const override { return 0; }

 private:
  const absl::Status status_;
};

std::unique_ptr<Work> Unsupported(const Communicator& comm, const char* what) {
  return std::make_unique<CompletedWork>(absl::UnimplementedError(
      absl::StrCat(what, " is not supported by ", comm.name())));
}

}  // namespace

std::unique_ptr<Work> Communicator::AllGatherSegments(
    const std::vector<Buffer>&, const std::vector<std::vector<Buffer>>&) {
  return Unsupported(*this, "AllGatherSegments");
}

std::unique_ptr<Work> Communicator::ReduceScatterSegments(
    const std::vector<std::vector<Buffer>>&, const std::vector<Buffer>&,
    const Buffer&, ReduceOp) {
  return Unsupported(*this, "ReduceScatterSegments");
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
