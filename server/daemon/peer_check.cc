#include "server/daemon/peer_check.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace ragshard::daemon {

std::vector<gid_t> SupplementaryGroups(int pid) {
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::vector<gid_t> groups;
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("Groups:", 0) != 0) continue;
    std::istringstream in(line.substr(7));
    for (gid_t g; in >> g;) groups.push_back(g);
    break;
  }
  return groups;
}

absl::Status CheckPeer(const PeerCredentials& peer, const std::vector<gid_t>& groups,
                       uid_t daemon_uid, gid_t group, const std::string& group_name) {
  if (peer.uid == daemon_uid || peer.uid == 0) return absl::OkStatus();
  if (group != static_cast<gid_t>(-1) &&
      (peer.gid == group || std::find(groups.begin(), groups.end(), group) != groups.end())) {
    return absl::OkStatus();
  }
  return absl::PermissionDeniedError(absl::StrCat(
      "process ", peer.pid, " of uid ", peer.uid,
      " may not attach: it is not the daemon's user (uid ", daemon_uid, ")",
      group != static_cast<gid_t>(-1) ? absl::StrCat(" nor in its group '", group_name, "'") : ""));
}

}  // namespace ragshard::daemon
