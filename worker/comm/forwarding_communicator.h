// ForwardingCommunicator: a Communicator that passes every call to the one it
// wraps. The base of wrappers that change a few calls and keep the rest:
// ShmCommunicator moves the segment collectives into shared memory, tests
// count or hide calls.
//
// Thread-safety: as the wrapped communicator's (the Communicator contract);
// the wrapper itself adds no state.
#ifndef HSDP_WORKER_COMM_FORWARDING_COMMUNICATOR_H_
#define HSDP_WORKER_COMM_FORWARDING_COMMUNICATOR_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "hsdp/communicator.h"

namespace hsdp::comm {

class ForwardingCommunicator : public Communicator {
 public:
  // `inner` must not be null; it is destroyed after the derived class's
  // members.
  explicit ForwardingCommunicator(std::unique_ptr<Communicator> inner)
      : inner_(std::move(inner)) {}
  ForwardingCommunicator(const ForwardingCommunicator&) = delete;
  ForwardingCommunicator& operator=(const ForwardingCommunicator&) = delete;

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string name() const override { return inner_->name(); }

  std::unique_ptr<Work> AllGather(const Buffer& input,
                                  const Buffer& output) override {
    return inner_->AllGather(input, output);
  }
  std::unique_ptr<Work> ReduceScatter(const Buffer& input, const Buffer& output,
                                      ReduceOp op) override {
    return inner_->ReduceScatter(input, output, op);
  }
  std::unique_ptr<Work> AllReduce(const Buffer& buffer, ReduceOp op) override {
    return inner_->AllReduce(buffer, op);
  }
  bool SupportsSegments() const override { return inner_->SupportsSegments(); }
  std::unique_ptr<Work> AllGatherSegments(
      const std::vector<Buffer>& inputs,
      const std::vector<std::vector<Buffer>>& outputs) override {
    return inner_->AllGatherSegments(inputs, outputs);
  }
  int64_t ReduceScatterScratchCount(int64_t output_count) const override {
    return inner_->ReduceScatterScratchCount(output_count);
  }
  std::unique_ptr<Work> ReduceScatterSegments(
      const std::vector<std::vector<Buffer>>& inputs,
      const std::vector<Buffer>& outputs, const Buffer& scratch,
      ReduceOp op) override {
    return inner_->ReduceScatterSegments(inputs, outputs, scratch, op);
  }
  std::unique_ptr<Work> Broadcast(const Buffer& buffer, int root) override {
    return inner_->Broadcast(buffer, root);
  }
  std::unique_ptr<Work> Barrier() override { return inner_->Barrier(); }
  bool SupportsSendRecv() const override { return inner_->SupportsSendRecv(); }
  std::unique_ptr<Work> SendRecv(
      const std::vector<PeerTransfer>& sends,
      const std::vector<PeerTransfer>& recvs) override {
    return inner_->SendRecv(sends, recvs);
  }
  absl::Status Abort(absl::string_view reason) override {
    return inner_->Abort(reason);
  }

 protected:
  Communicator& inner() const { return *inner_; }

 private:
  const std::unique_ptr<Communicator> inner_;
};

}  // namespace hsdp::comm

#endif  // HSDP_WORKER_COMM_FORWARDING_COMMUNICATOR_H_
