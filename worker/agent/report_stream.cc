#include "worker/agent/report_stream.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace hsdp::agent {
namespace {

// The coordinator's initial-metadata key saying it serves StreamReports
// (coordinator/service/report_stream.h; the agent links no coordinator code).
constexpr char kServedKey[] = "hsdp-report-stream";
// Its value from a coordinator that also counts votes on the stream.
constexpr char kVotesVersion[] = "2";

absl::Status ToAbsl(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      absl::StrCat("StreamReports: ", status.error_message()));
}

}  // namespace

ReportStream::ReportStream(std::shared_ptr<grpc::Channel> channel)
    : channel_(std::move(channel)),
      stub_(hsdp::v1::CoordinatorService::NewStub(channel_)) {}

ReportStream::~ReportStream() { Close().IgnoreError(); }

bool ReportStream::unsupported() const {
  absl::MutexLock lock(&mu_);
  return unsupported_;
}

absl::Status ReportStream::OpenLocked() {
  // Opening waits for the coordinator's first answer: only over a live
  // connection (ReportStep's deadline and retries cover the rest).
  if (channel_->GetState(/*try_to_connect=*/true) != GRPC_CHANNEL_READY) {
    return absl::UnavailableError(
        "StreamReports: not connected to the coordinator");
  }
  context_ = std::make_unique<grpc::ClientContext>();
  writer_ = stub_->StreamReports(context_.get(), &response_);
  writer_->WaitForInitialMetadata();
  const auto& metadata = context_->GetServerInitialMetadata();
  if (auto served = metadata.find(kServedKey); served != metadata.end()) {
    votes_ = served->second >= kVotesVersion;
    return absl::OkStatus();
  }
  // No marker: the call already ended (refused, unimplemented, unreachable).
  absl::Status why = FinishLocked(/*writes_done=*/false);
  if (why.ok()) why = absl::UnavailableError("StreamReports ended at once");
  if (why.code() == absl::StatusCode::kUnimplemented) unsupported_ = true;
  return why;
}

absl::Status ReportStream::FinishLocked(bool writes_done) {
  if (writer_ == nullptr) return absl::OkStatus();
  if (writes_done) writer_->WritesDone();
  const grpc::Status status = writer_->Finish();
  writer_.reset();
  context_.reset();
  return ToAbsl(status);
}

absl::Status ReportStream::Send(const hsdp::v1::ReportStepRequest& request) {
  hsdp::v1::StreamReportsRequest message;
  *message.mutable_report() = request;
  absl::MutexLock lock(&mu_);
  return WriteLocked(message);
}

absl::Status ReportStream::SendVote(const hsdp::v1::CommitStepRequest& vote) {
  hsdp::v1::StreamReportsRequest message;
  *message.mutable_vote() = vote;
  absl::MutexLock lock(&mu_);
  // Opens the stream first: the coordinator's marker says whether it counts
  // votes.
  if (writer_ == nullptr && !unsupported_) {
    if (absl::Status opened = OpenLocked(); !opened.ok()) return opened;
  }
  if (writer_ != nullptr && !votes_) {
    return absl::UnimplementedError(
        "the coordinator counts no votes on StreamReports");
  }
  return WriteLocked(message);
}

absl::Status ReportStream::WriteLocked(
    const hsdp::v1::StreamReportsRequest& message) {
  if (unsupported_) {
    return absl::UnimplementedError("the coordinator has no StreamReports");
  }
  if (writer_ == nullptr) {
    if (absl::Status opened = OpenLocked(); !opened.ok()) return opened;
  }
  if (writer_->Write(message)) return absl::OkStatus();
  // The stream ended (its status says why); this report was not sent.
  absl::Status why = FinishLocked(/*writes_done=*/false);
  if (why.ok()) why = absl::UnavailableError("StreamReports ended");
  return why;
}

absl::Status ReportStream::Close() {
  absl::MutexLock lock(&mu_);
  return FinishLocked(/*writes_done=*/true);
}

}  // namespace hsdp::agent
