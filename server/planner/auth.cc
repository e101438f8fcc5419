#include "server/planner/auth.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "infra/secrets.h"
#include "server/planner/store.h"

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

absl::StatusOr<std::string> DefaultTokenFile(const std::string& data_dir) {
  if (absl::Status s = MakeDataDir(data_dir); !s.ok()) return s;
  const std::string path = data_dir + "/token";
  struct stat st {};
  if (stat(path.c_str(), &st) == 0) return path;
  const std::string token = absl::BytesToHexString(RandomBytes(32));
  // Written whole under another name, then renamed: a crash never leaves a partial token.
  const std::string tmp = path + ".tmp";
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create the token file '", tmp, "': ", std::strerror(errno)));
  }
  const std::string line = token + "\n";
  const bool written = write(fd, line.data(), line.size()) == static_cast<ssize_t>(line.size()) &&
                       fchmod(fd, 0600) == 0 && fsync(fd) == 0;
  const int saved = errno;
  close(fd);
  if (!written || rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot write the token file '", path, "': ", std::strerror(written ? errno : saved)));
  }
  return path;
}

}  // namespace ragshard::planner
