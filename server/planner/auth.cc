#include "server/planner/auth.h"

namespace ragshard::planner {
namespace {

bool ConstantTimeEqual(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace

absl::Status CheckBearerToken(const grpc::CallbackServerContext& ctx, const std::string& token,
                              const std::string& admin_token, bool admin) {
  const std::string& need = admin && !admin_token.empty() ? admin_token : token;
  if (need.empty()) return absl::OkStatus();
  const auto& md = ctx.client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) return absl::UnauthenticatedError("missing bearer token");
  const std::string got(it->second.data(), it->second.size());
  if (ConstantTimeEqual(got, "Bearer " + need)) return absl::OkStatus();
  if (admin && !token.empty() && ConstantTimeEqual(got, "Bearer " + token)) {
    return absl::PermissionDeniedError("this call needs the admin token");
  }
  return absl::UnauthenticatedError("invalid bearer token");
}

}  // namespace ragshard::planner
