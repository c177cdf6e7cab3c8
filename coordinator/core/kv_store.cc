#include "coordinator/core/kv_store.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace hsdp::coordinator {

std::string RendezvousPrefix(absl::string_view job_id, int64_t generation) {
  return absl::StrCat("hsdp/", job_id, "/gen-", generation, "/");
}

absl::Status KvStore::CheckKey(absl::string_view key) const {
  if (key.empty()) return absl::InvalidArgumentError("store key is empty");
  if (key.size() > limits_.max_key_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("store key is ", key.size(), " bytes; the limit is ",
                     limits_.max_key_bytes, " bytes per key"));
  }
  return absl::OkStatus();
}

absl::Status KvStore::Set(absl::string_view job_id, int64_t generation,
                          absl::string_view key, std::string value) {
  if (absl::Status s = CheckKey(key); !s.ok()) return s;
  if (value.size() > limits_.max_value_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "store value for key ", key, " is ", value.size(),
        " bytes; the limit is ", limits_.max_value_bytes, " bytes per value"));
  }
  absl::MutexLock lock(&mu_);
  const Scope id(std::string(job_id), generation);
  auto scope_it = scopes_.find(id);
  const ScopeData empty;
  const ScopeData& current =
      scope_it == scopes_.end() ? empty : scope_it->second;
  auto it = current.entries.find(key);
  const bool is_new = it == current.entries.end();
  if (is_new && current.entries.size() >= limits_.max_keys_per_scope) {
    return absl::ResourceExhaustedError(
        absl::StrCat("store of generation ", generation, " already holds ",
                     current.entries.size(), " keys; the limit is ",
                     limits_.max_keys_per_scope, " keys per generation"));
  }
  const size_t old_bytes = is_new ? 0 : key.size() + it->second.size();
  const size_t new_bytes =
      current.bytes - old_bytes + key.size() + value.size();
  if (new_bytes > limits_.max_bytes_per_scope) {
    return absl::ResourceExhaustedError(
        absl::StrCat("store of generation ", generation, " would hold ",
                     new_bytes, " bytes with key ", key, "; the limit is ",
                     limits_.max_bytes_per_scope, " bytes per generation"));
  }
  // Only now create the scope, so a refused Set leaves no empty one behind.
  ScopeData& scope = scopes_[id];
  scope.bytes = new_bytes;
  if (is_new) {
    scope.entries.emplace(std::string(key), std::move(value));
  } else {
    scope.entries.find(key)->second = std::move(value);
  }
  return absl::OkStatus();
}

bool KvStore::EndedLocked(const Scope& scope) const {
  auto it = ended_through_.find(scope.first);
  return it != ended_through_.end() && scope.second <= it->second;
}

bool KvStore::ReadyLocked(const Scope& scope,
                          const std::vector<std::string>& keys) const {
  if (shutdown_ || EndedLocked(scope)) return true;
  auto it = scopes_.find(scope);
  if (it == scopes_.end()) return keys.empty();
  for (const auto& key : keys) {
    if (it->second.entries.find(key) == it->second.entries.end()) return false;
  }
  return true;
}

absl::Status KvStore::WaitLocked(const Scope& scope,
                                 const std::vector<std::string>& keys,
                                 absl::Duration timeout) {
  const absl::Time deadline =
      absl::Now() + std::max(timeout, absl::ZeroDuration());
  auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return ReadyLocked(scope, keys);
  };
  // Set() needs no explicit signal: Await re-evaluates the condition whenever
  // mu_ is released by a writer.
  mu_.AwaitWithDeadline(absl::Condition(&ready), deadline);
  if (shutdown_) return absl::UnavailableError("coordinator is shutting down");
  if (EndedLocked(scope)) {
    return absl::AbortedError(
        absl::StrCat("generation ", scope.second,
                     " ended: its rendezvous is over; re-form"));
  }
  auto it = scopes_.find(scope);
  for (const auto& key : keys) {
    if (it == scopes_.end() ||
        it->second.entries.find(key) == it->second.entries.end()) {
      return absl::DeadlineExceededError(
          absl::StrCat("store key ", key, " (generation ", scope.second,
                       ") not set within ", absl::FormatDuration(timeout)));
    }
  }
  return absl::OkStatus();
}

absl::Status KvStore::Wait(absl::string_view job_id, int64_t generation,
                           const std::vector<std::string>& keys,
                           absl::Duration timeout) {
  if (keys.size() > limits_.max_keys_per_scope) {
    return absl::InvalidArgumentError(
        absl::StrCat("store wait names ", keys.size(), " keys; the limit is ",
                     limits_.max_keys_per_scope, " keys per generation"));
  }
  for (const auto& key : keys) {
    if (absl::Status s = CheckKey(key); !s.ok()) return s;
  }
  absl::MutexLock lock(&mu_);
  return WaitLocked(Scope(std::string(job_id), generation), keys, timeout);
}

absl::StatusOr<std::string> KvStore::Get(absl::string_view job_id,
                                         int64_t generation,
                                         absl::string_view key,
                                         absl::Duration timeout) {
  if (absl::Status s = CheckKey(key); !s.ok()) return s;
  const Scope scope(std::string(job_id), generation);
  absl::MutexLock lock(&mu_);
  absl::Status status = WaitLocked(scope, {std::string(key)}, timeout);
  if (!status.ok()) return status;
  return scopes_.find(scope)->second.entries.find(key)->second;
}

void KvStore::DropGenerationsBefore(absl::string_view job_id,
                                    int64_t generation) {
  absl::MutexLock lock(&mu_);
  for (auto it = scopes_.begin(); it != scopes_.end();) {
    if (it->first.first == job_id && it->first.second < generation) {
      it = scopes_.erase(it);
    } else {
      ++it;
    }
  }
}

void KvStore::EndGeneration(absl::string_view job_id, int64_t generation) {
  absl::MutexLock lock(&mu_);
  auto it = ended_through_.find(job_id);
  if (it == ended_through_.end()) {
    ended_through_.emplace(std::string(job_id), generation);
  } else {
    it->second = std::max(it->second, generation);
  }
}

void KvStore::Shutdown() {
  absl::MutexLock lock(&mu_);
  shutdown_ = true;
}

size_t KvStore::KeyCount(absl::string_view job_id, int64_t generation) const {
  absl::MutexLock lock(&mu_);
  auto it = scopes_.find(Scope(std::string(job_id), generation));
  return it == scopes_.end() ? 0 : it->second.entries.size();
}

size_t KvStore::ByteCount(absl::string_view job_id, int64_t generation) const {
  absl::MutexLock lock(&mu_);
  auto it = scopes_.find(Scope(std::string(job_id), generation));
  return it == scopes_.end() ? 0 : it->second.bytes;
}

}  // namespace hsdp::coordinator
