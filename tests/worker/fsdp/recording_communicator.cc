#include "tests/worker/fsdp/recording_communicator.h"

#include <torch/csrc/autograd/custom_function.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace hsdp::fsdp::testing {
namespace {

const char* KindName(EventKind kind) {
  switch (kind) {
    case EventKind::kAllGather:
      return "AG";
    case EventKind::kHostAllGather:
      return "HAG";
    case EventKind::kReduceScatter:
      return "RS";
    case EventKind::kAllReduce:
      return "AR";
    case EventKind::kComputeBegin:
      return "begin";
    case EventKind::kComputeEnd:
      return "end";
  }
  return "?";
}

int64_t Counter(const UnitStats& u, EventKind kind) {
  switch (kind) {
    case EventKind::kAllGather:
      return u.all_gathers;
    case EventKind::kHostAllGather:
      return u.host_all_gathers;
    case EventKind::kReduceScatter:
      return u.reduce_scatters;
    case EventKind::kAllReduce:
      return u.all_reduces;
    default:
      return 0;
  }
}

// Identity whose backward records a compute event. The log and the event
// travel as integers through saved_data (the log outlives the graph).
struct OnBackwardFunction
    : public torch::autograd::Function<OnBackwardFunction> {
  static torch::autograd::variable_list forward(
      torch::autograd::AutogradContext* ctx, CollectiveLog* log, int64_t kind,
      int64_t unit, const at::Tensor& x) {
    ctx->saved_data["log"] = reinterpret_cast<int64_t>(log);
    ctx->saved_data["kind"] = kind;
    ctx->saved_data["unit"] = unit;
    return {x};
  }
  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::variable_list grads) {
    auto* log =
        reinterpret_cast<CollectiveLog*>(ctx->saved_data["log"].toInt());
    log->RecordCompute(static_cast<EventKind>(ctx->saved_data["kind"].toInt()),
                       static_cast<int>(ctx->saved_data["unit"].toInt()),
                       Phase::kBackward);
    return {at::Tensor(), at::Tensor(), at::Tensor(), grads[0]};
  }
};

}  // namespace

std::string CollectiveEvent::ToString() const {
  std::string s = absl::StrCat(KindName(kind), " u", unit, " mb", microbatch,
                               phase == Phase::kForward ? " fwd" : " bwd");
  if (is_collective() && during_unit >= 0) {
    absl::StrAppend(&s, " during u", during_unit);
  }
  return s;
}

void CollectiveLog::set_engine(const Engine* engine) {
  engine_ = engine;
  last_ = engine->Stats().units;
}

int CollectiveLog::UnitOfIssue(EventKind kind) {
  if (engine_ == nullptr) return -1;
  std::vector<UnitStats> now = engine_->Stats().units;
  int unit = -1;
  for (size_t i = 0; i < now.size() && i < last_.size(); ++i) {
    if (Counter(now[i], kind) > Counter(last_[i], kind)) {
      unit = static_cast<int>(i);
    }
  }
  last_ = std::move(now);
  return unit;
}

void CollectiveLog::RecordCollective(EventKind kind) {
  CollectiveEvent e{kind, UnitOfIssue(kind), microbatch_, phase_, running_};
  events_.push_back(e);
}

void CollectiveLog::RecordCompute(EventKind kind, int unit, Phase phase) {
  phase_ = phase;
  running_ = kind == EventKind::kComputeBegin ? unit : -1;
  events_.push_back(CollectiveEvent{kind, unit, microbatch_, phase, -1});
}

int CollectiveLog::Find(EventKind kind, int unit, int microbatch,
                        Phase phase) const {
  for (size_t i = 0; i < events_.size(); ++i) {
    const CollectiveEvent& e = events_[i];
    if (e.kind == kind && e.unit == unit && e.microbatch == microbatch &&
        e.phase == phase) {
      return static_cast<int>(i);
    }
  }
  return -1;
}

int64_t CollectiveLog::Count(EventKind kind, int microbatch) const {
  int64_t n = 0;
  for (const CollectiveEvent& e : events_) {
    if (e.kind == kind && (microbatch < 0 || e.microbatch == microbatch)) ++n;
  }
  return n;
}

std::string CollectiveLog::ToString() const {
  return absl::StrJoin(events_, ", ",
                       [](std::string* out, const CollectiveEvent& e) {
                         out->append(e.ToString());
                       });
}

at::Tensor OnBackward(CollectiveLog* log, EventKind kind, int unit,
                      const at::Tensor& x) {
  if (!x.requires_grad()) return x;
  return OnBackwardFunction::apply(log, static_cast<int64_t>(kind),
                                   static_cast<int64_t>(unit), x)[0];
}

RecordingCommunicator::RecordingCommunicator(comm::Communicator* inner,
                                             CollectiveLog* log, bool segments,
                                             EventKind gather_kind)
    : inner_(inner),
      log_(log),
      segments_(segments && inner->SupportsSegments()),
      gather_kind_(gather_kind) {}

void RecordingCommunicator::Record(EventKind kind) {
  if (log_ != nullptr) log_->RecordCollective(kind);
}

std::unique_ptr<comm::Work> RecordingCommunicator::AllGather(
    const comm::Buffer& input, const comm::Buffer& output) {
  ++all_gathers_;
  Record(gather_kind_);
  return inner_->AllGather(input, output);
}

std::unique_ptr<comm::Work> RecordingCommunicator::ReduceScatter(
    const comm::Buffer& input, const comm::Buffer& output, comm::ReduceOp op) {
  ++reduce_scatters_;
  Record(EventKind::kReduceScatter);
  return inner_->ReduceScatter(input, output, op);
}

std::unique_ptr<comm::Work> RecordingCommunicator::AllReduce(
    const comm::Buffer& buffer, comm::ReduceOp op) {
  ++all_reduces_;
  Record(EventKind::kAllReduce);
  return inner_->AllReduce(buffer, op);
}

std::unique_ptr<comm::Work> RecordingCommunicator::AllGatherSegments(
    const std::vector<comm::Buffer>& inputs,
    const std::vector<std::vector<comm::Buffer>>& outputs) {
  ++segment_calls_;
  ++all_gathers_;
  Record(gather_kind_);
  return inner_->AllGatherSegments(inputs, outputs);
}

std::unique_ptr<comm::Work> RecordingCommunicator::ReduceScatterSegments(
    const std::vector<std::vector<comm::Buffer>>& inputs,
    const std::vector<comm::Buffer>& outputs, const comm::Buffer& scratch,
    comm::ReduceOp op) {
  ++segment_calls_;
  ++reduce_scatters_;
  Record(EventKind::kReduceScatter);
  return inner_->ReduceScatterSegments(inputs, outputs, scratch, op);
}

std::unique_ptr<comm::Work> RecordingCommunicator::Broadcast(
    const comm::Buffer& buffer, int root) {
  return inner_->Broadcast(buffer, root);
}

std::unique_ptr<comm::Work> RecordingCommunicator::Barrier() {
  return inner_->Barrier();
}

}  // namespace hsdp::fsdp::testing
