// Who may take the pool's memfd over the daemon's side channel, checked on the peer's
// credentials (SO_PEERCRED) besides the socket file's mode: the daemon's own user, root, or,
// where the daemon serves a group (--socket-group), a process with that group as its primary
// or one of its supplementary groups.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "protocol/fd_passing.h"

namespace ragshard::daemon {

// The supplementary groups of process `pid` (the "Groups:" line of /proc/PID/status); empty
// when the process is gone.
std::vector<gid_t> SupplementaryGroups(int pid);

// OK when `peer` may attach; PERMISSION_DENIED names its uid and what it lacks. `group` is
// (gid_t)-1 when the daemon serves its own user only; `groups` are the peer's supplementary
// groups.
absl::Status CheckPeer(const PeerCredentials& peer, const std::vector<gid_t>& groups,
                       uid_t daemon_uid, gid_t group, const std::string& group_name);

}  // namespace ragshard::daemon
