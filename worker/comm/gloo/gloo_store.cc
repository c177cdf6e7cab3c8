#include "worker/comm/gloo/gloo_store.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "gloo/common/error.h"

namespace hsdp::comm {

GlooStoreAdapter::GlooStoreAdapter(hsdp::comm::Store& store, std::string prefix,
                                   absl::Duration timeout)
    : store_(store),
      prefix_(std::move(prefix)),
      deadline_(absl::Now() + timeout) {}

absl::Duration GlooStoreAdapter::Remaining() const {
  return std::max(deadline_ - absl::Now(), absl::ZeroDuration());
}

std::string GlooStoreAdapter::FullKey(const std::string& key) const {
  return absl::StrCat(prefix_, "/", key);
}

void GlooStoreAdapter::Fail(const absl::Status& status) {
  {
    absl::MutexLock lock(&mu_);
    if (first_error_.ok()) first_error_ = status;
  }
  throw gloo::IoException(status.ToString());
}

void GlooStoreAdapter::set(const std::string& key,
                           const std::vector<char>& data) {
  absl::Status status =
      store_.Set(FullKey(key), std::string(data.begin(), data.end()));
  if (!status.ok()) Fail(status);
}

std::vector<char> GlooStoreAdapter::get(const std::string& key) {
  absl::StatusOr<std::string> value = store_.Get(FullKey(key), Remaining());
  if (!value.ok()) Fail(value.status());
  return std::vector<char>(value->begin(), value->end());
}

void GlooStoreAdapter::wait(const std::vector<std::string>& keys) {
  wait(keys, gloo::kNoTimeout);
}

void GlooStoreAdapter::wait(const std::vector<std::string>& keys,
                            const std::chrono::milliseconds& timeout) {
  std::vector<std::string> full_keys;
  full_keys.reserve(keys.size());
  for (const std::string& key : keys) full_keys.push_back(FullKey(key));
  // Gloo passes kNoTimeout (0) for "forever"; we never wait past the
  // deadline.
  absl::Duration bound = Remaining();
  if (timeout.count() > 0)
    bound = std::min(bound, absl::Milliseconds(timeout.count()));
  absl::Status status = store_.Wait(full_keys, bound);
  if (!status.ok()) Fail(status);
}

absl::Status GlooStoreAdapter::first_error() const {
  absl::MutexLock lock(&mu_);
  return first_error_;
}

}  // namespace hsdp::comm
