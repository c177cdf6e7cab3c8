#include "coordinator/core/state_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iostream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/file_util.h"
#include "common/status_util.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "hsdp/v1/schedule.pb.h"

namespace hsdp::coordinator {
namespace {

namespace fs = std::filesystem;

constexpr char kStateFile[] = "state.binpb";
constexpr char kCommitFile[] = "commit.binpb";
constexpr char kGenerationMark[] = "-g";
constexpr char kStepsDir[] = "steps";
constexpr char kStepSuffix[] = ".binpb";
constexpr char kLockFile[] = "LOCK";
// Where TruncateSealedSteps moves what it drops (never deletes).
constexpr char kTruncatedDirPrefix[] = "truncated-";

// A sealed step file: this magic, the payload's length and CRC-32C (both
// 32-bit little-endian), then the serialized StepSchedule. The length tells a
// truncated file from a complete one; the magic starts with a zero byte, which
// no serialized message starts with, so files written before the header
// (the bare message) are still read.
constexpr char kStepMagic[] = {'\0', 'h', 's', 'd', 'p', 's', 't', '1'};
constexpr size_t kStepMagicSize = sizeof(kStepMagic);
constexpr size_t kStepHeaderSize = kStepMagicSize + 8;
constexpr uint32_t kCrc32cPolynomial = 0x82F63B78u;  // reflected

// CRC-32C (the checksum checkpoint blocks use), bitwise: step files are a few
// KiB and read once per start.
uint32_t Crc32c(absl::string_view data) {
  uint32_t crc = ~0u;
  for (const char byte : data) {
    crc ^= static_cast<unsigned char>(byte);
    for (int bit = 0; bit < 8; ++bit) {
      crc = (crc >> 1) ^ ((crc & 1u) ? kCrc32cPolynomial : 0u);
    }
  }
  return ~crc;
}

void AppendLittleEndian32(uint32_t value, std::string* out) {
  for (int i = 0; i < 4; ++i)
    out->push_back(static_cast<char>(value >> (8 * i)));
}

uint32_t ReadLittleEndian32(absl::string_view bytes) {
  uint32_t value = 0;
  for (int i = 0; i < 4; ++i) {
    value |= static_cast<uint32_t>(static_cast<unsigned char>(bytes[i]))
             << (8 * i);
  }
  return value;
}

std::string FrameStepFile(absl::string_view payload) {
  std::string out(kStepMagic, kStepMagicSize);
  AppendLittleEndian32(static_cast<uint32_t>(payload.size()), &out);
  AppendLittleEndian32(Crc32c(payload), &out);
  out.append(payload.data(), payload.size());
  return out;
}

// The payload of a step file's contents, or why the file is damaged (a
// phrase: "is truncated (...)").
absl::StatusOr<std::string> UnframeStepFile(absl::string_view contents) {
  if (contents.empty()) return absl::DataLossError("is empty");
  // Written before the header: the bare message.
  if (contents.front() != '\0') return std::string(contents);
  if (contents.size() < kStepHeaderSize) {
    return absl::DataLossError(absl::StrCat(
        "is truncated (", contents.size(), " bytes, shorter than its header)"));
  }
  if (contents.substr(0, kStepMagicSize) !=
      absl::string_view(kStepMagic, kStepMagicSize)) {
    return absl::DataLossError("has an unknown header");
  }
  const uint64_t length = ReadLittleEndian32(contents.substr(kStepMagicSize));
  const uint32_t crc = ReadLittleEndian32(contents.substr(kStepMagicSize + 4));
  const uint64_t have = contents.size() - kStepHeaderSize;
  if (have < length) {
    return absl::DataLossError(
        absl::StrCat("is truncated (", have, " of its ", length, " bytes)"));
  }
  if (have > length) {
    return absl::DataLossError(absl::StrCat(
        "has ", have - length, " bytes past its end (", length, " expected)"));
  }
  std::string payload(contents.substr(kStepHeaderSize));
  if (Crc32c(payload) != crc) {
    return absl::DataLossError("fails its checksum");
  }
  return payload;
}

absl::Status ErrnoStatus(absl::string_view what, const std::string& path) {
  const int err = errno;
  return absl::Status(absl::ErrnoToStatusCode(err),
                      absl::StrCat(what, " ", path, ": ", std::strerror(err)));
}

absl::Status FsyncPath(const std::string& path, int flags) {
  const int fd = ::open(path.c_str(), flags | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus("open", path);
  const int rc = ::fsync(fd);
  const absl::Status status =
      rc == 0 ? absl::OkStatus() : ErrnoStatus("fsync", path);
  ::close(fd);
  return status;
}

// Serialization with a fixed field order, so equal messages give equal bytes.
std::string SerializeDeterministic(const google::protobuf::Message& message) {
  std::string out;
  google::protobuf::io::StringOutputStream stream(&out);
  google::protobuf::io::CodedOutputStream coded(&stream);
  coded.SetSerializationDeterministic(true);
  message.SerializeToCodedStream(&coded);
  coded.Trim();
  return out;
}

std::string StepFileName(int64_t step, int64_t generation) {
  if (generation == 0) return absl::StrFormat("%012d%s", step, kStepSuffix);
  return absl::StrFormat("%012d%s%d%s", step, kGenerationMark, generation,
                         kStepSuffix);
}

// Parses "<step>.binpb" or "<step>-g<generation>.binpb"; false if not ours.
// `generation` is -1 when the name carries none.
bool ParseStepFileName(absl::string_view name, int64_t* step,
                       int64_t* generation) {
  if (!absl::ConsumeSuffix(&name, kStepSuffix)) return false;
  *generation = -1;
  const size_t mark = name.find(kGenerationMark);
  if (mark != absl::string_view::npos) {
    if (!absl::SimpleAtoi(name.substr(mark + strlen(kGenerationMark)),
                          generation) ||
        *generation < 0) {
      return false;
    }
    name = name.substr(0, mark);
  }
  return absl::SimpleAtoi(name, step) && *step >= 0;
}

// Removes leftovers of writes interrupted by a crash (the only damage the
// write protocol can leave: the target of an interrupted write is untouched),
// saying so on stderr.
absl::Status RemoveTempFiles(const fs::path& dir) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    if (absl::EndsWith(entry.path().filename().string(), kTempFileSuffix)) {
      std::cerr << "hsdp-coordinator: passing over " << entry.path().string()
                << ": a write a crash interrupted (the file it was to replace "
                   "is intact)\n";
      std::error_code
          ignored;  // a leftover we cannot remove is still ignored on load
      fs::remove(entry.path(), ignored);
    }
  }
  if (ec)
    return absl::InternalError(
        absl::StrCat("listing ", dir.string(), ": ", ec.message()));
  return absl::OkStatus();
}

// Takes an exclusive, non-blocking flock on <dir>/LOCK and records this pid in
// it (for the message another coordinator gets). Returns the descriptor that
// holds the lock; closing it releases the lock, as does the process dying.
absl::StatusOr<int> LockDirectory(const std::string& dir) {
  const std::string path = (fs::path(dir) / kLockFile).string();
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus("open", path);
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    if (err != EWOULDBLOCK) {
      const absl::Status status = ErrnoStatus("flock", path);
      ::close(fd);
      return status;
    }
    char holder[32] = {};
    const ssize_t n = ::pread(fd, holder, sizeof(holder) - 1, 0);
    ::close(fd);
    const std::string pid(absl::StripAsciiWhitespace(
        absl::string_view(holder, n > 0 ? static_cast<size_t>(n) : 0)));
    return absl::FailedPreconditionError(absl::StrCat(
        "state directory ", dir, " is in use by another coordinator (pid ",
        pid.empty() ? "unknown" : pid, ", holding ", path,
        "); stop it first or choose another --state-dir"));
  }
  const std::string pid = absl::StrCat(::getpid(), "\n");
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, pid.data(), pid.size(), 0) !=
                                     static_cast<ssize_t>(pid.size())) {
    const absl::Status status = ErrnoStatus("write", path);
    ::close(fd);
    return status;
  }
  return fd;
}

}  // namespace

