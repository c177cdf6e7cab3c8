// DeviceMesh: the world of ranks as replicate × shard, with rank =
// replicate_index * shard + shard_index (the convention of hsdp/mesh.h, the
// same on both sides; "RxS" on command lines). Each rank gets two
// communicators:
//   shard group      the `shard` ranks with its replicate_index (FSDP
//                    all-gather/reduce-scatter);
//   replicate group  the `replicate` ranks with its shard_index (HSDP
//                    all-reduce).
// A group of size 1 still gets a communicator so the engine need not
// special-case it. Optionally a third:
//   host group       the run of consecutive ranks of its shard group that
//                    shares its host, where the shard group spans hosts in
//                    equal runs (hierarchical reshard gathers over it;
//                    fsdp::MeshComms::host).
#ifndef HSDP_DEVICE_MESH_H_
#define HSDP_DEVICE_MESH_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "hsdp/communicator.h"
#include "hsdp/gloo_options.h"
#include "hsdp/mesh.h"
#include "hsdp/store.h"

namespace gloo::transport {
class Device;
}  // namespace gloo::transport

namespace hsdp::comm {

// The mesh type and its arithmetic (ParseMesh, RankToCoord, ...), shared with
// the coordinator, live in hsdp/mesh.h.
using MeshShape = ::hsdp::MeshShape;

// One communication group as the factory sees it.
struct GroupSpec {
  std::string kind;    // "shard", "replicate" or "host"
  std::string prefix;  // store prefix, distinct per group
  int rank = 0;        // this rank's index within the group
  int size = 1;        // group size
  std::vector<int>
      global_ranks;  // world ranks of the group, in group-rank order
};

// Creates the communicator of one group for this rank (Gloo, NCCL, ...). Called
// for the shard group first, then the replicate group, then (where there is
// one) the host group, on every rank in the same order.
using CommunicatorFactory =
    std::function<absl::StatusOr<std::unique_ptr<Communicator>>(
        const GroupSpec& group)>;

// A factory building GlooCommunicators through `store` on one shared tcp
// device; errors and name() read "gloo:shard" / "gloo:replicate". With
// `shared_memory`, each group whose ranks can all map one shared region (one
// host, one IPC namespace) is wrapped in a ShmCommunicator ("shm+gloo:shard").
// `store` must outlive the factory calls.
// `on_tcp_only` (optional) hears why a group of two or more ranks stays on
// Gloo TCP when shared memory was asked for.
CommunicatorFactory GlooCommunicatorFactory(
    Store& store, std::shared_ptr<gloo::transport::Device> device,
    absl::Duration timeout, bool shared_memory = true,
    std::function<void(const GroupSpec& group, const std::string& why)>
        on_tcp_only = nullptr);

// Immutable after Create; the communicators follow the Communicator
// thread-safety rules (Abort may come from any thread).
class DeviceMesh {
 public:
  // Builds this rank's groups with `factory`; group prefixes are
  // "<prefix>/shard/<replicate index>" and "<prefix>/replicate/<shard index>".
  // With a `host_id` (the host this rank runs on, as it reports it to the
  // coordinator) and a shard group of four or more ranks, the shard group
  // all-gathers a hash of each rank's host id once it is built; where its
  // ranks lie on hosts in equal runs (HostGroupSize, hsdp/mesh.h) each run
  // gets a host group, prefix "<prefix>/host/<rank / run length>". One
  // small collective per mesh; the coordinator finds the same runs from the
  // same host ids.
  static absl::StatusOr<std::unique_ptr<DeviceMesh>> Create(
      const MeshShape& shape, int rank, const std::string& prefix,
      const CommunicatorFactory& factory, const std::string& host_id = "");
  // Convenience: a Gloo mesh with its own tcp device.
  static absl::StatusOr<std::unique_ptr<DeviceMesh>> CreateGloo(
      const MeshShape& shape, int rank, Store& store, const std::string& prefix,
      const GlooDeviceOptions& device_options, absl::Duration timeout,
      bool shared_memory = true, const std::string& host_id = "");

  DeviceMesh(const DeviceMesh&) = delete;
  DeviceMesh& operator=(const DeviceMesh&) = delete;

  const MeshShape& shape() const { return shape_; }
  int rank() const { return rank_; }
  int world_size() const { return shape_.world_size(); }
  int replicate_index() const {
    return RankToCoord(shape_, rank_).replicate_index;
  }
  int shard_index() const { return RankToCoord(shape_, rank_).shard_index; }

  Communicator& shard() const { return *shard_; }
  Communicator& replicate() const { return *replicate_; }
  // The host group; null when there is none.
  Communicator* host() const { return host_.get(); }

  // Aborts every communicator at once (Communicator::Abort), from any thread:
  // the collectives of this mesh that are running or issued later fail with
  // ABORTED. Returns the first error. The mesh is dead afterwards: destroy it
  // and create the next generation's under a new prefix (any shape; in the
  // same process, on the same or a new Gloo device).
  absl::Status Abort(absl::string_view reason) const;

  // The group specs this rank belongs to (also what the factory received).
  static GroupSpec ShardGroup(const MeshShape& shape, int rank,
                              const std::string& prefix);
  static GroupSpec ReplicateGroup(const MeshShape& shape, int rank,
                                  const std::string& prefix);
  static GroupSpec HostGroup(const MeshShape& shape, int rank,
                             const std::string& prefix, int host_group_size);

 private:
  DeviceMesh(MeshShape shape, int rank, std::unique_ptr<Communicator> shard,
             std::unique_ptr<Communicator> replicate,
             std::unique_ptr<Communicator> host);

  const MeshShape shape_;
  const int rank_;
  // Destroyed in reverse of creation: host, replicate, shard.
  std::unique_ptr<Communicator> shard_;
  std::unique_ptr<Communicator> replicate_;
  std::unique_ptr<Communicator> host_;
};

}  // namespace hsdp::comm

#endif  // HSDP_DEVICE_MESH_H_
