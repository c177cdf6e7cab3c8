// The group and collective both sides of the process-kill tests use
// (abort_test.cc and its child, comm_peer_process.cc), so they always agree.
#ifndef HSDP_TESTS_WORKER_COMM_KILL_TEST_OPS_H_
#define HSDP_TESTS_WORKER_COMM_KILL_TEST_OPS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "hsdp/store.h"
#include "tests/worker/comm/comm_test_util.h"
#include "worker/comm/gloo/gloo_communicator.h"
#include "worker/comm/shm/shm_communicator.h"

namespace hsdp::comm::testing {

// Long enough that a failure within seconds can only come from noticing the
// dead peer, never from the timeout.
inline constexpr absl::Duration kKillTestTimeout = absl::Seconds(60);
inline constexpr int64_t kKillTestElements = 1 << 14;

// Rank `rank`'s communicator: Gloo on a loopback device, wrapped in
// ShmCommunicator for `backend` "shm".
inline absl::StatusOr<std::unique_ptr<Communicator>> MakeKillTestCommunicator(
    Store& store, const std::string& prefix, int rank, int world,
    const std::string& backend) {
  absl::StatusOr<std::unique_ptr<GlooCommunicator>> gloo =
      MakeGloo(store, prefix, rank, world, kKillTestTimeout);
  if (!gloo.ok()) return gloo.status();
  std::unique_ptr<Communicator> comm = *std::move(gloo);
  if (backend != "shm") return comm;
  ShmOptions shm;
  shm.timeout = kKillTestTimeout;
  return ShmCommunicator::Wrap(store, prefix, std::move(comm), shm);
}

// Buffers of the test collectives (kept alive across calls).
struct KillTestBuffers {
  explicit KillTestBuffers(int world)
      : input(kKillTestElements, 1.0f),
        output(static_cast<size_t>(world),
               std::vector<float>(kKillTestElements)) {}
  std::vector<float> input;
  std::vector<std::vector<float>> output;
};

// Issues one collective and waits: "allreduce" (Gloo's own algorithm) or
// "segments" (AllGatherSegments: the engine's unit all-gather; the shared-
// memory path under "shm").
inline absl::Status RunKillTestOp(Communicator& comm, const std::string& op,
                                  KillTestBuffers& b) {
  if (op == "allreduce") {
    return comm
        .AllReduce(
            Buffer{b.input.data(), kKillTestElements, DataType::kFloat32},
            ReduceOp::kSum)
        ->Wait();
  }
  std::vector<std::vector<Buffer>> outputs;
  for (auto& out : b.output) {
    outputs.push_back(
        {Buffer{out.data(), kKillTestElements, DataType::kFloat32}});
  }
  return comm
      .AllGatherSegments(
          {Buffer{b.input.data(), kKillTestElements, DataType::kFloat32}},
          outputs)
      ->Wait();
}

}  // namespace hsdp::comm::testing

#endif  // HSDP_TESTS_WORKER_COMM_KILL_TEST_OPS_H_
