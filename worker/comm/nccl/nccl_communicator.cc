#include "worker/comm/nccl/nccl_communicator.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "worker/comm/nccl/nccl_comm_state.h"

namespace hsdp::comm {

// ---- Device-free helpers ----

absl::StatusOr<ncclDataType_t> ToNcclDataType(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32:
      return ncclFloat32;
    case DataType::kFloat64:
      return ncclFloat64;
    case DataType::kBFloat16:
      return ncclBfloat16;
    case DataType::kFloat16:
      return ncclFloat16;
    case DataType::kInt32:
      return ncclInt32;
    case DataType::kInt64:
      return ncclInt64;
    case DataType::kUInt8:
      return ncclUint8;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("no NCCL type for DataType ", static_cast<int>(dtype)));
}

ncclRedOp_t ToNcclRedOp(ReduceOp op) {
  return op == ReduceOp::kAvg ? ncclAvg : ncclSum;
}

std::string EncodeUniqueId(const ncclUniqueId& id) {
  return std::string(id.internal, sizeof(id.internal));
}

absl::StatusOr<ncclUniqueId> DecodeUniqueId(absl::string_view bytes) {
  ncclUniqueId id;
  if (bytes.size() != sizeof(id.internal)) {
    return absl::InvalidArgumentError(
        absl::StrCat("NCCL unique id must be ", sizeof(id.internal),
                     " bytes, got ", bytes.size()));
  }
  std::memcpy(id.internal, bytes.data(), bytes.size());
  return id;
}

// ---- NcclCommunicator ----

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(
    Store& store, const std::string& store_key, int rank, int size,
    NcclOptions options) {
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(
        absl::StrFormat("NCCL communicator %s: rank %d outside [0, %d)",
                        options.name, rank, size));
  }
  absl::StatusOr<int> devices = CudaDeviceCount();
  if (!devices.ok()) {
    return absl::Status(devices.status().code(),
                        absl::StrCat("NCCL communicator ", options.name, ": ",
                                     devices.status().message()));
  }
  if (options.device < 0 || options.device >= *devices) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "NCCL communicator %s: cuda:%d does not exist (%d devices)",
        options.name, options.device, *devices));
  }

  ncclUniqueId id;
  if (rank == 0) {
    DeviceGuard guard(options.device);
    if (absl::Status s =
            NcclResultToStatus(ncclGetUniqueId(&id), "ncclGetUniqueId");
        !s.ok()) {
      return s;
    }
    if (absl::Status s = store.Set(store_key, EncodeUniqueId(id)); !s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat("publishing the NCCL unique id of ",
                                       options.name, ": ", s.message()));
    }
  } else {
    absl::StatusOr<std::string> bytes =
        store.Get(store_key, options.init_timeout);
    if (!bytes.ok()) {
      return absl::Status(
          bytes.status().code(),
          absl::StrCat("waiting for rank 0's NCCL unique id of ", options.name,
                       ": ", bytes.status().message()));
    }
    absl::StatusOr<ncclUniqueId> decoded = DecodeUniqueId(*bytes);
    if (!decoded.ok()) return decoded.status();
    id = *decoded;
  }

  auto state = std::make_shared<NcclCommState>(rank, size, std::move(options));
  if (absl::Status s = state->InitResources(); !s.ok()) return s;
  if (absl::Status s = state->InitComm(id, store_key); !s.ok()) return s;
  state->StartWatchdog();
  return std::unique_ptr<NcclCommunicator>(
      new NcclCommunicator(std::move(state)));
}

NcclCommunicator::NcclCommunicator(std::shared_ptr<NcclCommState> state)
    : state_(std::move(state)) {}

NcclCommunicator::~NcclCommunicator() { state_->Destroy(); }

int NcclCommunicator::rank() const { return state_->rank(); }
int NcclCommunicator::size() const { return state_->size(); }
std::string NcclCommunicator::name() const { return state_->options().name; }
cudaStream_t NcclCommunicator::param_stream() const {
  return state_->stream(NcclCommState::StreamKind::kParam);
}
cudaStream_t NcclCommunicator::grad_stream() const {
  return state_->stream(NcclCommState::StreamKind::kGrad);
}
absl::Status NcclCommunicator::Synchronize(absl::Duration timeout) {
  return state_->Synchronize(timeout);
}
void NcclCommunicator::Abort(const absl::Status& reason) {
  state_->Abort(reason);
}
absl::Status NcclCommunicator::Abort(absl::string_view reason) {
  state_->Abort(absl::AbortedError(reason));
  return absl::OkStatus();
}
absl::Status NcclCommunicator::status() const { return state_->status(); }

