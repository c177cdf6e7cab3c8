// Whole-file reads and crash-safe file writes, shared by the coordinator,
// hsdpctl and the worker (torch-free, like all of common/).
//
// Thread-compatible: an AtomicFileWriter belongs to one thread; the free
// functions touch only the files they are given. Two writers of one path at
// once share its temporary file: callers serialise writes of a path.
#ifndef HSDP_COMMON_FILE_UTIL_H_
#define HSDP_COMMON_FILE_UTIL_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace hsdp {

// What AtomicFileWriter appends to the target's name for its temporary file.
// A file with this suffix in a directory is a write a crash interrupted; the
// file it was to replace is intact.
inline constexpr char kTempFileSuffix[] = ".tmp";

// The bytes of `path`. On failure the code follows errno (NOT_FOUND for a
// missing file, PERMISSION_DENIED for an unreadable one, ...) and the message
// names the path: "cannot read <path>: <reason>".
absl::StatusOr<std::string> ReadFile(const std::string& path);

// Writes one file so that readers, and a crash, see either the file as it was
// or the whole new contents. The bytes go to `path + kTempFileSuffix` in the
// same directory (a rename is atomic only within one file system); Commit()
// syncs and closes it, renames it over `path`, then syncs the directory, since
// the rename is only durable once the directory entry is.
//
// Errors carry the code of their errno and name the operation and the path.
// A writer destroyed before a successful Commit() removes its temporary file.
class AtomicFileWriter {
 public:
  // `sync` false skips both fsyncs: the file is still replaced atomically, but
  // a power loss may leave the old contents (or, on some file systems, an
  // empty file). For files whose loss costs nothing, such as a port file.
  explicit AtomicFileWriter(std::string path, bool sync = true);
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  // Creates (or truncates) the temporary file. Call once, first.
  absl::Status Open();
  // Appends `bytes` to the temporary file.
  absl::Status Append(absl::string_view bytes);
  // Publishes the temporary file as `path`. After an error `path` is as it was
  // (unless only the directory sync failed) and the temporary file is gone.
  absl::Status Commit();

 private:
  void Discard();

  const std::string path_;
  const std::string temp_;
  const bool sync_;
  int fd_ = -1;
};

// Replaces `path` by `contents` with an AtomicFileWriter: `path` either keeps
// its old contents or holds all of `contents`.
absl::Status WriteFileAtomically(const std::string& path,
                                 absl::string_view contents, bool sync = true);

}  // namespace hsdp

#endif  // HSDP_COMMON_FILE_UTIL_H_
