#include "worker/comm/gloo/gloo_segments.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <utility>

#include "gloo/context.h"
#include "gloo/transport/unbound_buffer.h"
#include "gloo/types.h"
#include "worker/comm/reduce_kernels.h"

namespace hsdp::comm {
namespace {

// Slot prefix of the segment collectives' messages; Gloo's own algorithms use
// other prefixes, and the tag (issue counter) separates calls.
constexpr uint8_t kSegmentSlotPrefix = 0x5e;
// Slot prefix of SendRecv's messages.
constexpr uint8_t kSendRecvSlotPrefix = 0x5f;

// ReduceScatterSegments moves each stream in size-1 parts, one round each, so
// the peers' contributions need one output's worth of scratch, not size-1.
int Rounds(int size) { return std::max(1, size - 1); }

// A segment list split for transfer: segments under `pack_below_bytes` travel
// packed together, the others on their own (empty ones not at all).
struct SegmentSplit {
  std::vector<Buffer> large;
  std::vector<size_t> large_k;  // index in the full list of large[i]
  std::vector<size_t> small_k;
  size_t small_bytes = 0;
};

SegmentSplit SplitSegments(const std::vector<Buffer>& segments,
                           size_t pack_below_bytes) {
  SegmentSplit split;
  for (size_t k = 0; k < segments.size(); ++k) {
    const size_t bytes = segments[k].bytes();
    if (bytes == 0) continue;
    if (bytes < pack_below_bytes) {
      split.small_k.push_back(k);
      split.small_bytes += bytes;
    } else {
      split.large.push_back(segments[k]);
      split.large_k.push_back(k);
    }
  }
  return split;
}

// Copies segments[k] for each k of `indices`, one after another, to `dst`.
void Pack(const std::vector<Buffer>& segments,
          const std::vector<size_t>& indices, char* dst) {
  for (size_t k : indices) {
    std::memcpy(dst, segments[k].data, segments[k].bytes());
    dst += segments[k].bytes();
  }
}

// The reverse of Pack: fills segments[k] for each k of `indices` from `src`.
void Unpack(const char* src, const std::vector<size_t>& indices,
            const std::vector<Buffer>& segments) {
  for (size_t k : indices) {
    std::memcpy(segments[k].data, src, segments[k].bytes());
    src += segments[k].bytes();
  }
}

std::vector<int> Peers(const gloo::Context& context) {
  std::vector<int> peers;
  for (int p = 0; p < context.size; ++p) {
    if (p != context.rank) peers.push_back(p);
  }
  return peers;
}

// The point-to-point messages of one call. Waits with one deadline for the
// whole call; on an exception (timeout, lost peer) the buffers are handed to
// the orphans instead of being freed under Gloo.
class PointToPoint {
 public:
  PointToPoint(const GlooSegmentsOptions& options, uint8_t slot_prefix)
      : context_(*options.context),
        slot_(gloo::Slot::build(slot_prefix, options.tag)),
        orphans_(*options.orphans),
        deadline_(std::chrono::steady_clock::now() +
                  std::chrono::milliseconds(
                      absl::ToInt64Milliseconds(options.timeout))) {}
  PointToPoint(const PointToPoint&) = delete;
  PointToPoint& operator=(const PointToPoint&) = delete;
  ~PointToPoint() {
    if (!finished_) {
      for (auto& b : buffers_) orphans_.push_back(std::move(b.buffer));
    }
  }

  // Messages between one pair on one slot are matched in posting order.
  void Send(void* data, size_t bytes, const std::vector<int>& peers) {
    if (bytes == 0 || peers.empty()) return;
    Entry& e = Add(data, bytes);
    for (int p : peers) e.buffer->send(p, slot_, 0, bytes);
    e.sends += static_cast<int>(peers.size());
  }
  // Receives `bytes` from `peer` at `offset` of the region (data,
  // region_bytes); consecutive receives into the same region share one buffer.
  void Recv(void* data, size_t region_bytes, size_t offset, size_t bytes,
            int peer) {
    if (bytes == 0) return;
    if (buffers_.empty() || buffers_.back().buffer->ptr != data ||
        buffers_.back().buffer->size != region_bytes) {
      Add(data, region_bytes);
    }
    Entry& e = buffers_.back();
    e.buffer->recv(peer, slot_, offset, bytes);
    ++e.recvs;
  }
  void WaitAll() {
    for (Entry& e : buffers_) {
      for (; e.recvs > 0; --e.recvs) e.buffer->waitRecv(Remaining());
    }
    for (Entry& e : buffers_) {
      for (; e.sends > 0; --e.sends) e.buffer->waitSend(Remaining());
    }
    finished_ = true;
  }

