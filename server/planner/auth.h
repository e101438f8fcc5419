// The planner's bearer tokens: the check every call passes ("authorization: Bearer <token>"),
// comparing in constant time, and the token a planner started without --token-file keeps in its
// data directory.
//
// Thread-safe: pure functions (DefaultTokenFile writes one file).
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"

namespace ragshard::planner {

// OK when no token is configured or the call carries the one it needs: `admin_token` for an
// admin call when one is set, else `token`. UNAUTHENTICATED for a missing or wrong token;
// PERMISSION_DENIED when an admin call carries the ordinary token.
absl::Status CheckBearerToken(const grpc::CallbackServerContext& ctx, const std::string& token,
                              const std::string& admin_token, bool admin);

// Secure by default (issue 26): DATA_DIR/token, created at the first start with 32 random bytes
// (64 hex digits), mode 0600, in a data directory of mode 0700 (created if missing). Returns its
// path; its token is read like any --token-file (infra/rpc.h ReadTokenFile), so a file others
// may read is refused.
absl::StatusOr<std::string> DefaultTokenFile(const std::string& data_dir);

}  // namespace ragshard::planner
