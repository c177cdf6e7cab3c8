#include "worker/comm/store/in_memory_store.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace hsdp::comm {

absl::Status InMemoryStore::Set(const std::string& key,
                                const std::string& value) {
  absl::MutexLock lock(&mu_);
  values_[key] = value;
  return absl::OkStatus();
}

absl::StatusOr<std::string> InMemoryStore::Get(const std::string& key,
                                               absl::Duration timeout) {
  absl::Status waited = Wait({key}, timeout);
  if (!waited.ok()) return waited;
  absl::MutexLock lock(&mu_);
  return values_.at(key);
}

absl::Status InMemoryStore::Wait(const std::vector<std::string>& keys,
                                 absl::Duration timeout) {
  auto all_present = [this, &keys]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const std::string& key : keys) {
      if (values_.find(key) == values_.end()) return false;
    }
    return true;
  };
  absl::MutexLock lock(&mu_);
  if (mu_.AwaitWithTimeout(absl::Condition(&all_present), timeout))
    return absl::OkStatus();
  std::vector<std::string> missing;
  for (const std::string& key : keys) {
    if (values_.find(key) == values_.end()) missing.push_back(key);
  }
  return absl::DeadlineExceededError(
      absl::StrCat("store keys not set after ", absl::FormatDuration(timeout),
                   ": ", absl::StrJoin(missing, ", ")));
}

size_t InMemoryStore::size() const {
  absl::MutexLock lock(&mu_);
  return values_.size();
}

}  // namespace hsdp::comm
