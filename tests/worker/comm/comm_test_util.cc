#include "tests/worker/comm/comm_test_util.h"

#include <cstdint>

#include "gtest/gtest.h"
#include "worker/comm/shm/shm_communicator.h"

namespace hsdp::comm::testing {

std::vector<std::unique_ptr<GlooCommunicator>> MakeGroup(
    Store& store, const std::string& prefix, int world, absl::Duration timeout,
    size_t pack_below_bytes) {
  std::vector<std::unique_ptr<GlooCommunicator>> comms(world);
  RunOnRanks(world, [&](int rank) {
    absl::StatusOr<std::unique_ptr<GlooCommunicator>> comm =
        MakeGloo(store, prefix, rank, world, timeout, pack_below_bytes);
    ASSERT_TRUE(comm.ok()) << comm.status();
    comms[rank] = *std::move(comm);
  });
  return comms;
}

std::vector<std::unique_ptr<Communicator>> MakeBackendGroup(
    const std::string& backend, Store& store, const std::string& prefix,
    int world, absl::Duration timeout) {
  size_t pack_below_bytes = kGlooPackBelowBytes;
  if (backend == "gloo_unpacked") pack_below_bytes = 0;
  if (backend == "gloo_packed") pack_below_bytes = SIZE_MAX;
  std::vector<std::unique_ptr<GlooCommunicator>> gloo =
      MakeGroup(store, prefix, world, timeout, pack_below_bytes);
  std::vector<std::unique_ptr<Communicator>> comms(world);
  if (backend != "shm" || gloo.size() != static_cast<size_t>(world)) {
    for (int r = 0; r < static_cast<int>(gloo.size()); ++r)
      comms[r] = std::move(gloo[r]);
    return comms;
  }
  ShmOptions options;
  options.timeout = timeout;
  RunOnRanks(world, [&](int rank) {
    std::string reason;
    absl::StatusOr<std::unique_ptr<Communicator>> comm = ShmCommunicator::Wrap(
        store, prefix, std::move(gloo[rank]), options, &reason);
    ASSERT_TRUE(comm.ok()) << comm.status();
    if (world > 1) {
      EXPECT_EQ((*comm)->name().rfind("shm+", 0), 0u)
          << (*comm)->name() << ": " << reason;
    }
    comms[rank] = *std::move(comm);
  });
  return comms;
}

}  // namespace hsdp::comm::testing
