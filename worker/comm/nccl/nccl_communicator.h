// NcclCommunicator: the CUDA backend of hsdp::comm::Communicator.
//
// Depends only on the CUDA runtime and NCCL (no LibTorch), so it builds
// wherever the CUDA toolkit and libnccl are installed, GPU or not (target
// `hsdp_nccl`, see cmake/cuda.cmake).
//
// Streams. Each communicator owns two high-priority, non-blocking CUDA streams:
// a *parameter* stream (AllGather, Broadcast) and a *gradient* stream
// (ReduceScatter, AllReduce, Barrier). Having two lets the next unit's
// all-gather (prefetch) proceed while the previous unit's reduce-scatter still
// runs, as FSDP2 does: their *inputs* become ready at different times, and
// neither should queue behind the other's wait on the compute stream. NCCL
// itself chains the kernels of one communicator in issue order (through the
// communicator's internal stream), which every rank shares, so two user streams
// cannot reorder collectives across ranks. The replicate dimension of an HSDP
// mesh is a different communicator with its own streams.
//
// Synchronisation with compute (no recordStream). On issue, an event is
// recorded on the caller's compute stream (see NcclOptions::compute_stream) and
// the comm stream waits on it, so the inputs the compute stream produced are
// ready. Work::Wait() makes the then-current compute stream wait on the
// collective's completion event; it does not block the CPU. The caller keeps
// every buffer alive and untouched until Wait() returned. This is FSDP2's
// reasoning: Tensor.record_stream() tells the caching allocator a block is used
// on another stream, and the allocator then defers reuse of that block until
// the CPU *observes* the recorded work finished (it polls events at later
// allocations). When the CPU runs ahead of the GPU that deferral is
// nondeterministic and inflates peak memory by whole all-gather buffers.
// Holding a reference until the consuming stream has waited instead frees the
// block on its allocating (compute) stream at a point already ordered after the
// collective, so it is reusable immediately and memory is deterministic.
//
// Errors. Communicators are created non-blocking (ncclConfig_t::blocking = 0):
// no NCCL call can hang the training thread. Enqueue and init are polled with
// ncclCommGetAsyncError, and a watchdog thread polls outstanding collectives;
// an async NCCL error, or a collective not finished within
// `collective_timeout`, aborts the communicator (ncclCommAbort) and every later
// call and Wait() returns a Status naming the collective, its sequence number
// and the communicator. An aborted communicator cannot be reused: rebuild it
// (new unique id) after a membership change.
#ifndef HSDP_WORKER_COMM_NCCL_NCCL_COMMUNICATOR_H_
#define HSDP_WORKER_COMM_NCCL_NCCL_COMMUNICATOR_H_

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "hsdp/communicator.h"
#include "hsdp/device_mesh.h"
#include "hsdp/store.h"
#include "worker/comm/nccl/nccl_errors.h"
#include "worker/comm/nccl/nccl_options.h"

namespace hsdp::comm {

// ---- Device-free helpers (no GPU needed; unit-tested on CPU machines) ----
// The error mapping (NcclResultToStatus, CudaErrorToStatus, CudaDeviceCount)
// is in nccl_errors.h.

// NCCL type for `dtype`; all DataType values are supported (bf16 →
// ncclBfloat16).
absl::StatusOr<ncclDataType_t> ToNcclDataType(DataType dtype);
ncclRedOp_t ToNcclRedOp(ReduceOp op);  // kAvg → ncclAvg (NCCL >= 2.10)

// The unique id travels through the Store as its raw 128 bytes.
std::string EncodeUniqueId(const ncclUniqueId& id);
absl::StatusOr<ncclUniqueId> DecodeUniqueId(absl::string_view bytes);

// ---- Communicator ----

// Shared by a communicator and its Work objects (nccl_comm_state.h).
class NcclCommState;

// Thread-safety: collectives must be issued from one thread at a time (the
// interface's ordering contract); the watchdog thread and Work::Wait() on other
// threads are safe. Destroy after every Work was waited on.
class NcclCommunicator : public Communicator {
 public:
  // Bootstraps a communicator of `size` ranks on `options.device`: rank 0
  // generates an ncclUniqueId and Sets it under `store_key`; the others Get it
  // (up to init_timeout). The key must be unique per communicator and
  // generation, e.g. "<prefix>/nccl/shard/<replicate index>".
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Create(
      Store& store, const std::string& store_key, int rank, int size,
      NcclOptions options);
  ~NcclCommunicator()
      override;  // Finalizes (flushes) then destroys; aborts if that times out.
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override;
  int size() const override;
  std::string name() const override;

  std::unique_ptr<Work> AllGather(const Buffer& input,
                                  const Buffer& output) override;
  std::unique_ptr<Work> ReduceScatter(const Buffer& input, const Buffer& output,
                                      ReduceOp op) override;
  std::unique_ptr<Work> AllReduce(const Buffer& buffer, ReduceOp op) override;
  std::unique_ptr<Work> Broadcast(const Buffer& buffer, int root) override;
  std::unique_ptr<Work> Barrier() override;

  // Blocks the CPU until every collective issued so far finished, or aborts the
  // communicator after `timeout` and returns DEADLINE_EXCEEDED naming the
  // oldest unfinished collective.
  absl::Status Synchronize(absl::Duration timeout);
  // Aborts now (e.g. the coordinator declared a peer dead). Later calls fail
  // with `reason`.
  void Abort(const absl::Status& reason);
  // Communicator::Abort: ncclCommAbort (kernels in flight are torn down, so
  // no buffer is touched afterwards); later calls fail with ABORTED naming
  // `reason`. Never blocks on peers.
  absl::Status Abort(absl::string_view reason) override;
  // The first error this communicator hit (OK if none).
  absl::Status status() const;

  cudaStream_t param_stream() const;
  cudaStream_t grad_stream() const;

 private:
  explicit NcclCommunicator(std::shared_ptr<NcclCommState> state);
  std::shared_ptr<NcclCommState> state_;
};

// Groups the collectives issued on this thread until End() (or destruction)
// into one NCCL launch (ncclGroupStart/ncclGroupEnd), e.g. the all-gathers of
// several units prefetched together, or the shard reduce-scatter and an
// unrelated all-reduce. Works issued inside the group complete at End();
// waiting on one before End() is FAILED_PRECONDITION. Not copyable; nests.
class NcclGroup {
 public:
  NcclGroup();
  ~NcclGroup();
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;
  // Launches the group; returns the first start/enqueue error (naming the
  // communicator).
  absl::Status End();

 private:
  bool ended_ = false;
  absl::Status start_status_;
};

// The DeviceMesh hook: builds each mesh dimension's NcclCommunicator, named
// "<base name>:<group kind>" (e.g. "nccl:shard"), its unique id exchanged under
// "<group prefix>/nccl_unique_id" in `store`. `store` must outlive the factory
// calls.
CommunicatorFactory NcclCommunicatorFactory(Store& store,
                                            NcclOptions base_options);

}  // namespace hsdp::comm

#endif  // HSDP_WORKER_COMM_NCCL_NCCL_COMMUNICATOR_H_
