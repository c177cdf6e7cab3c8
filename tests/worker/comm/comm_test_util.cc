#include "tests/worker/comm/comm_test_util.h"

#include "gtest/gtest.h"

namespace hsdp::comm::testing {

std::vector<std::unique_ptr<GlooCommunicator>> MakeGroup(
    Store& store, const std::string& prefix, int world,
    absl::Duration timeout) {
  std::vector<std::unique_ptr<GlooCommunicator>> comms(world);
  RunOnRanks(world, [&](int rank) {
    absl::StatusOr<std::unique_ptr<GlooCommunicator>> comm =
        MakeGloo(store, prefix, rank, world, timeout);
    ASSERT_TRUE(comm.ok()) << comm.status();
    comms[rank] = *std::move(comm);
  });
  return comms;
}

}  // namespace hsdp::comm::testing
