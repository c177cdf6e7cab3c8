#include "common/file_util.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <utility>

#include "absl/strings/str_cat.h"

namespace hsdp {
namespace {

// The status of the errno just set by `what` on `path`.
absl::Status ErrnoStatus(absl::string_view what, const std::string& path) {
  const int err = errno;
  return absl::Status(absl::ErrnoToStatusCode(err),
                      absl::StrCat(what, " ", path, ": ", std::strerror(err)));
}

absl::Status SyncDirectoryOf(const std::string& path) {
  std::string dir = std::filesystem::path(path).parent_path().string();
  if (dir.empty()) dir = ".";
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus("open", dir);
  const absl::Status status =
      ::fsync(fd) == 0 ? absl::OkStatus() : ErrnoStatus("fsync", dir);
  ::close(fd);
  return status;
}

}  // namespace

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus("cannot read", path);
  std::string contents;
  char buffer[1 << 16];
  while (true) {
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n == 0) break;
    if (n < 0) {
      if (errno == EINTR) continue;
      const absl::Status status = ErrnoStatus("cannot read", path);
      ::close(fd);
      return status;
    }
    contents.append(buffer, static_cast<size_t>(n));
  }
  ::close(fd);
  return contents;
}

AtomicFileWriter::AtomicFileWriter(std::string path, bool sync)
    : path_(std::move(path)),
      temp_(absl::StrCat(path_, kTempFileSuffix)),
      sync_(sync) {}

AtomicFileWriter::~AtomicFileWriter() { Discard(); }

void AtomicFileWriter::Discard() {
  if (fd_ < 0) return;
  ::close(fd_);
  fd_ = -1;
  ::unlink(temp_.c_str());
}

absl::Status AtomicFileWriter::Open() {
  fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  return fd_ >= 0 ? absl::OkStatus() : ErrnoStatus("create", temp_);
}

absl::Status AtomicFileWriter::Append(absl::string_view bytes) {
  if (fd_ < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("write ", temp_, ": not open"));
  }
  while (!bytes.empty()) {
    const ssize_t n = ::write(fd_, bytes.data(), bytes.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const absl::Status status = ErrnoStatus("write", temp_);
      Discard();
      return status;
    }
    bytes.remove_prefix(static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

absl::Status AtomicFileWriter::Commit() {
  if (fd_ < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("commit ", temp_, ": not open"));
  }
  if (sync_ && ::fsync(fd_) != 0) {
    const absl::Status status = ErrnoStatus("fsync", temp_);
    Discard();
    return status;
  }
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) {
    const absl::Status status = ErrnoStatus("close", temp_);
    ::unlink(temp_.c_str());
    return status;
  }
  if (::rename(temp_.c_str(), path_.c_str()) != 0) {
    const absl::Status status = ErrnoStatus("rename", temp_);
    ::unlink(temp_.c_str());
    return status;
  }
  return sync_ ? SyncDirectoryOf(path_) : absl::OkStatus();
}

absl::Status WriteFileAtomically(const std::string& path,
                                 absl::string_view contents, bool sync) {
  AtomicFileWriter writer(path, sync);
  if (absl::Status s = writer.Open(); !s.ok()) return s;
  if (absl::Status s = writer.Append(contents); !s.ok()) return s;
  return writer.Commit();
}

}  // namespace hsdp
