// Adapts an hsdp::comm::Store to gloo::rendezvous::Store so Gloo's
// connectFullMesh can rendezvous through it (the coordinator's key-value store
// in production, InMemoryStore in tests).
#ifndef HSDP_WORKER_COMM_GLOO_GLOO_STORE_H_
#define HSDP_WORKER_COMM_GLOO_GLOO_STORE_H_

#include <chrono>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gloo/rendezvous/store.h"
#include "hsdp/store.h"

namespace hsdp::comm {

// Every key Gloo uses is stored as "<prefix>/<key>". Values are raw bytes (Gloo
// puts binary addresses in them), so the wrapped Store must be binary-safe.
//
// Gloo's Store API reports failure by throwing; this adapter throws
// gloo::IoException whose message names the missing key, and also remembers the
// first underlying absl::Status (first_error()) so the caller can return it
// with its original code instead of parsing exception text.
//
// Thread-safe if the wrapped Store is (it is used by one rendezvous at a time
// in practice).
class GlooStoreAdapter final : public gloo::rendezvous::Store {
 public:
  // Every blocking call ends by `timeout` after construction (so one
  // rendezvous waiting on several absent peers still ends in `timeout`, not a
  // multiple of it); a shorter timeout Gloo passes to wait() is honoured.
  GlooStoreAdapter(hsdp::comm::Store& store, std::string prefix,
                   absl::Duration timeout);
  GlooStoreAdapter(const GlooStoreAdapter&) = delete;
  GlooStoreAdapter& operator=(const GlooStoreAdapter&) = delete;

  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

  // The first error the wrapped Store returned, OK if none.
  absl::Status first_error() const;
  // "<prefix>/<key>", the key as the wrapped Store sees it.
  std::string FullKey(const std::string& key) const;

 private:
  // Records `status` (if first) and throws it as a gloo::IoException.
  [[noreturn]] void Fail(const absl::Status& status);

  hsdp::comm::Store& store_;
  const std::string prefix_;
  // Time left until the deadline (never negative).
  absl::Duration Remaining() const;

  const absl::Time deadline_;
  mutable absl::Mutex mu_;
  absl::Status first_error_ ABSL_GUARDED_BY(mu_);
};

}  // namespace hsdp::comm

#endif  // HSDP_WORKER_COMM_GLOO_GLOO_STORE_H_
