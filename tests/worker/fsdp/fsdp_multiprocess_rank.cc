// One rank of fsdp_multiprocess_test, as its own process: joins the mesh
// through a FileStore, trains the tiny test model with the engine and writes
// its per-step losses (and, on rank 0, the final full parameters) to a file.
//
// Usage: fsdp_multiprocess_rank STORE_DIR RANK REPLICATE SHARD SEED OUT_FILE
// Exit codes: 0 ok, 1 a failure (reason on stderr), 2 bad arguments.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <iostream>
#include <string>

#include "hsdp/device_mesh.h"
#include "tests/worker/fsdp/fsdp_test_util.h"
#include "worker/comm/store/file_store.h"

namespace hsdp::fsdp::testing {
namespace {

// Bounds the rendezvous and each collective: a missing peer ends the run with
// an error instead of a hang.
constexpr absl::Duration kCollectiveTimeout = absl::Seconds(60);
constexpr int kNumArgs = 7;

// Text format read by fsdp_multiprocess_test: "loss V" lines, then for each
// parameter "param NAME NUMEL" followed by NUMEL values. %.17g / %.9g
// round-trip doubles / floats exactly.
bool WriteResult(const RunResult& result, const std::string& path) {
  const std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "w");
  if (f == nullptr) return false;
  for (double loss : result.losses) std::fprintf(f, "loss %.17g\n", loss);
  for (const auto& [name, tensor] : result.params) {
    const at::Tensor flat = tensor.to(torch::kFloat).contiguous().reshape(-1);
    std::fprintf(f, "param %s %lld\n", name.c_str(),
                 static_cast<long long>(flat.numel()));
    const float* data = flat.data_ptr<float>();
    for (int64_t i = 0; i < flat.numel(); ++i)
      std::fprintf(f, "%.9g\n", data[i]);
  }
  const bool ok = std::fclose(f) == 0;
  return ok && std::rename(tmp.c_str(), path.c_str()) == 0;
}

int Run(int argc, char** argv) {
  if (argc != kNumArgs) {
    std::cerr << "usage: " << argv[0]
              << " STORE_DIR RANK REPLICATE SHARD SEED OUT_FILE\n";
    return 2;
  }
  const std::string store_dir = argv[1];
  const int rank = std::atoi(argv[2]);
  const comm::MeshShape shape{std::atoi(argv[3]), std::atoi(argv[4])};
  const uint64_t seed = std::strtoull(argv[5], nullptr, 10);
  const std::string out = argv[6];
  at::set_num_threads(1);

  absl::StatusOr<comm::FileStore> store = comm::FileStore::Open(store_dir);
  if (!store.ok()) {
    std::cerr << "rank " << rank << ": " << store.status() << "\n";
    return 1;
  }
  comm::GlooDeviceOptions device;
  device.hostname = "127.0.0.1";
  absl::StatusOr<std::unique_ptr<comm::DeviceMesh>> mesh =
      comm::DeviceMesh::CreateGloo(shape, rank, *store, "mp", device,
                                   kCollectiveTimeout);
  if (!mesh.ok()) {
    std::cerr << "rank " << rank << ": " << mesh.status() << "\n";
    return 1;
  }
  RunConfig config;
  const StateDict init = MakeInitialState(config.dims, seed);
  const RunResult result =
      TrainSharded(MeshComms{&(*mesh)->shard(), &(*mesh)->replicate()}, rank,
                   shape.world_size(), init, config);
  // TrainSharded reports engine errors as GoogleTest failures; outside a test
  // they land in the ad-hoc result, which HasFailure() reads.
  if (::testing::Test::HasFailure()) {
    std::cerr << "rank " << rank << ": training failed\n";
    return 1;
  }
  if (!WriteResult(result, out)) {
    std::cerr << "rank " << rank << ": cannot write " << out << "\n";
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace hsdp::fsdp::testing

int main(int argc, char** argv) { return hsdp::fsdp::testing::Run(argc, argv); }