namespace {
std::string Describe(NcclCommState& state, absl::string_view op,
                     const Buffer& buffer) {
  return absl::StrFormat("%s #%d on %s (%d x %s)", op, state.NextSequence(),
                         state.label(), buffer.count,
                         DataTypeName(buffer.dtype));
}

// The NCCL type of a collective's buffers; INVALID_ARGUMENT naming `what` when
// `sized` differs from `reference` in dtype or is not `expected_count` long.
absl::StatusOr<ncclDataType_t> CheckedType(const std::string& what,
                                           const Buffer& reference,
                                           const Buffer& sized,
                                           int64_t expected_count,
                                           absl::string_view role) {
  if (reference.dtype != sized.dtype || sized.count != expected_count) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: %s must be %d x %s, got %d x %s", what, role, expected_count,
        DataTypeName(reference.dtype), sized.count, DataTypeName(sized.dtype)));
  }
  absl::StatusOr<ncclDataType_t> type = ToNcclDataType(reference.dtype);
  if (!type.ok()) {
    return absl::Status(type.status().code(),
                        absl::StrCat(what, ": ", type.status().message()));
  }
  return type;
}
}  // namespace

std::unique_ptr<Work> NcclCommunicator::AllGather(const Buffer& input,
                                                  const Buffer& output) {
  std::string what = Describe(*state_, "all_gather", input);
  absl::StatusOr<ncclDataType_t> type =
      CheckedType(what, input, output, input.count * size(), "output");
  if (!type.ok()) return CompletedWork(type.status());
  return state_->Issue(NcclCommState::StreamKind::kParam, std::move(what),
                       [&](ncclComm_t comm, cudaStream_t stream) {
                         return ncclAllGather(input.data, output.data,
                                              input.count, *type, comm, stream);
                       });
}

std::unique_ptr<Work> NcclCommunicator::ReduceScatter(const Buffer& input,
                                                      const Buffer& output,
                                                      ReduceOp op) {
  std::string what = Describe(*state_, "reduce_scatter", input);
  absl::StatusOr<ncclDataType_t> type =
      CheckedType(what, output, input, output.count * size(), "input");
  if (!type.ok()) return CompletedWork(type.status());
  return state_->Issue(NcclCommState::StreamKind::kGrad, std::move(what),
                       [&](ncclComm_t comm, cudaStream_t stream) {
                         return ncclReduceScatter(
                             input.data, output.data, output.count, *type,
                             ToNcclRedOp(op), comm, stream);
                       });
}

std::unique_ptr<Work> NcclCommunicator::AllReduce(const Buffer& buffer,
                                                  ReduceOp op) {
  std::string what = Describe(*state_, "all_reduce", buffer);
  absl::StatusOr<ncclDataType_t> type =
      CheckedType(what, buffer, buffer, buffer.count, "buffer");
  if (!type.ok()) return CompletedWork(type.status());
  return state_->Issue(NcclCommState::StreamKind::kGrad, std::move(what),
                       [&](ncclComm_t comm, cudaStream_t stream) {
                         return ncclAllReduce(buffer.data, buffer.data,
                                              buffer.count, *type,
                                              ToNcclRedOp(op), comm, stream);
                       });
}

std::unique_ptr<Work> NcclCommunicator::Broadcast(const Buffer& buffer,
                                                  int root) {
  std::string what =
      Describe(*state_, absl::StrCat("broadcast(root ", root, ")"), buffer);
  absl::StatusOr<ncclDataType_t> type =
      CheckedType(what, buffer, buffer, buffer.count, "buffer");
  if (!type.ok()) return CompletedWork(type.status());
  if (root < 0 || root >= size()) {
    return CompletedWork(absl::InvalidArgumentError(
        absl::StrCat(what, ": root outside [0, ", size(), ")")));
  }
  return state_->Issue(NcclCommState::StreamKind::kParam, std::move(what),
                       [&](ncclComm_t comm, cudaStream_t stream) {
                         return ncclBroadcast(buffer.data, buffer.data,
                                              buffer.count, *type, root, comm,
                                              stream);
                       });
}

std::unique_ptr<Work> NcclCommunicator::Barrier() {
  // A one-element all-reduce on a private scratch value: orders the compute
  // stream after every rank reached this point. Use Synchronize() after Wait()
  // for a CPU-side barrier.
  Buffer scratch{state_->barrier_scratch(), 1, DataType::kFloat32};
  std::string what = Describe(*state_, "barrier", scratch);
  return state_->Issue(NcclCommState::StreamKind::kGrad, std::move(what),
                       [&](ncclComm_t comm, cudaStream_t stream) {
                         return ncclAllReduce(scratch.data, scratch.data, 1,
                                              ncclFloat32, ncclSum, comm,
                                              stream);
                       });
}

CommunicatorFactory NcclCommunicatorFactory(Store& store,
                                            NcclOptions base_options) {
  return [&store, base_options](const GroupSpec& group)
             -> absl::StatusOr<std::unique_ptr<Communicator>> {
    NcclOptions options = base_options;
    options.name = absl::StrCat(base_options.name, ":", group.kind);
    absl::StatusOr<std::unique_ptr<NcclCommunicator>> comm =
        NcclCommunicator::Create(store,
                                 absl::StrCat(group.prefix, "/nccl_unique_id"),
                                 group.rank, group.size, std::move(options));
    if (!comm.ok()) return comm.status();
    return std::unique_ptr<Communicator>(std::move(*comm));
  };
}

}  // namespace hsdp::comm
