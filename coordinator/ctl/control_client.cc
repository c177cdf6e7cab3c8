#include "coordinator/ctl/control_client.h"

#include <google/protobuf/util/json_util.h>

#include "absl/strings/ascii.h"
#include "common/file_util.h"

namespace hsdp::ctl {

absl::StatusOr<ControlClient> ControlClient::Connect(
    const GlobalOptions& options) {
  std::shared_ptr<grpc::ChannelCredentials> creds =
      grpc::InsecureChannelCredentials();
  if (!options.tls_ca.empty()) {
    grpc::SslCredentialsOptions ssl;
    HSDP_ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadFile(options.tls_ca));
    if (options.tls_client_cert.empty() != options.tls_client_key.empty()) {
      return absl::InvalidArgumentError(
          "--tls-client-cert and --tls-client-key go together");
    }
    if (!options.tls_client_cert.empty()) {
      HSDP_ASSIGN_OR_RETURN(ssl.pem_cert_chain,
                            ReadFile(options.tls_client_cert));
      HSDP_ASSIGN_OR_RETURN(ssl.pem_private_key,
                            ReadFile(options.tls_client_key));
    }
    creds = grpc::SslCredentials(ssl);
  } else if (!options.tls_client_cert.empty()) {
    return absl::InvalidArgumentError(
        "--tls-client-cert needs --tls-ca (the coordinator's CA)");
  }
  std::string token;
  if (!options.token_file.empty()) {
    HSDP_ASSIGN_OR_RETURN(std::string contents, ReadFile(options.token_file));
    token = std::string(absl::StripAsciiWhitespace(contents));
  }
  return ControlClient(
      ControlService::NewStub(grpc::CreateChannel(options.coordinator, creds)),
      std::move(token), options.timeout_seconds);
}

std::string ToJson(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  options.always_print_enums_as_ints = false;
  std::string json;
  // Printing a well-formed message cannot fail.
  (void)google::protobuf::util::MessageToJsonString(message, &json, options);
  return json;
}

}  // namespace hsdp::ctl
