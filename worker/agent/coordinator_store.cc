#include "worker/agent/coordinator_store.h"

#include <utility>

namespace hsdp::agent {

CoordinatorStore::CoordinatorStore(Agent& agent, std::string prefix)
    : agent_(agent), prefix_(std::move(prefix)) {}

absl::Status CoordinatorStore::Set(const std::string& key,
                                   const std::string& value) {
  return agent_.StoreSet(Key(key), value);
}

absl::StatusOr<std::string> CoordinatorStore::Get(const std::string& key,
                                                  absl::Duration timeout) {
  return agent_.StoreGet(Key(key), timeout);
}

absl::Status CoordinatorStore::Wait(const std::vector<std::string>& keys,
                                    absl::Duration timeout) {
  std::vector<std::string> prefixed;
  prefixed.reserve(keys.size());
  for (const std::string& k : keys) prefixed.push_back(Key(k));
  return agent_.StoreWait(prefixed, timeout);
}

}  // namespace hsdp::agent
