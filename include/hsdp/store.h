// Rendezvous key-value store used to bootstrap communicators (Gloo addresses,
// NCCL unique ids).
//
// Implementations: InMemoryStore (tests, ranks as threads) and, in
// worker/agent, a store backed by the coordinator's StoreSet/StoreGet/StoreWait
// RPCs. Thread-safe: all methods may be called concurrently.
#ifndef HSDP_STORE_H_
#define HSDP_STORE_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace hsdp::comm {

class Store {
 public:
  virtual ~Store() = default;
  virtual absl::Status Set(const std::string& key,
                           const std::string& value) = 0;
  // Blocks until `key` exists; DEADLINE_EXCEEDED naming the key after
  // `timeout`.
  virtual absl::StatusOr<std::string> Get(const std::string& key,
                                          absl::Duration timeout) = 0;
  // Blocks until every key exists; DEADLINE_EXCEEDED naming the missing keys
  // after `timeout`.
  virtual absl::Status Wait(const std::vector<std::string>& keys,
                            absl::Duration timeout) = 0;
};

}  // namespace hsdp::comm

#endif  // HSDP_STORE_H_