StateStore::StateStore(std::string dir, Options options, int lock_fd)
    : dir_(std::move(dir)), options_(options), lock_fd_(lock_fd) {}

StateStore::~StateStore() { ::close(lock_fd_); }

absl::StatusOr<std::unique_ptr<StateStore>> StateStore::Open(
    const std::string& dir, Options options) {
  if (dir.empty())
    return absl::InvalidArgumentError("state directory is empty");
  std::error_code ec;
  fs::create_directories(fs::path(dir) / kStepsDir, ec);
  if (ec) {
    return absl::PermissionDeniedError(absl::StrCat(
        "cannot create state directory ", dir, ": ", ec.message()));
  }
  // Locked before Load() removes leftover *.tmp files: those could be another
  // coordinator's writes in flight.
  HSDP_ASSIGN_OR_RETURN(const int lock_fd, LockDirectory(dir));
  std::unique_ptr<StateStore> store(new StateStore(dir, options, lock_fd));
  absl::Status status = store->Load();
  if (!status.ok()) return status;
  return store;
}

absl::Status StateStore::Load() {
  absl::MutexLock lock(&mu_);
  const fs::path root(dir_);
  if (absl::Status s = RemoveTempFiles(root); !s.ok()) return s;
  if (absl::Status s = RemoveTempFiles(root / kStepsDir); !s.ok()) return s;

  const fs::path state_path = root / kStateFile;
  std::error_code ec;
  if (fs::exists(state_path, ec)) {
    absl::StatusOr<std::string> bytes = ReadFile(state_path.string());
    if (!bytes.ok()) return bytes.status();
    if (!state_.ParseFromString(*bytes)) {
      return absl::DataLossError(
          absl::StrCat("corrupt state file ", state_path.string()));
    }
  }
  for (const auto& entry : fs::directory_iterator(root / kStepsDir, ec)) {
    const std::string name = entry.path().filename().string();
    int64_t step = -1, generation = -1;
    if (!ParseStepFileName(name, &step, &generation)) continue;  // not ours
    absl::StatusOr<std::string> contents = ReadFile(entry.path().string());
    if (!contents.ok()) return contents.status();
    absl::StatusOr<std::string> bytes = UnframeStepFile(*contents);
    if (!bytes.ok()) {
      return absl::DataLossError(absl::StrCat(
          "sealed step ", step, ": ", entry.path().string(), " ",
          bytes.status().message(), "; the state directory is damaged"));
    }
    hsdp::v1::StepSchedule schedule;
    // A name without a generation is generation 0 — or, from before
    // generations were in names, whatever generation the step was sealed in.
    if (!schedule.ParseFromString(*bytes) || schedule.step() != step ||
        (generation >= 0 && schedule.generation() != generation)) {
      return absl::DataLossError(absl::StrCat(
          "sealed step ", step, ": corrupt sealed step file ",
          entry.path().string(), "; the state directory is damaged"));
    }
    sealed_.emplace(SealedKey(step, schedule.generation()), std::move(*bytes));
  }
  const fs::path commit_path = root / kCommitFile;
  if (fs::exists(commit_path, ec)) {
    absl::StatusOr<std::string> bytes = ReadFile(commit_path.string());
    if (!bytes.ok()) return bytes.status();
    state::CommitPoint point;
    if (!point.ParseFromString(*bytes)) {
      return absl::DataLossError(
          absl::StrCat("corrupt commit file ", commit_path.string()));
    }
    commit_point_ = point;
  }
  if (ec) {
    return absl::InternalError(
        absl::StrCat("listing ", dir_, ": ", ec.message()));
  }
  return absl::OkStatus();
}

