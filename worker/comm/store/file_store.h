// A rendezvous Store shared by processes on one machine (or a shared
// filesystem) through a directory: one file per key, like torch's FileStore.
// Used by multi-process tests and single-host launches that have no
// coordinator.
#ifndef HSDP_WORKER_COMM_STORE_FILE_STORE_H_
#define HSDP_WORKER_COMM_STORE_FILE_STORE_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "hsdp/store.h"

namespace hsdp::comm {

// Thread-safe and process-safe: Set writes the value to a temporary file in
// the directory and renames it onto the key's file, so a reader sees either no
// file or the whole value, never a partial one. Get/Wait poll the directory
// until the keys exist or the timeout passes. Keys are escaped into file names
// (any byte string is a valid key). The object holds no mutable state.
class FileStore final : public Store {
 public:
  // Polling interval of Get/Wait: short enough for a quick rendezvous, long
  // enough not to spin a shared core.
  static constexpr absl::Duration kPollInterval = absl::Milliseconds(5);

  // Creates `directory` (one level) if it does not exist.
  static absl::StatusOr<FileStore> Open(const std::string& directory);

  FileStore(FileStore&&) = default;
  FileStore& operator=(FileStore&&) = default;
  FileStore(const FileStore&) = delete;
  FileStore& operator=(const FileStore&) = delete;

  absl::Status Set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::string> Get(const std::string& key,
                                  absl::Duration timeout) override;
  absl::Status Wait(const std::vector<std::string>& keys,
                    absl::Duration timeout) override;

  const std::string& directory() const { return directory_; }

 private:
  explicit FileStore(std::string directory)
      : directory_(std::move(directory)) {}
  std::string PathOf(const std::string& key) const;

  std::string directory_;
};

}  // namespace hsdp::comm

#endif  // HSDP_WORKER_COMM_STORE_FILE_STORE_H_
