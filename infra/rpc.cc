#include "infra/rpc.h"

#include <sys/stat.h>

#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace ragshard {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

grpc::ServerUnaryReactor* ReplyUnary(grpc::CallbackServerContext* ctx, const absl::Status& status) {
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

absl::StatusOr<std::string> ReadFileToString(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read '", path, "'"));
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  auto text = ReadFileToString(path);
  if (!text.ok()) return text.status();
  // A bearer token others can read is no secret (issue 26): refused, as ssh refuses such keys.
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) {
    return absl::NotFoundError(absl::StrCat("cannot stat token file '", path, "'"));
  }
  if ((st.st_mode & (S_IRWXG | S_IRWXO)) != 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "token file '%s' is open to other users (mode %04o): a bearer token must be readable "
        "by its owner only (chmod 600 '%s')",
        path, st.st_mode & 07777, path));
  }
  std::string token(absl::StripAsciiWhitespace(text->substr(0, text->find('\n'))));
  if (token.empty())
    return absl::InvalidArgumentError(absl::StrCat("token file '", path, "' is empty"));
  return token;
}

absl::StatusOr<ClientSecurity> LoadClientSecurity(const ClientSecurityOptions& options) {
  ClientSecurity security;
  if (!options.token_file.empty()) {
    auto token = ReadTokenFile(options.token_file);
    if (!token.ok()) return token.status();
    security.token = *token;
  }
  if (options.tls_ca_file.empty()) {
    if (!options.tls_cert_file.empty() || !options.tls_key_file.empty()) {
      return absl::InvalidArgumentError("--tls-cert/--tls-key need --tls-ca");
    }
    security.credentials = grpc::InsecureChannelCredentials();
    return security;
  }
  grpc::SslCredentialsOptions ssl;
  auto ca = ReadFileToString(options.tls_ca_file);
  if (!ca.ok()) return ca.status();
  ssl.pem_root_certs = *ca;
  if (options.tls_cert_file.empty() != options.tls_key_file.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  }
  if (!options.tls_cert_file.empty()) {
    auto cert = ReadFileToString(options.tls_cert_file);
    if (!cert.ok()) return cert.status();
    auto key = ReadFileToString(options.tls_key_file);
    if (!key.ok()) return key.status();
    ssl.pem_cert_chain = *cert;
    ssl.pem_private_key = *key;
  }
  security.credentials = grpc::SslCredentials(ssl);
  security.tls_server_name = options.tls_server_name;
  return security;
}

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address,
                                           const ClientSecurity& security) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  if (!security.tls_server_name.empty()) {
    args.SetSslTargetNameOverride(security.tls_server_name);
  }
  // Reconnect quickly after a planner restart.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  return grpc::CreateCustomChannel(address, security.credentials, args);
}

void Authorize(grpc::ClientContext* context, const ClientSecurity& security) {
  if (!security.token.empty()) context->AddMetadata("authorization", "Bearer " + security.token);
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> LoadServerCredentials(
    const ServerSecurityOptions& options) {
  if (options.tls_cert_file.empty() && options.tls_key_file.empty()) {
    if (!options.tls_client_ca_file.empty()) {
      return absl::InvalidArgumentError("--tls-client-ca needs --tls-cert and --tls-key");
    }
    return grpc::InsecureServerCredentials();
  }
  if (options.tls_cert_file.empty() || options.tls_key_file.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  }
  auto cert = ReadFileToString(options.tls_cert_file);
  if (!cert.ok()) return cert.status();
  auto key = ReadFileToString(options.tls_key_file);
  if (!key.ok()) return key.status();
  grpc::SslServerCredentialsOptions ssl(
      options.tls_client_ca_file.empty()
          ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
          : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  ssl.pem_key_cert_pairs.push_back({*key, *cert});
  if (!options.tls_client_ca_file.empty()) {
    auto ca = ReadFileToString(options.tls_client_ca_file);
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *ca;
  }
  return grpc::SslServerCredentials(ssl);
}

}  // namespace ragshard
