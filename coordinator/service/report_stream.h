// The coordinator's end of CoordinatorService.StreamReports: one read reactor
// per worker stream that records each report as it arrives.
//
// Why: at 1000+ workers a step's reports are a burst of unary calls, each
// paying for a whole gRPC call (call setup, metadata, status) on the
// coordinator; a message on a stream that is already open costs a fraction of
// that, so the coordinator's CPU per step drops with it.
//
// The reader sends its initial metadata (with kReportStreamMetadataKey) at
// once: a worker that sees it knows the stream is served, while an older
// coordinator answers UNIMPLEMENTED without it. Messages (a report, a commit
// vote, or both) are recorded in the order read, on gRPC's callback thread,
// one at a time; the first error ends the stream with that status. The worker
// closing its side ends it OK, after every report it sent was recorded. A
// server shutdown cancels open streams (they are calls in flight only while a
// report is being recorded).
//
// Thread-safety: gRPC serialises a reactor's callbacks; `record` must be
// thread-safe (several streams record at once).
#ifndef HSDP_COORDINATOR_SERVICE_REPORT_STREAM_H_
#define HSDP_COORDINATOR_SERVICE_REPORT_STREAM_H_

#include <functional>

#include "absl/status/status.h"
#include "hsdp/v1/coordinator_service.pb.h"

namespace grpc {
class CallbackServerContext;
template <class Request>
class ServerReadReactor;
}  // namespace grpc

namespace hsdp::coordinator {

// Initial-metadata key with which the coordinator says it serves
// StreamReports, and its value: "1" reports only, "2" also votes, "3" (this
// coordinator) also messages relayed for several workers by a host relay.
inline constexpr char kReportStreamMetadataKey[] = "hsdp-report-stream";
inline constexpr char kReportStreamVersion[] = "3";

// Records one message (its report, then its vote); called once per message.
using RecordReportFn =
    std::function<absl::Status(const hsdp::v1::StreamReportsRequest& message)>;

// A reader for the stream of `context`, that first checks `admitted` (e.g.
// the job token: a refused stream ends with it before reading anything).
// Owned by gRPC until its OnDone.
grpc::ServerReadReactor<hsdp::v1::StreamReportsRequest>* ReadReports(
    grpc::CallbackServerContext* context, const absl::Status& admitted,
    RecordReportFn record);

}  // namespace hsdp::coordinator

#endif  // HSDP_COORDINATOR_SERVICE_REPORT_STREAM_H_