absl::Status StateStore::NoteWrite(absl::Status status) {
  if (status.ok() == !failing_) return status;
  failing_ = !status.ok();
  if (failing_) {
    std::cerr << "hsdp-coordinator: cannot write the state directory ("
              << status.message()
              << "); commits, joins and new generations wait until it can\n";
  } else {
    std::cerr << "hsdp-coordinator: the state directory " << dir_
              << " is writable again\n";
  }
  return status;
}

PersistedState StateStore::state() const {
  absl::MutexLock lock(&mu_);
  return state_;
}

absl::Status StateStore::Update(
    const std::function<void(PersistedState*)>& mutate) {
  absl::MutexLock lock(&mu_);
  PersistedState next = state_;
  mutate(&next);
  std::string bytes = SerializeDeterministic(next);
  // Many updates (a worker re-joining its own slot) change nothing: skip the
  // write and its fsyncs.
  if (bytes == SerializeDeterministic(state_)) return absl::OkStatus();
  absl::Status status = NoteWrite(WriteFileAtomically(
      (fs::path(dir_) / kStateFile).string(), bytes, options_.sync));
  if (status.ok()) state_ = std::move(next);
  return status;
}

absl::Status StateStore::SaveSealedStep(int64_t step, int64_t generation,
                                        const std::string& bytes) {
  absl::MutexLock lock(&mu_);
  const SealedKey key(step, generation);
  auto it = sealed_.find(key);
  if (it != sealed_.end()) {
    if (it->second == bytes) return absl::OkStatus();
    return absl::FailedPreconditionError(
        absl::StrCat("step ", step, " is already sealed in generation ",
                     generation, " with different contents"));
  }
  absl::Status status = NoteWrite(WriteFileAtomically(
      SealedStepPath(step, generation), FrameStepFile(bytes), options_.sync));
  if (status.ok()) sealed_.emplace(key, bytes);
  return status;
}

