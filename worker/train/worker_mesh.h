// The communicators of one rank of a job, and the small mesh-wide agreements
// the runner makes over them.
#ifndef HSDP_WORKER_TRAIN_WORKER_MESH_H_
#define HSDP_WORKER_TRAIN_WORKER_MESH_H_

#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "hsdp/device_mesh.h"
#include "hsdp/runner.h"
#include "hsdp/store.h"

namespace hsdp::train {

// Gloo over TCP (shared memory between ranks of one host) for CPU ranks; NCCL
// (when built in) for CUDA ranks. Both bootstrap through `store`. With a
// `host_id`, the mesh finds its host group (DeviceMesh::Create).
absl::StatusOr<std::unique_ptr<comm::DeviceMesh>> BuildWorkerMesh(
    const WorkerOptions& options, const comm::MeshShape& shape, int rank,
    comm::Store& store, const c10::Device& device,
    const std::string& host_id = "");

// The mean of `value` over every rank of the mesh (shard group, then replicate
// group). A collective. The value travels on `device`: NCCL reduces device
// memory only.
absl::StatusOr<double> MeshAverage(comm::DeviceMesh& mesh, double value,
                                   const c10::Device& device);

// Every rank's `values` (the same count on every rank), concatenated in
// global rank order (replicate index × shard size + shard index). A
// collective: a sum over the mesh of vectors that are zero but for each rank's
// own slice, so the values arrive exactly.
absl::StatusOr<std::vector<double>> MeshGather(
    comm::DeviceMesh& mesh, const std::vector<double>& values,
    const c10::Device& device);

// OK when every rank passed the same `value`; else FAILED_PRECONDITION with
// `what` and this rank's value. A collective (two MeshAverages: mean and mean
// square agree only when all values are equal).
absl::Status CheckSameOnAllRanks(comm::DeviceMesh& mesh, double value,
                                 const c10::Device& device,
                                 const std::string& what);

}  // namespace hsdp::train

#endif  // HSDP_WORKER_TRAIN_WORKER_MESH_H_
