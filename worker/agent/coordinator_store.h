// hsdp::comm::Store backed by the coordinator's StoreSet/StoreGet/StoreWait
// RPCs, so communicators bootstrap through the control plane (no second
// rendezvous service). Keys are prefixed with the rendezvous prefix the
// coordinator handed out on Join; the coordinator scopes them by job and
// generation as well.
//
// Thread-safety: thread-safe (the Agent's RPC methods are).
#ifndef HSDP_WORKER_AGENT_COORDINATOR_STORE_H_
#define HSDP_WORKER_AGENT_COORDINATOR_STORE_H_

#include <string>
#include <vector>

#include "hsdp/store.h"
#include "worker/agent/agent.h"

namespace hsdp::agent {

class CoordinatorStore final : public comm::Store {
 public:
  // `agent` must have joined and must outlive the store.
  CoordinatorStore(Agent& agent, std::string prefix);
  CoordinatorStore(const CoordinatorStore&) = delete;
  CoordinatorStore& operator=(const CoordinatorStore&) = delete;

  absl::Status Set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::string> Get(const std::string& key,
                                  absl::Duration timeout) override;
  absl::Status Wait(const std::vector<std::string>& keys,
                    absl::Duration timeout) override;

 private:
  std::string Key(const std::string& key) const { return prefix_ + key; }

  Agent& agent_;
  const std::string prefix_;
};

}  // namespace hsdp::agent

#endif  // HSDP_WORKER_AGENT_COORDINATOR_STORE_H_
