// MeshShape <-> its wire form, hsdp.v1.Mesh. Kept apart from hsdp/mesh.h so
// that the public headers need no protobuf.
#ifndef HSDP_COMMON_MESH_PROTO_H_
#define HSDP_COMMON_MESH_PROTO_H_

#include "hsdp/mesh.h"
#include "hsdp/v1/common.pb.h"

namespace hsdp {

hsdp::v1::Mesh MeshToProto(const MeshShape& mesh);
MeshShape MeshFromProto(const hsdp::v1::Mesh& mesh);

}  // namespace hsdp

#endif  // HSDP_COMMON_MESH_PROTO_H_
