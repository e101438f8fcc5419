// Passing file descriptors between processes over Unix domain sockets with SCM_RIGHTS, the
// side channel that carries memfds from the daemon to its local clients (gRPC cannot).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "infra/fd.h"

namespace ragshard {

// Listens on a Unix socket at `path` (removing a stale socket file first) with mode `mode`.
absl::StatusOr<ScopedFd> ListenUnix(const std::string& path, int mode);
absl::StatusOr<ScopedFd> ConnectUnix(const std::string& path);

// Sends `payload` (at most 64 KiB) together with `fds` in one message.
absl::Status SendWithFds(int socket, const std::string& payload, const std::vector<int>& fds);

// Receives one message: its payload and the descriptors that came with it (owned by the
// caller). Fails on EOF, on a truncated message or when more than `max_fds` arrive.
struct Received {
  std::string payload;
  std::vector<ScopedFd> fds;
};
absl::StatusOr<Received> ReceiveWithFds(int socket, size_t max_fds = 64);

// The peer's process id (SO_PEERCRED), for tying attachments to client processes.
absl::StatusOr<int> PeerPid(int socket);

// The peer's process, user and group as the kernel recorded them at connect (SO_PEERCRED).
struct PeerCredentials {
  int pid = 0;
  uint32_t uid = 0;
  uint32_t gid = 0;
};
absl::StatusOr<PeerCredentials> PeerCredentialsOf(int socket);

}  // namespace ragshard
