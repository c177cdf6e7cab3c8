#include "worker/comm/shm/shm_communicator.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_util.h"
#include "worker/comm/reduce_kernels.h"
#include "worker/comm/shm/shm_region.h"

namespace hsdp::comm {
namespace {

// Copies bytes [offset, offset + n) of the concatenation of `segments` to
// `dst` (gather) or from `src` into it (scatter).
void Gather(const std::vector<Buffer>& segments, size_t offset, size_t n,
            char* dst) {
  ForEachSegmentPiece(
      segments, offset, n,
      [&](size_t k, size_t in_segment, size_t in_range, size_t len) {
        std::memcpy(dst + in_range,
                    static_cast<const char*>(segments[k].data) + in_segment,
                    len);
      });
}

void Scatter(const char* src, size_t offset, size_t n,
             const std::vector<Buffer>& segments) {
  ForEachSegmentPiece(
      segments, offset, n,
      [&](size_t k, size_t in_segment, size_t in_range, size_t len) {
        std::memcpy(static_cast<char*>(segments[k].data) + in_segment,
                    src + in_range, len);
      });
}

size_t Chunks(size_t bytes, size_t chunk) {
  return (bytes + chunk - 1) / chunk;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> ShmCommunicator::Wrap(
    Store& store, const std::string& prefix,
    std::unique_ptr<Communicator> inner, const ShmOptions& options,
    std::string* fallback_reason) {
  if (inner == nullptr) {
    return absl::InvalidArgumentError("ShmCommunicator::Wrap: no communicator");
  }
  const int size = inner->size();
  const int rank = inner->rank();
  auto fall_back = [&](std::string reason) {
    if (fallback_reason != nullptr) *fallback_reason = std::move(reason);
    return std::move(inner);
  };
  if (size == 1) return fall_back("a group of one has no peers");
  const ShmRegion::Layout layout = ShmRegion::ComputeLayout(
      size, options.max_slot_bytes, options.max_region_bytes);
  // Decided alike on every rank (same size, same options).
  if (layout.total_bytes > options.max_region_bytes) {
    return fall_back(absl::StrCat("a group of ", size, " needs ",
                                  layout.total_bytes,
                                  " bytes of shared memory, more than the ",
                                  options.max_region_bytes, " allowed"));
  }
  const std::string name_key = absl::StrCat(prefix, "/shm/name");
  auto ready_key = [&prefix](int r) {
    return absl::StrCat(prefix, "/shm/ready/", r);
  };

  // Rank 0 creates and reserves the region; the others open it by name.
  std::string name, problem;
  int fd = -1;
  if (rank == 0) {
    name = ShmRegion::RandomName();
    fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) {
      problem = absl::StrCat("shm_open(", name, "): ", std::strerror(errno));
    } else if (const int err = posix_fallocate(
                   fd, 0, static_cast<off_t>(layout.total_bytes));
               err != 0) {
      problem = absl::StrCat("reserving ", layout.total_bytes, " bytes in ",
                             name, ": ", std::strerror(err));
    }
    HSDP_RETURN_IF_ERROR(store.Set(name_key, problem.empty() ? name : ""));
  } else {
    HSDP_ASSIGN_OR_RETURN(name, store.Get(name_key, options.timeout));
    if (name.empty()) {
      problem = "rank 0 could not create the region";
    } else {
      fd = shm_open(name.c_str(), O_RDWR, 0);
      struct stat st;
      if (fd < 0) {
        problem = absl::StrCat("shm_open(", name, "): ", std::strerror(errno),
                               " (another host or IPC namespace?)");
      } else if (fstat(fd, &st) != 0 ||
                 static_cast<size_t>(st.st_size) != layout.total_bytes) {
        problem = absl::StrCat(name, " has an unexpected size");
      }
    }
  }
  void* base = MAP_FAILED;
  if (problem.empty()) {
    base = mmap(nullptr, layout.total_bytes, PROT_READ | PROT_WRITE, MAP_SHARED,
                fd, 0);
    if (base == MAP_FAILED) {
      problem = absl::StrCat("mmap(", name, "): ", std::strerror(errno));
    }
  }
  if (fd >= 0) close(fd);
  std::shared_ptr<ShmRegion> region;
  if (base != MAP_FAILED) {
    region =
        std::make_shared<ShmRegion>(base, layout, rank, size, options.timeout);
    if (rank == 0) region->InitHeader();
    region->Publish();  // before "ready": peers may check our pid from then
  }

  // Everyone learns whether everyone mapped it: the same decision on every
  // rank.
  HSDP_RETURN_IF_ERROR(
      store.Set(ready_key(rank), problem.empty() ? "ok" : problem));
  std::string first_problem;
  for (int r = 0; r < size; ++r) {
    HSDP_ASSIGN_OR_RETURN(const std::string v,
                          store.Get(ready_key(r), options.timeout));
    if (v != "ok" && first_problem.empty()) {
      first_problem = absl::StrCat("rank ", r, ": ", v);
    }
  }
  // Mapped everywhere (or given up): the name is no longer needed, and
  // unlinking now leaves nothing behind in /dev/shm when processes die.
  if (rank == 0 && !name.empty()) shm_unlink(name.c_str());
  if (!first_problem.empty()) return fall_back(first_problem);
  return std::unique_ptr<Communicator>(new ShmCommunicator(
      std::move(inner), std::move(region), options.timeout));
}

ShmCommunicator::ShmCommunicator(std::unique_ptr<Communicator> inner,
                                 std::shared_ptr<ShmRegion> region,
                                 absl::Duration timeout)
    : ForwardingCommunicator(std::move(inner)),
      rank_(this->inner().rank()),
      size_(this->inner().size()),
      name_(absl::StrCat("shm+", this->inner().name())),
      timeout_(timeout),
      region_(std::move(region)),
      executor_(
          [name = name_, rank = rank_, size = size_](const std::string& what) {
            return absl::StrCat(what, " on ", name, " (rank ", rank, " of ",
                                size, ")");
          }) {}

ShmCommunicator::~ShmCommunicator() = default;

absl::Status ShmCommunicator::Abort(absl::string_view reason) {
  executor_.Abort(reason);
  region_->Abort(reason);
  const absl::Status inner_status = inner().Abort(reason);
  if (!executor_.WaitIdle(absl::Now() + timeout_)) {
    return absl::DeadlineExceededError(absl::StrCat(
        "Abort on ", name_, ": the running collective did not stop within ",
        absl::FormatDuration(timeout_), "; its buffers must stay alive"));
  }
  return inner_status;
}

size_t ShmCommunicator::slot_bytes() const { return region_->slot_bytes(); }

std::unique_ptr<Work> ShmCommunicator::AllGatherSegments(
    const std::vector<Buffer>& inputs,
    const std::vector<std::vector<Buffer>>& outputs) {
  const std::string where = absl::StrCat("AllGatherSegments on ", name_);
  if (absl::Status status =
          CheckAllGatherSegments(where, inputs, outputs, size_);
      !status.ok()) {
    return CompletedWork(std::move(status));
  }
  const size_t total = TotalBytes(inputs);
  return executor_.Enqueue(
      absl::StrCat("AllGatherSegments(", inputs.size(), " segments, ", total,
                   " B/rank)"),
      [region = region_, inputs, outputs, total](
          uint64_t, const std::string& where) -> absl::Status {
        ShmRegion& r = *region;
        const int me = r.rank(), size = r.size();
        const size_t chunk = r.slot_bytes();
        for (size_t k = 0; k < inputs.size(); ++k) {
          const Buffer& own = outputs[me][k];
          if (own.data != inputs[k].data && own.count > 0)
            std::memcpy(own.data, inputs[k].data, own.bytes());
        }
        for (size_t c = 0; c < Chunks(total, chunk); ++c) {
          const size_t offset = c * chunk;
          const size_t n = std::min(chunk, total - offset);
          // Our chunk once into our broadcast mailbox, read by every peer.
          HSDP_ASSIGN_OR_RETURN(
              char* slot,
              r.AcquireSend(r.Broadcast(me), size - 1, /*peer=*/-1, where));
          Gather(inputs, offset, n, slot);
          r.CommitSend(r.Broadcast(me));
          // Peers in ring order from our right: spreads the readers out.
          for (int i = 1; i < size; ++i) {
            const int p = (me + i) % size;
            HSDP_ASSIGN_OR_RETURN(const char* src,
                                  r.AcquireRecv(r.Broadcast(p), p, where));
            Scatter(src, offset, n, outputs[p]);
            r.ReleaseRecv(r.Broadcast(p));
          }
        }
        return absl::OkStatus();
      });
}

std::unique_ptr<Work> ShmCommunicator::ReduceScatterSegments(
    const std::vector<std::vector<Buffer>>& inputs,
    const std::vector<Buffer>& outputs, const Buffer& /*scratch*/,
    ReduceOp op) {
  const std::string where = absl::StrCat("ReduceScatterSegments on ", name_);
  if (absl::Status status =
          CheckReduceScatterSegments(where, inputs, outputs, rank_, size_);
      !status.ok()) {
    return CompletedWork(std::move(status));
  }
  const DataType dtype =
      outputs.empty() ? DataType::kFloat32 : outputs[0].dtype;
  const size_t total = TotalBytes(outputs);
  return executor_.Enqueue(
      absl::StrCat("ReduceScatterSegments(", outputs.size(), " segments, ",
                   total, " B/rank, ", DataTypeName(dtype), ")"),
      [region = region_, inputs, outputs, total, dtype, op](
          uint64_t, const std::string& where) -> absl::Status {
        ShmRegion& r = *region;
        const int me = r.rank(), size = r.size();
        const size_t chunk = r.slot_bytes();
        const size_t element = ElementSize(dtype);
        std::vector<size_t> to_peer(size);
        size_t rounds = Chunks(total, chunk);
        for (int q = 0; q < size; ++q) {
          to_peer[q] = TotalBytes(inputs[q]);
          if (q != me) rounds = std::max(rounds, Chunks(to_peer[q], chunk));
        }
        std::vector<const char*> from(size);
        std::vector<const void*> terms(size);
        for (size_t c = 0; c < rounds; ++c) {
          const size_t offset = c * chunk;
          // Our contribution to each peer's chunk c, into our pair mailbox.
          for (int i = 1; i < size; ++i) {
            const int q = (me + i) % size;
            if (offset >= to_peer[q]) continue;
            HSDP_ASSIGN_OR_RETURN(char* slot,
                                  r.AcquireSend(r.Pair(me, q), 1, q, where));
            Gather(inputs[q], offset, std::min(chunk, to_peer[q] - offset),
                   slot);
            r.CommitSend(r.Pair(me, q));
          }
          if (offset >= total) continue;
          const size_t n = std::min(chunk, total - offset);
          for (int p = 0; p < size; ++p) {
            if (p == me) continue;
            HSDP_ASSIGN_OR_RETURN(from[p],
                                  r.AcquireRecv(r.Pair(p, me), p, where));
          }
          // Sum chunk c segment by segment, terms in rank order (the same
          // bits as the flat ReduceScatter), straight out of the mailboxes.
          ForEachSegmentPiece(
              outputs, offset, n,
              [&](size_t k, size_t in_segment, size_t in_range, size_t len) {
                for (int p = 0; p < size; ++p) {
                  terms[p] =
                      p == me ? static_cast<const char*>(inputs[me][k].data) +
                                    in_segment
                              : from[p] + in_range;
                }
                ReduceBuffers(terms.data(), size,
                              static_cast<int64_t>(len / element), dtype, op,
                              static_cast<char*>(outputs[k].data) + in_segment);
              });
          for (int p = 0; p < size; ++p) {
            if (p != me) r.ReleaseRecv(r.Pair(p, me));
          }
        }
        return absl::OkStatus();
      });
}

}  // namespace hsdp::comm
