#include "coordinator/service/report_stream.h"

#include <grpcpp/grpcpp.h>

#include <utility>

#include "coordinator/service/grpc_status.h"

namespace hsdp::coordinator {
namespace {

class ReportReader final
    : public grpc::ServerReadReactor<hsdp::v1::StreamReportsRequest> {
 public:
  ReportReader(grpc::CallbackServerContext* context, RecordReportFn record)
      : record_(std::move(record)) {
    context->AddInitialMetadata(kReportStreamMetadataKey, kReportStreamVersion);
    StartSendInitialMetadata();
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the worker closed its side, or the call was cancelled
      Finish(grpc::Status::OK);
      return;
    }
    const absl::Status recorded = record_(request_);
    if (!recorded.ok()) {
      Finish(ToGrpcStatus(recorded));
      return;
    }
    StartRead(&request_);
  }

  void OnDone() override { delete this; }

 private:
  const RecordReportFn record_;
  hsdp::v1::StreamReportsRequest request_;
};

class RefusedReader final
    : public grpc::ServerReadReactor<hsdp::v1::StreamReportsRequest> {
 public:
  explicit RefusedReader(const absl::Status& why) { Finish(ToGrpcStatus(why)); }
  void OnDone() override { delete this; }
};

}  // namespace

grpc::ServerReadReactor<hsdp::v1::StreamReportsRequest>* ReadReports(
    grpc::CallbackServerContext* context, const absl::Status& admitted,
    RecordReportFn record) {
  if (!admitted.ok()) return new RefusedReader(admitted);
  return new ReportReader(context, std::move(record));
}

}  // namespace hsdp::coordinator
