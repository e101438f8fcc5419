// gRPC plumbing shared by every component: the one place where absl::Status and grpc::Status
// convert, credentials for TLS and bearer tokens, and message size limits.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"

namespace ragshard {

// Large enough for a DeepSeek-V3 inventory (45k tensors, about 4 MB) or plan at any W, with room
// to spare.
inline constexpr int kMaxMessageBytes = 256 << 20;

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

// Finishes a unary callback call with `status` and returns its reactor, for a handler to return.
// It takes the call's ctx->DefaultReactor(): only for a handler that has not taken it before
// (DefaultReactor constructs the reactor anew at each call, dropping a Finish made on the first
// one); such a handler finishes its reactor itself.
grpc::ServerUnaryReactor* ReplyUnary(grpc::CallbackServerContext* ctx, const absl::Status& status);

// Reads a whole file; NOT_FOUND names the path.
absl::StatusOr<std::string> ReadFileToString(const std::string& path);

// Reads a bearer token file: the first line, surrounding whitespace removed. An empty token is
// an error, and so is a file that group or others may read or write (FAILED_PRECONDITION).
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

// Client-side security, the same flags for every client of the planner (ragshardctl, the
// library, the daemon): --token-file, --tls-ca (server CA; enables TLS), and --tls-cert /
// --tls-key for mutual TLS.
struct ClientSecurityOptions {
  std::string token_file;
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  // Override of the name checked against the server certificate (default: the host in ADDR).
  std::string tls_server_name;
};

// What a client needs to open channels and to authenticate calls.
struct ClientSecurity {
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  std::string token;  // empty: no authorization metadata
  std::string tls_server_name;
};

absl::StatusOr<ClientSecurity> LoadClientSecurity(const ClientSecurityOptions& options);

// A channel to `address` with the security and the message size limits above.
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address,
                                           const ClientSecurity& security);

// Adds "authorization: Bearer <token>" when the token is set.
void Authorize(grpc::ClientContext* context, const ClientSecurity& security);

// Server TLS: --tls-cert and --tls-key, and --tls-client-ca to require client certificates.
struct ServerSecurityOptions {
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_client_ca_file;
};
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> LoadServerCredentials(
    const ServerSecurityOptions& options);

}  // namespace ragshard
