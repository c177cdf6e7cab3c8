#include "worker/train/worker_mesh.h"

#include <ATen/ATen.h>
#include <glog/logging.h>

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_util.h"
#include "worker/comm/gloo/gloo_communicator.h"
#if defined(HSDP_WITH_NCCL)
#include "worker/comm/nccl/nccl_communicator.h"
#endif

namespace hsdp::train {

absl::StatusOr<std::unique_ptr<comm::DeviceMesh>> BuildWorkerMesh(
    const WorkerOptions& o, const comm::MeshShape& shape, int rank,
    comm::Store& store, const c10::Device& device, const std::string& host_id) {
  if (device.is_cuda()) {
#if defined(HSDP_WITH_NCCL)
    comm::NcclOptions nccl;
    nccl.device = device.has_index() ? device.index() : 0;
    nccl.collective_timeout = o.collective_timeout;
    return comm::DeviceMesh::Create(shape, rank, "nccl",
                                    comm::NcclCommunicatorFactory(store, nccl),
                                    host_id);
#else
    return absl::FailedPreconditionError(
        absl::StrCat("--device ", o.device,
                     " needs NCCL, and this hsdp-worker was built without it"));
#endif
  }
  comm::GlooDeviceOptions dev;
  dev.hostname = o.gloo_hostname;
  dev.iface = o.gloo_iface;
  HSDP_ASSIGN_OR_RETURN(std::shared_ptr<gloo::transport::Device> gloo_device,
                        comm::CreateGlooDevice(dev));
  return comm::DeviceMesh::Create(
      shape, rank, "gloo",
      comm::GlooCommunicatorFactory(
          store, std::move(gloo_device), o.collective_timeout, o.shared_memory,
          [rank](const comm::GroupSpec& group, const std::string& why) {
            LOG(INFO) << "rank " << rank << ": the " << group.kind
                      << " group stays on Gloo TCP (no shared memory: " << why
                      << ")";
          }),
      host_id);
}

absl::StatusOr<double> MeshAverage(comm::DeviceMesh& mesh, double value,
                                   const c10::Device& device) {
  at::Tensor v = at::full(
      {1}, value, at::TensorOptions().dtype(at::kDouble).device(device));
  comm::Buffer buf{v.data_ptr(), 1, comm::DataType::kFloat64};
  HSDP_RETURN_IF_ERROR(
      mesh.shard().AllReduce(buf, comm::ReduceOp::kAvg)->Wait());
  HSDP_RETURN_IF_ERROR(
      mesh.replicate().AllReduce(buf, comm::ReduceOp::kAvg)->Wait());
  return v.item<double>();  // on CUDA this synchronises with the collective's
                            // stream order
}

absl::StatusOr<std::vector<double>> MeshGather(
    comm::DeviceMesh& mesh, const std::vector<double>& values,
    const c10::Device& device) {
  const int64_t per_rank = static_cast<int64_t>(values.size());
  const int shards = mesh.shard().size();
  const int64_t world = static_cast<int64_t>(shards) * mesh.replicate().size();
  const int64_t rank = static_cast<int64_t>(mesh.replicate().rank()) * shards +
                       mesh.shard().rank();
  at::Tensor all = at::zeros({world * per_rank}, at::kDouble);
  for (int64_t i = 0; i < per_rank; ++i) {
    all[rank * per_rank + i] = values[static_cast<size_t>(i)];
  }
  all = all.to(device);
  comm::Buffer buf{all.data_ptr(), all.numel(), comm::DataType::kFloat64};
  HSDP_RETURN_IF_ERROR(
      mesh.shard().AllReduce(buf, comm::ReduceOp::kSum)->Wait());
  HSDP_RETURN_IF_ERROR(
      mesh.replicate().AllReduce(buf, comm::ReduceOp::kSum)->Wait());
  const at::Tensor host = all.to(at::kCPU);
  const double* data = host.data_ptr<double>();
  return std::vector<double>(data, data + host.numel());
}

absl::Status CheckSameOnAllRanks(comm::DeviceMesh& mesh, double value,
                                 const c10::Device& device,
                                 const std::string& what) {
  HSDP_ASSIGN_OR_RETURN(const double mean, MeshAverage(mesh, value, device));
  HSDP_ASSIGN_OR_RETURN(const double mean_square,
                        MeshAverage(mesh, value * value, device));
  if (mean_square - mean * mean != 0.0) {
    return absl::FailedPreconditionError(
        absl::StrCat("ranks disagree on ", what, " (this rank has ", value,
                     ", the mean over ranks is ", mean, ")"));
  }
  return absl::OkStatus();
}

}  // namespace hsdp::train