 private:
  struct Entry {
    std::unique_ptr<gloo::transport::UnboundBuffer> buffer;
    int sends = 0;
    int recvs = 0;
  };
  Entry& Add(void* data, size_t bytes) {
    buffers_.push_back(Entry{context_.createUnboundBuffer(data, bytes)});
    return buffers_.back();
  }
  // At least 1 ms: Gloo reads -1 ms as "the context default".
  std::chrono::milliseconds Remaining() const {
    return std::max(std::chrono::milliseconds(1),
                    std::chrono::duration_cast<std::chrono::milliseconds>(
                        deadline_ - std::chrono::steady_clock::now()));
  }

  gloo::Context& context_;
  const uint64_t slot_;
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>>& orphans_;
  const std::chrono::steady_clock::time_point deadline_;
  std::deque<Entry> buffers_;  // stable addresses while adding
  bool finished_ = false;
};

}  // namespace

void GlooAllGatherSegments(const GlooSegmentsOptions& options,
                           const std::vector<Buffer>& inputs,
                           const std::vector<std::vector<Buffer>>& outputs) {
  const gloo::Context& context = *options.context;
  const std::vector<int> peers = Peers(context);
  const SegmentSplit split = SplitSegments(inputs, options.pack_below_bytes);
  const size_t packed_bytes = split.small_bytes;
  // [0]: ours; [1 + i]: the i-th peer's.
  std::vector<char> packed(packed_bytes * context.size);
  Pack(inputs, split.small_k, packed.data());
  PointToPoint messages(options, kSegmentSlotPrefix);
  messages.Send(packed.data(), packed_bytes, peers);
  for (const Buffer& in : split.large) {
    messages.Send(in.data, in.bytes(), peers);
  }
  for (size_t i = 0; i < peers.size(); ++i) {
    const int p = peers[i];
    messages.Recv(packed.data(), packed.size(), (1 + i) * packed_bytes,
                  packed_bytes, p);
    for (size_t k : split.large_k) {
      const Buffer& out = outputs[p][k];
      messages.Recv(out.data, out.bytes(), 0, out.bytes(), p);
    }
  }
  // Our own segments while the peers' arrive.
  for (size_t k = 0; k < inputs.size(); ++k) {
    const Buffer& own = outputs[context.rank][k];
    if (own.data != inputs[k].data && own.count > 0)
      std::memcpy(own.data, inputs[k].data, own.bytes());
  }
  messages.WaitAll();
  for (size_t i = 0; i < peers.size(); ++i) {
    Unpack(packed.data() + (1 + i) * packed_bytes, split.small_k,
           outputs[peers[i]]);
  }
}

int64_t GlooReduceScatterScratchCount(int size, int64_t output_count) {
  if (size == 1) return 0;
  const int rounds = Rounds(size);
  return (size - 1) * ((output_count + rounds - 1) / rounds);
}

void GlooReduceScatterSegments(const GlooSegmentsOptions& options,
                               const std::vector<std::vector<Buffer>>& inputs,
                               const std::vector<Buffer>& outputs,
                               const Buffer& scratch, ReduceOp op) {
  const int size = options.context->size;
  const int me = options.context->rank;
  const DataType dtype = outputs.empty() ? scratch.dtype : outputs[0].dtype;
  const size_t element = ElementSize(dtype);
  const int rounds = Rounds(size);
  // Each stream (our contributions to a peer, the peers' to us) is split by
  // the receiver's segment sizes, which both ends know: small segments travel
  // packed in one message in round 0, large ones straight from and into the
  // caller's memory over the rounds.
  const SegmentSplit mine = SplitSegments(outputs, options.pack_below_bytes);
  std::vector<SegmentSplit> to(static_cast<size_t>(size));
  for (int p = 0; p < size; ++p) {
    if (p != me) to[p] = SplitSegments(inputs[p], options.pack_below_bytes);
  }
  auto slot_of = [me](int p) { return p < me ? p : p - 1; };
  std::vector<std::vector<char>> packed_out(size);
  std::vector<char> packed_in(mine.small_bytes * (size - 1));
  // Round j moves part j of every large stream (elements [E*j/R, E*(j+1)/R)
  // of E): the peers' parts of ours land in scratch slot slot_of(p), then are
  // summed.
  auto part = [rounds, element](int64_t elements, int j) {
    const size_t lo = static_cast<size_t>(elements * j / rounds);
    const size_t hi = static_cast<size_t>(elements * (j + 1) / rounds);
    return std::pair<size_t, size_t>(lo * element, (hi - lo) * element);
  };
  const int64_t total = TotalCount(outputs);
  const int64_t large_total = TotalCount(mine.large);
  const size_t slot_bytes =
      static_cast<size_t>((total + rounds - 1) / rounds) * element;
  char* base = static_cast<char*>(scratch.data);
  const size_t scratch_bytes = slot_bytes * (size - 1);
  std::vector<const void*> terms(static_cast<size_t>(size));
  for (int j = 0; j < rounds; ++j) {
    PointToPoint messages(options, kSegmentSlotPrefix);
    for (int p = 0; p < size; ++p) {
      if (p == me) continue;
      if (j == 0 && !to[p].small_k.empty()) {
        packed_out[p].resize(to[p].small_bytes);
        Pack(inputs[p], to[p].small_k, packed_out[p].data());
        messages.Send(packed_out[p].data(), packed_out[p].size(), {p});
      }
      if (j == 0 && !mine.small_k.empty()) {
        messages.Recv(packed_in.data(), packed_in.size(),
                      slot_of(p) * mine.small_bytes, mine.small_bytes, p);
      }
      const auto [to_offset, to_bytes] = part(TotalCount(to[p].large), j);
      ForEachSegmentPiece(
          to[p].large, to_offset, to_bytes,
          [&](size_t i, size_t in_segment, size_t, size_t len) {
            messages.Send(static_cast<char*>(to[p].large[i].data) + in_segment,
                          len, {p});
          });
      const auto [from_offset, from_bytes] = part(large_total, j);
      const size_t slot = static_cast<size_t>(slot_of(p)) * slot_bytes;
      ForEachSegmentPiece(mine.large, from_offset, from_bytes,
                          [&](size_t, size_t, size_t in_range, size_t len) {
                            messages.Recv(base, scratch_bytes, slot + in_range,
                                          len, p);
                          });
    }
    messages.WaitAll();
    if (j == 0) {
      size_t at = 0;
      for (size_t k : mine.small_k) {
        for (int r = 0; r < size; ++r) {
          terms[r] =
              r == me ? inputs[me][k].data
                      : packed_in.data() + slot_of(r) * mine.small_bytes + at;
        }
        ReduceBuffers(terms.data(), size, outputs[k].count, dtype, op,
                      outputs[k].data);
        at += outputs[k].bytes();
      }
    }
    const auto [offset, bytes] = part(large_total, j);
    ForEachSegmentPiece(
        mine.large, offset, bytes,
        [&](size_t i, size_t in_segment, size_t in_range, size_t len) {
          const size_t k = mine.large_k[i];
          for (int r = 0; r < size; ++r) {
            terms[r] =
                r == me
                    ? static_cast<const char*>(inputs[me][k].data) + in_segment
                    : base + static_cast<size_t>(slot_of(r)) * slot_bytes +
                          in_range;
          }
          ReduceBuffers(terms.data(), size, static_cast<int64_t>(len / element),
                        dtype, op,
                        static_cast<char*>(outputs[k].data) + in_segment);
        });
  }
}

void GlooSendRecv(const GlooSegmentsOptions& options,
                  const std::vector<Communicator::PeerTransfer>& sends,
                  const std::vector<Communicator::PeerTransfer>& recvs) {
  PointToPoint messages(options, kSendRecvSlotPrefix);
  for (const Communicator::PeerTransfer& t : recvs) {
    for (const Buffer& b : t.buffers) {
      messages.Recv(b.data, b.bytes(), 0, b.bytes(), t.peer);
    }
  }
  for (const Communicator::PeerTransfer& t : sends) {
    for (const Buffer& b : t.buffers) {
      messages.Send(b.data, b.bytes(), {t.peer});
    }
  }
  messages.WaitAll();
}

}  // namespace hsdp::comm
