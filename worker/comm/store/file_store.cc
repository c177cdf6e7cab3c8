#include "worker/comm/store/file_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/file_util.h"

namespace hsdp::comm {
namespace {

absl::Status ErrnoError(const std::string& what, const std::string& path) {
  return absl::InternalError(
      absl::StrCat(what, " ", path, ": ", std::strerror(errno)));
}

// Hex-escapes every byte outside [A-Za-z0-9_-] so any key maps to one flat,
// valid file name ('/' in keys would otherwise need subdirectories).
std::string EscapeKey(const std::string& key) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out = "k_";
  for (unsigned char c : key) {
    if (std::isalnum(c) || c == '-' || c == '_') {
      out.push_back(static_cast<char>(c));
    } else {
      out.push_back('%');
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 0xf]);
    }
  }
  return out;
}

bool Exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

}  // namespace

absl::StatusOr<FileStore> FileStore::Open(const std::string& directory) {
  if (::mkdir(directory.c_str(), 0700) != 0 && errno != EEXIST) {
    return ErrnoError("cannot create store directory", directory);
  }
  struct stat st;
  if (::stat(directory.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("store path is not a directory: ", directory));
  }
  return FileStore(directory);
}

std::string FileStore::PathOf(const std::string& key) const {
  return absl::StrCat(directory_, "/", EscapeKey(key));
}

absl::Status FileStore::Set(const std::string& key, const std::string& value) {
  // Temporary names are unique per process and call, and never start with
  // "k_", so no reader mistakes one for a key.
  static std::atomic<uint64_t> counter{0};
  const std::string path = PathOf(key);
  const std::string tmp =
      absl::StrCat(directory_, "/.tmp.", ::getpid(), ".", counter.fetch_add(1));
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  if (fd < 0) return ErrnoError("cannot create", tmp);
  size_t written = 0;
  while (written < value.size()) {
    const ssize_t n =
        ::write(fd, value.data() + written, value.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      absl::Status error = ErrnoError("cannot write", tmp);
      ::close(fd);
      ::unlink(tmp.c_str());
      return error;
    }
    written += static_cast<size_t>(n);
  }
  if (::close(fd) != 0) {
    absl::Status error = ErrnoError("cannot close", tmp);
    ::unlink(tmp.c_str());
    return error;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    absl::Status error = ErrnoError("cannot rename onto", path);
    ::unlink(tmp.c_str());
    return error;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> FileStore::Get(const std::string& key,
                                           absl::Duration timeout) {
  absl::Status waited = Wait({key}, timeout);
  if (!waited.ok()) return waited;
  absl::StatusOr<std::string> value = ReadFile(PathOf(key));
  // Store failures stay INTERNAL whatever the errno: callers read UNAVAILABLE
  // and DEADLINE_EXCEEDED as a peer that went away, not a broken directory.
  if (!value.ok()) return absl::InternalError(value.status().message());
  return value;
}

absl::Status FileStore::Wait(const std::vector<std::string>& keys,
                             absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  std::vector<std::string> missing = keys;
  while (true) {
    std::vector<std::string> still;
    for (const std::string& key : missing) {
      if (!Exists(PathOf(key))) still.push_back(key);
    }
    missing.swap(still);
    if (missing.empty()) return absl::OkStatus();
    const absl::Time now = absl::Now();
    if (now >= deadline) break;
    absl::SleepFor(std::min(kPollInterval, deadline - now));
  }
  return absl::DeadlineExceededError(
      absl::StrCat("store keys not set after ", absl::FormatDuration(timeout),
                   " in ", directory_, ": ", absl::StrJoin(missing, ", ")));
}

}  // namespace hsdp::comm
