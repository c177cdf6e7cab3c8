#include "common/mesh_proto.h"

namespace hsdp {

hsdp::v1::Mesh MeshToProto(const MeshShape& mesh) {
  hsdp::v1::Mesh proto;
  proto.set_replicate(mesh.replicate);
  proto.set_shard(mesh.shard);
  return proto;
}

MeshShape MeshFromProto(const hsdp::v1::Mesh& mesh) {
  return MeshShape{mesh.replicate(), mesh.shard()};
}

}  // namespace hsdp
