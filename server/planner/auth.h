// The planner's bearer-token check: every call carries "authorization: Bearer <token>" when the
// planner was started with a token. Comparisons take constant time.
//
// Thread-safe: a pure function.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "grpcpp/grpcpp.h"

namespace ragshard::planner {

// OK when no token is configured or the call carries the one it needs: `admin_token` for an
// admin call when one is set, else `token`. UNAUTHENTICATED for a missing or wrong token;
// PERMISSION_DENIED when an admin call carries the ordinary token.
absl::Status CheckBearerToken(const grpc::CallbackServerContext& ctx, const std::string& token,
                              const std::string& admin_token, bool admin);

}  // namespace ragshard::planner
