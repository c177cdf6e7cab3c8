// The rendezvous key-value store behind StoreSet/StoreGet/StoreWait: keys live
// in a namespace per (job id, generation), so a new generation starts from an
// empty store and stale workers cannot read or clobber the new one's keys. Get
// and Wait block (condition waits on an absl::Mutex) until the keys exist, the
// timeout passes (DEADLINE_EXCEEDED), the generation ends (ABORTED) or
// Shutdown() is called (UNAVAILABLE).
#ifndef HSDP_COORDINATOR_CORE_KV_STORE_H_
#define HSDP_COORDINATOR_CORE_KV_STORE_H_

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace hsdp::coordinator {

// Default limits (KvStore::Limits). Rendezvous data is small (Gloo addresses,
// NCCL unique ids: bytes to a few KiB per rank); the limits keep one worker,
// buggy or hostile, from filling the coordinator's memory.
inline constexpr size_t kMaxKvKeyBytes = 1024;
inline constexpr size_t kMaxKvValueBytes = 4 << 20;
inline constexpr size_t kMaxKvKeysPerScope = 1 << 16;
inline constexpr size_t kMaxKvBytesPerScope = 64 << 20;

// The rendezvous prefix a Join answer carries, e.g. "hsdp/job-1/gen-3/".
std::string RendezvousPrefix(absl::string_view job_id, int64_t generation);

// Thread-safe.
class KvStore {
 public:
  // Every refusal names the limit it hit.
  struct Limits {
    // One key: INVALID_ARGUMENT past it (and for an empty key).
    size_t max_key_bytes = kMaxKvKeyBytes;
    // One value: INVALID_ARGUMENT past it.
    size_t max_value_bytes = kMaxKvValueBytes;
    // Keys in one (job, generation) scope: RESOURCE_EXHAUSTED past it; also
    // the most keys one Wait may name (INVALID_ARGUMENT).
    size_t max_keys_per_scope = kMaxKvKeysPerScope;
    // Key + value bytes in one scope: RESOURCE_EXHAUSTED past it.
    size_t max_bytes_per_scope = kMaxKvBytesPerScope;
  };

  KvStore() : KvStore(Limits()) {}
  explicit KvStore(Limits limits) : limits_(limits) {}
  KvStore(const KvStore&) = delete;
  KvStore& operator=(const KvStore&) = delete;

  // Sets (or overwrites) a key. INVALID_ARGUMENT for an empty/oversized key or
  // oversized value; RESOURCE_EXHAUSTED when the scope would pass its key count
  // or byte limit. A refused Set changes nothing.
  absl::Status Set(absl::string_view job_id, int64_t generation,
                   absl::string_view key, std::string value);

  // Returns the value once the key exists; DEADLINE_EXCEEDED ("key K not set
  // within T") after `timeout` (<= 0: check once); UNAVAILABLE after
  // Shutdown(). A key Set would refuse (empty, oversized) is INVALID_ARGUMENT
  // at once: it can never appear.
  absl::StatusOr<std::string> Get(absl::string_view job_id, int64_t generation,
                                  absl::string_view key,
                                  absl::Duration timeout);

  // Like Get for every key; the error names the first missing key. Keys are
  // checked as in Get, and more than max_keys_per_scope of them is
  // INVALID_ARGUMENT.
  absl::Status Wait(absl::string_view job_id, int64_t generation,
                    const std::vector<std::string>& keys,
                    absl::Duration timeout);

  // Drops every scope of `job_id` with a generation below `generation` (old
  // rendezvous).
  void DropGenerationsBefore(absl::string_view job_id, int64_t generation);

  // `generation` (and every earlier one) of `job_id` ended: waiters in those
  // scopes fail at once with ABORTED, and so do later Get/Wait calls there —
  // a rendezvous of a generation that ended can never complete.
  void EndGeneration(absl::string_view job_id, int64_t generation);

  // Wakes all waiters with UNAVAILABLE; later blocking calls fail at once.
  void Shutdown();

  // Keys in one scope (for tests/metrics).
  size_t KeyCount(absl::string_view job_id, int64_t generation) const;
  // Key + value bytes in one scope (for tests/metrics).
  size_t ByteCount(absl::string_view job_id, int64_t generation) const;

  const Limits& limits() const { return limits_; }

 private:
  using Scope = std::pair<std::string, int64_t>;
  struct ScopeData {
    std::map<std::string, std::string, std::less<>> entries;
    // Sum of key and value sizes over `entries`.
    size_t bytes = 0;
  };

  // INVALID_ARGUMENT for a key no Set accepts.
  absl::Status CheckKey(absl::string_view key) const;
  // True when every key exists in the scope or the store is shut down.
  bool ReadyLocked(const Scope& scope,
                   const std::vector<std::string>& keys) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Blocks (releasing mu_) until ReadyLocked or the timeout; then checks the
  // outcome.
  absl::Status WaitLocked(const Scope& scope,
                          const std::vector<std::string>& keys,
                          absl::Duration timeout)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Limits limits_;
  mutable absl::Mutex mu_;
  std::map<Scope, ScopeData> scopes_ ABSL_GUARDED_BY(mu_);
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  // Per job: the latest generation that ended.
  std::map<std::string, int64_t, std::less<>> ended_through_
      ABSL_GUARDED_BY(mu_);
  bool EndedLocked(const Scope& scope) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
};

}  // namespace hsdp::coordinator

#endif  // HSDP_COORDINATOR_CORE_KV_STORE_H_
