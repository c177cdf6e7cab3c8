#include "hsdp/device_mesh.h"

#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "worker/comm/gloo/gloo_communicator.h"
#include "worker/comm/shm/shm_communicator.h"

namespace hsdp::comm {

namespace {

// Group `group_id` of `kind`: its store prefix is "<prefix>/<kind>/<group_id>".
GroupSpec MakeGroupSpec(const char* kind, const std::string& prefix,
                        int group_id, int rank_in_group,
                        std::vector<int> global_ranks) {
  GroupSpec group;
  group.kind = kind;
  group.prefix = absl::StrCat(prefix, "/", kind, "/", group_id);
  group.rank = rank_in_group;
  group.size = static_cast<int>(global_ranks.size());
  group.global_ranks = std::move(global_ranks);
  return group;
}

// A host group lies strictly inside a shard group of at least two runs of at
// least two ranks.
constexpr int kMinShardsForHostGroups = 4;

// FNV-1a: a hash of a host id that every process computes alike (absl::Hash
// is seeded per process).
uint64_t StableHash(const std::string& s) {
  uint64_t h = 14695981039346656037ull;
  for (const unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

// The run length of `shard`'s ranks on hosts: all-gathers each rank's host id
// hash over the group, then HostGroupSize of them.
absl::StatusOr<int> ShardGroupHostRun(Communicator& shard,
                                      const std::string& host_id) {
  uint64_t mine = StableHash(host_id);
  std::vector<uint64_t> all(static_cast<size_t>(shard.size()));
  absl::Status s =
      shard
          .AllGather(Buffer{&mine, 1, DataType::kInt64},
                     Buffer{all.data(), static_cast<int64_t>(all.size()),
                            DataType::kInt64})
          ->Wait();
  if (!s.ok()) {
    return absl::Status(
        s.code(), absl::StrCat("exchanging host ids over the shard group: ",
                               s.message()));
  }
  std::vector<std::string> hosts;
  for (const uint64_t h : all) hosts.push_back(absl::StrCat(h));
  return HostGroupSize(shard.size(), hosts);
}

}  // namespace

GroupSpec DeviceMesh::ShardGroup(const MeshShape& shape, int rank,
                                 const std::string& prefix) {
  const MeshCoord coord = RankToCoord(shape, rank);
  return MakeGroupSpec("shard", prefix, coord.replicate_index,
                       coord.shard_index, ShardGroupRanks(shape, rank));
}

GroupSpec DeviceMesh::ReplicateGroup(const MeshShape& shape, int rank,
                                     const std::string& prefix) {
  const MeshCoord coord = RankToCoord(shape, rank);
  return MakeGroupSpec("replicate", prefix, coord.shard_index,
                       coord.replicate_index, ReplicateGroupRanks(shape, rank));
}

GroupSpec DeviceMesh::HostGroup(const MeshShape& /*shape*/, int rank,
                                const std::string& prefix,
                                int host_group_size) {
  const int first = rank - rank % host_group_size;
  std::vector<int> ranks;
  for (int r = first; r < first + host_group_size; ++r) ranks.push_back(r);
  return MakeGroupSpec("host", prefix, rank / host_group_size,
                       rank % host_group_size, std::move(ranks));
}

DeviceMesh::DeviceMesh(MeshShape shape, int rank,
                       std::unique_ptr<Communicator> shard,
                       std::unique_ptr<Communicator> replicate,
                       std::unique_ptr<Communicator> host)
    : shape_(shape),
      rank_(rank),
      shard_(std::move(shard)),
      replicate_(std::move(replicate)),
      host_(std::move(host)) {}

absl::Status DeviceMesh::Abort(absl::string_view reason) const {
  // All at once: an Abort returns only when its running collective stopped,
  // and a collective of one group may wait on a peer that waits in another
  // group, so aborting one after the other could hold a later group's
  // waiter until its timeout.
  absl::Status replicate;
  absl::Status host;
  std::thread replicate_abort([&] { replicate = replicate_->Abort(reason); });
  std::thread host_abort([&] {
    if (host_ != nullptr) host = host_->Abort(reason);
  });
  const absl::Status shard = shard_->Abort(reason);
  replicate_abort.join();
  host_abort.join();
  if (!shard.ok()) return shard;
  return replicate.ok() ? host : replicate;
}

absl::StatusOr<std::unique_ptr<DeviceMesh>> DeviceMesh::Create(
    const MeshShape& shape, int rank, const std::string& prefix,
    const CommunicatorFactory& factory, const std::string& host_id) {
  if (shape.replicate < 1 || shape.shard < 1 || rank < 0 ||
      rank >= shape.world_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " is outside the ", shape.replicate, "x",
                     shape.shard, " mesh"));
  }
  // Every rank creates its shard group first, then its replicate group: a
  // group's rendezvous only waits on members that are all doing the same step,
  // so no rank waits on another's later step.
  absl::StatusOr<std::unique_ptr<Communicator>> shard =
      factory(ShardGroup(shape, rank, prefix));
  if (!shard.ok()) return shard.status();
  absl::StatusOr<std::unique_ptr<Communicator>> replicate =
      factory(ReplicateGroup(shape, rank, prefix));
  if (!replicate.ok()) return replicate.status();
  int host_group_size = 0;
  if (!host_id.empty() && shape.shard >= kMinShardsForHostGroups) {
    absl::StatusOr<int> size = ShardGroupHostRun(**shard, host_id);
    if (!size.ok()) return size.status();
    host_group_size = *size;
  }
  std::unique_ptr<Communicator> host;
  if (host_group_size > 0) {
    absl::StatusOr<std::unique_ptr<Communicator>> made =
        factory(HostGroup(shape, rank, prefix, host_group_size));
    if (!made.ok()) return made.status();
    host = *std::move(made);
  }
  return std::unique_ptr<DeviceMesh>(new DeviceMesh(
      shape, rank, *std::move(shard), *std::move(replicate), std::move(host)));
}

CommunicatorFactory GlooCommunicatorFactory(
    Store& store, std::shared_ptr<gloo::transport::Device> device,
    absl::Duration timeout, bool shared_memory,
    std::function<void(const GroupSpec& group, const std::string& why)>
        on_tcp_only) {
  return [&store, device = std::move(device), timeout, shared_memory,
          on_tcp_only = std::move(on_tcp_only)](const GroupSpec& group)
             -> absl::StatusOr<std::unique_ptr<Communicator>> {
    GlooCommunicatorOptions options;
    options.name = absl::StrCat("gloo:", group.kind);
    options.timeout = timeout;
    absl::StatusOr<std::unique_ptr<GlooCommunicator>> comm =
        GlooCommunicator::Create(store, group.prefix, group.rank, group.size,
                                 device, options);
    if (!comm.ok()) return comm.status();
    std::unique_ptr<Communicator> gloo(*std::move(comm));
    if (!shared_memory) return gloo;
    ShmOptions shm;
    shm.timeout = timeout;
    std::string why;
    absl::StatusOr<std::unique_ptr<Communicator>> wrapped =
        ShmCommunicator::Wrap(store, group.prefix, std::move(gloo), shm, &why);
    if (wrapped.ok() && !why.empty() && group.size > 1 && on_tcp_only) {
      on_tcp_only(group, why);
    }
    return wrapped;
  };
}

absl::StatusOr<std::unique_ptr<DeviceMesh>> DeviceMesh::CreateGloo(
    const MeshShape& shape, int rank, Store& store, const std::string& prefix,
    const GlooDeviceOptions& device_options, absl::Duration timeout,
    bool shared_memory, const std::string& host_id) {
  absl::StatusOr<std::shared_ptr<gloo::transport::Device>> device =
      CreateGlooDevice(device_options);
  if (!device.ok()) return device.status();
  return Create(shape, rank, prefix,
                GlooCommunicatorFactory(store, *std::move(device), timeout,
                                        shared_memory),
                host_id);
}

}  // namespace hsdp::comm
