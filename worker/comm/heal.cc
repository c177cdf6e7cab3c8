#include "worker/comm/heal.h"

#include <algorithm>
#include <memory>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"

namespace hsdp::comm {
namespace {

// The pieces of `state` that bytes `range` of its concatenation cover, as
// byte buffers.
std::vector<Buffer> Pieces(const std::vector<Buffer>& state, ByteRange range) {
  std::vector<Buffer> pieces;
  if (range.size() == 0) return pieces;
  ForEachSegmentPiece(
      state, range.begin, range.size(),
      [&](size_t k, size_t in_segment, size_t, size_t len) {
        pieces.push_back(Buffer{static_cast<char*>(state[k].data) + in_segment,
                                static_cast<int64_t>(len), DataType::kUInt8});
      });
  return pieces;
}

absl::Status CheckRoles(const Communicator& group, const HealRoles& roles) {
  const std::string where = absl::StrCat("HealState on ", group.name());
  if (!roles.targets.empty() && roles.sources.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": targets but no source"));
  }
  std::set<int> seen;
  for (const auto* list : {&roles.sources, &roles.targets}) {
    for (int r : *list) {
      if (r < 0 || r >= group.size()) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": rank ", r, " is outside the group [0, ",
                         group.size(), ")"));
      }
      if (!seen.insert(r).second) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": rank ", r,
                         " is named twice (a rank is a source or a "
                         "target, once)"));
      }
    }
  }
  return absl::OkStatus();
}

// Point-to-point: every part moves at once.
absl::Status HealBySendRecv(Communicator& group, const HealRoles& roles,
                            const std::vector<Buffer>& state) {
  const size_t total = TotalBytes(state);
  const int me = group.rank();
  const int parts = static_cast<int>(roles.sources.size());
  std::vector<Communicator::PeerTransfer> sends, recvs;
  const auto source = std::find(roles.sources.begin(), roles.sources.end(), me);
  if (source != roles.sources.end()) {
    const int index = static_cast<int>(source - roles.sources.begin());
    std::vector<Buffer> mine = Pieces(state, HealPart(total, parts, index));
    for (int t : roles.targets) sends.push_back({t, mine});
  }
  if (std::find(roles.targets.begin(), roles.targets.end(), me) !=
      roles.targets.end()) {
    for (int i = 0; i < parts; ++i) {
      recvs.push_back(
          {roles.sources[i], Pieces(state, HealPart(total, parts, i))});
    }
  }
  return group.SendRecv(sends, recvs)->Wait();
}

// Broadcasts: part i from source i to the whole group (the other sources
// receive their own bytes back, unchanged; a rank in neither list receives
// into a scratch buffer it then drops).
absl::Status HealByBroadcast(Communicator& group, const HealRoles& roles,
                             const std::vector<Buffer>& state) {
  const size_t total = TotalBytes(state);
  const int parts = static_cast<int>(roles.sources.size());
  const int me = group.rank();
  const bool involved =
      std::count(roles.sources.begin(), roles.sources.end(), me) +
          std::count(roles.targets.begin(), roles.targets.end(), me) >
      0;
  std::vector<std::vector<Buffer>> pieces(parts);
  size_t largest = 0;
  for (int i = 0; i < parts; ++i) {
    pieces[i] = Pieces(state, HealPart(total, parts, i));
    for (const Buffer& piece : pieces[i]) {
      largest = std::max(largest, piece.bytes());
    }
  }
  // The broadcasts run one at a time: one scratch serves them all.
  std::vector<char> scratch(involved ? 0 : largest);
  std::vector<std::unique_ptr<Work>> works;
  for (int i = 0; i < parts; ++i) {
    for (Buffer piece : pieces[i]) {
      if (!involved) piece.data = scratch.data();
      works.push_back(group.Broadcast(piece, roles.sources[i]));
    }
  }
  absl::Status first;
  for (auto& work : works) {
    absl::Status s = work->Wait();
    if (first.ok()) first = std::move(s);
  }
  return first;
}

}  // namespace

ByteRange HealPart(size_t total_bytes, int num_sources, int index) {
  const size_t units = (total_bytes + kHealPartAlign - 1) / kHealPartAlign;
  const size_t n = static_cast<size_t>(std::max(num_sources, 1));
  const size_t i = static_cast<size_t>(index);
  ByteRange range;
  range.begin = std::min(total_bytes, units * i / n * kHealPartAlign);
  range.end = std::min(total_bytes, units * (i + 1) / n * kHealPartAlign);
  return range;
}

absl::Status HealState(Communicator& group, const HealRoles& roles,
                       const std::vector<Buffer>& state) {
  if (absl::Status s = CheckRoles(group, roles); !s.ok()) return s;
  if (roles.targets.empty()) return absl::OkStatus();
  return group.SupportsSendRecv() ? HealBySendRecv(group, roles, state)
                                  : HealByBroadcast(group, roles, state);
}

}  // namespace hsdp::comm
