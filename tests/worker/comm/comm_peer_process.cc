// A rank in its own process, for the kill tests of abort_test.cc: joins a
// group through a FileStore, runs one collective with the parent, prints
// "ready", then sleeps until it is killed (it never issues the parent's next
// collective).
//
// Usage: comm_peer_process STORE_DIR PREFIX RANK WORLD BACKEND OP
//   BACKEND: gloo | shm      OP: allreduce | segments
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>

#include "tests/worker/comm/kill_test_ops.h"
#include "worker/comm/gloo/gloo_communicator.h"
#include "worker/comm/shm/shm_communicator.h"
#include "worker/comm/store/file_store.h"

int main(int argc, char** argv) {
  using namespace hsdp::comm;
  if (argc != 7) {
    std::cerr << "usage: comm_peer_process STORE_DIR PREFIX RANK WORLD "
                 "BACKEND OP\n";
    return 2;
  }
  const std::string dir = argv[1], prefix = argv[2], backend = argv[5],
                    op = argv[6];
  const int rank = std::atoi(argv[3]), world = std::atoi(argv[4]);
  absl::StatusOr<FileStore> store = FileStore::Open(dir);
  if (!store.ok()) {
    std::cerr << store.status() << "\n";
    return 1;
  }
  absl::StatusOr<std::unique_ptr<Communicator>> comm =
      testing::MakeKillTestCommunicator(*store, prefix, rank, world, backend);
  if (!comm.ok()) {
    std::cerr << comm.status() << "\n";
    return 1;
  }
  testing::KillTestBuffers buffers(world);
  if (absl::Status s = testing::RunKillTestOp(**comm, op, buffers); !s.ok()) {
    std::cerr << s << "\n";
    return 1;
  }
  std::cout << "ready" << std::endl;
  for (;;) pause();
}
