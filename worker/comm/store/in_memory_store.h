// An in-process rendezvous Store for tests and single-process multi-rank runs
// (ranks as threads).
#ifndef HSDP_WORKER_COMM_STORE_IN_MEMORY_STORE_H_
#define HSDP_WORKER_COMM_STORE_IN_MEMORY_STORE_H_

#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "hsdp/store.h"

namespace hsdp::comm {

// Thread-safe: all methods may be called concurrently; Get/Wait block on a
// condition of the map until the keys appear or the timeout passes.
class InMemoryStore final : public Store {
 public:
  InMemoryStore() = default;
  InMemoryStore(const InMemoryStore&) = delete;
  InMemoryStore& operator=(const InMemoryStore&) = delete;

  absl::Status Set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::string> Get(const std::string& key,
                                  absl::Duration timeout) override;
  absl::Status Wait(const std::vector<std::string>& keys,
                    absl::Duration timeout) override;

  // Number of keys set so far (tests).
  size_t size() const;

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, std::string> values_ ABSL_GUARDED_BY(mu_);
};

}  // namespace hsdp::comm

#endif  // HSDP_WORKER_COMM_STORE_IN_MEMORY_STORE_H_