absl::StatusOr<int> StateStore::TruncateSealedSteps(int64_t last_step) {
  absl::MutexLock lock(&mu_);
  if (commit_point_.has_value() && commit_point_->step() > last_step) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot truncate the sealed steps to step ", last_step, ": step ",
        commit_point_->step(), " committed (", dir_, "/", kCommitFile,
        "); restore the state directory from a copy instead"));
  }
  const fs::path aside =
      fs::path(dir_) /
      absl::StrCat(kTruncatedDirPrefix, absl::ToUnixMillis(absl::Now())) /
      kStepsDir;
  int moved = 0;
  for (auto it = sealed_.begin(); it != sealed_.end();) {
    const auto [step, generation] = it->first;
    if (step <= last_step) {
      ++it;
      continue;
    }
    std::error_code ec;
    if (moved == 0) fs::create_directories(aside, ec);
    const fs::path from = SealedStepPath(step, generation);
    fs::path to = aside / from.filename();
    if (!ec) fs::rename(from, to, ec);
    if (ec) {
      return absl::InternalError(absl::StrCat("moving ", from.string(), " to ",
                                              to.string(), ": ", ec.message()));
    }
    ++moved;
    it = sealed_.erase(it);
  }
  if (moved > 0 && options_.sync) {
    HSDP_RETURN_IF_ERROR(FsyncPath((fs::path(dir_) / kStepsDir).string(),
                                   O_RDONLY | O_DIRECTORY));
  }
  return moved;
}

std::string StateStore::SealedStepPath(int64_t step, int64_t generation) const {
  return (fs::path(dir_) / kStepsDir / StepFileName(step, generation)).string();
}

std::map<StateStore::SealedKey, std::string> StateStore::SealedSteps() const {
  absl::MutexLock lock(&mu_);
  return sealed_;
}

absl::Status StateStore::SaveCommitPoint(const state::CommitPoint& point) {
  absl::MutexLock lock(&mu_);
  absl::Status status = NoteWrite(
      WriteFileAtomically((fs::path(dir_) / kCommitFile).string(),
                          SerializeDeterministic(point), options_.sync));
  if (status.ok()) commit_point_ = point;
  return status;
}

std::optional<state::CommitPoint> StateStore::commit_point() const {
  absl::MutexLock lock(&mu_);
  return commit_point_;
}

}  // namespace hsdp::coordinator
