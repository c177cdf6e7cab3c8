// Test support: a Communicator that wraps a real one and records what the
// engine issues through it, so tests can assert the order of collectives
// against the schedule.
//
// A CollectiveLog is one rank's sequence of events: each collective issued
// (kind, unit, microbatch) interleaved with the begin and end of every unit's
// forward and backward compute, which the test's model marks (MarkForward /
// MarkBackward). A collective's place in that sequence is its moment relative
// to unit compute; each collective also notes the compute running when it was
// issued. The unit a collective belongs to is found from the engine's per-unit
// counters, which the engine bumps just before it issues (UnitOfIssue).
//
// Thread-safety: a CollectiveLog and the communicators writing to it belong to
// one rank, driven by that rank's training thread (and the autograd thread
// while it waits in backward, serialised with it): thread-compatible.
#ifndef HSDP_TESTS_WORKER_FSDP_RECORDING_COMMUNICATOR_H_
#define HSDP_TESTS_WORKER_FSDP_RECORDING_COMMUNICATOR_H_

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "hsdp/communicator.h"
#include "hsdp/fully_shard.h"

namespace hsdp::fsdp::testing {

enum class EventKind {
  kAllGather,
  // An all-gather over the host group (hierarchical reshard).
  kHostAllGather,
  kReduceScatter,
  kAllReduce,
  kComputeBegin,
  kComputeEnd,
};
enum class Phase { kForward, kBackward };

struct CollectiveEvent {
  EventKind kind;
  int unit = -1;
  int microbatch = 0;
  // Compute events: their phase. Collectives: the phase of the latest compute
  // event before them, and the unit whose compute was running (-1 if none).
  Phase phase = Phase::kForward;
  int during_unit = -1;

  bool is_collective() const {
    return kind == EventKind::kAllGather || kind == EventKind::kHostAllGather ||
           kind == EventKind::kReduceScatter || kind == EventKind::kAllReduce;
  }
  std::string ToString() const;
};

class CollectiveLog {
 public:
  // The engine whose per-unit counters name the unit of each collective.
  void set_engine(const Engine* engine);
  void set_microbatch(int microbatch) { microbatch_ = microbatch; }
  // The driver says when backward() starts: the root's pre-backward (and its
  // prefetches) run before any compute of backward is marked.
  void set_phase(Phase phase) {
    phase_ = phase;
    running_ = -1;
  }
  void Clear() { events_.clear(); }

  void RecordCollective(EventKind kind);
  void RecordCompute(EventKind kind, int unit, Phase phase);

  const std::vector<CollectiveEvent>& events() const { return events_; }
  // Index of the first event matching, or -1.
  int Find(EventKind kind, int unit, int microbatch, Phase phase) const;
  int64_t Count(EventKind kind, int microbatch = -1) const;
  // "AG u2 mb0 fwd during u1, ..." for failure messages.
  std::string ToString() const;

 private:
  // The unit whose counter for `kind` went up since the last call.
  int UnitOfIssue(EventKind kind);

  const Engine* engine_ = nullptr;
  std::vector<UnitStats> last_;
  int microbatch_ = 0;
  Phase phase_ = Phase::kForward;
  int running_ = -1;
  std::vector<CollectiveEvent> events_;
};

// `x` unchanged; when autograd's backward reaches it, records a backward
// compute event `kind` of `unit` (compute-begin on a unit's output, which
// backward reaches first; compute-end on its input, reached last). Forward
// compute events the model records itself (RecordCompute). `log` must outlive
// the backward.
at::Tensor OnBackward(CollectiveLog* log, EventKind kind, int unit,
                      const at::Tensor& x);

// Forwards every call to `inner`, counting the collectives and, with a log,
// recording them. `segments` false hides the inner segment support, so the
// engine takes its flat path (copy-in, AllGather / ReduceScatter, copy-out;
// the NCCL path) over a Gloo communicator. Does not own `inner` or `log`.
class RecordingCommunicator : public comm::Communicator {
 public:
  // `gather_kind`: what its all-gathers are recorded as (kHostAllGather for
  // a host group).
  RecordingCommunicator(comm::Communicator* inner, CollectiveLog* log,
                        bool segments,
                        EventKind gather_kind = EventKind::kAllGather);

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string name() const override { return inner_->name(); }

  std::unique_ptr<comm::Work> AllGather(const comm::Buffer& input,
                                        const comm::Buffer& output) override;
  std::unique_ptr<comm::Work> ReduceScatter(const comm::Buffer& input,
                                            const comm::Buffer& output,
                                            comm::ReduceOp op) override;
  std::unique_ptr<comm::Work> AllReduce(const comm::Buffer& buffer,
                                        comm::ReduceOp op) override;
  bool SupportsSegments() const override { return segments_; }
  int64_t ReduceScatterScratchCount(int64_t output_count) const override {
    return inner_->ReduceScatterScratchCount(output_count);
  }
  std::unique_ptr<comm::Work> AllGatherSegments(
      const std::vector<comm::Buffer>& inputs,
      const std::vector<std::vector<comm::Buffer>>& outputs) override;
  std::unique_ptr<comm::Work> ReduceScatterSegments(
      const std::vector<std::vector<comm::Buffer>>& inputs,
      const std::vector<comm::Buffer>& outputs, const comm::Buffer& scratch,
      comm::ReduceOp op) override;
  std::unique_ptr<comm::Work> Broadcast(const comm::Buffer& buffer,
                                        int root) override;
  std::unique_ptr<comm::Work> Barrier() override;

  int64_t all_gathers() const { return all_gathers_; }
  int64_t reduce_scatters() const { return reduce_scatters_; }
  int64_t all_reduces() const { return all_reduces_; }
  // Segment collectives forwarded (the flat-only mode expects none).
  int64_t segment_calls() const { return segment_calls_; }

 private:
  void Record(EventKind kind);

  comm::Communicator* const inner_;
  CollectiveLog* const log_;
  const bool segments_;
  const EventKind gather_kind_;
  std::atomic<int64_t> all_gathers_{0};
  std::atomic<int64_t> reduce_scatters_{0};
  std::atomic<int64_t> all_reduces_{0};
  std::atomic<int64_t> segment_calls_{0};
};

// The flat path over a CPU communicator (no recording).
class FlatOnlyCommunicator : public RecordingCommunicator {
 public:
  explicit FlatOnlyCommunicator(comm::Communicator* inner)
      : RecordingCommunicator(inner, nullptr, /*segments=*/false) {}
};

}  // namespace hsdp::fsdp::testing

#endif  // HSDP_TESTS_WORKER_FSDP_RECORDING_COMMUNICATOR_H_
