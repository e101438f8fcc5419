#include "protocol/fd_passing.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace ragshard {
namespace {

absl::Status Errno(const std::string& what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
}

absl::StatusOr<sockaddr_un> Address(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("socket path '", path, "' is longer than ", sizeof(addr.sun_path) - 1));
  }
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  return addr;
}

constexpr size_t kMaxPayload = 64 * 1024;

}  // namespace

absl::StatusOr<ScopedFd> ListenUnix(const std::string& path, int mode) {
  auto addr = Address(path);
  if (!addr.ok()) return addr.status();
  ScopedFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return Errno("socket");
  ::unlink(path.c_str());
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&*addr), sizeof(*addr)) != 0) {
    return Errno(absl::StrCat("bind '", path, "'"));
  }
  if (::chmod(path.c_str(), static_cast<mode_t>(mode)) != 0) return Errno("chmod " + path);
  if (::listen(fd.get(), 128) != 0) return Errno("listen " + path);
  return fd;
}

absl::StatusOr<ScopedFd> ConnectUnix(const std::string& path) {
  auto addr = Address(path);
  if (!addr.ok()) return addr.status();
  ScopedFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return Errno("socket");
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&*addr), sizeof(*addr)) != 0) {
    return Errno(absl::StrCat("connect '", path, "'"));
  }
  return fd;
}

absl::Status SendWithFds(int socket, const std::string& payload, const std::vector<int>& fds) {
  if (payload.empty() || payload.size() > kMaxPayload) {
    return absl::InvalidArgumentError("payload must be 1 byte to 64 KiB");
  }
  // Length-prefixed so that the receiver knows the message boundary on a stream socket.
  const uint32_t len = static_cast<uint32_t>(payload.size());
  std::string frame(reinterpret_cast<const char*>(&len), sizeof(len));
  frame += payload;
  iovec iov{const_cast<char*>(frame.data()), frame.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<char> control(CMSG_SPACE(sizeof(int) * fds.size()));
  if (!fds.empty()) {
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
    cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(cmsg), fds.data(), sizeof(int) * fds.size());
  }
  ssize_t sent = ::sendmsg(socket, &msg, MSG_NOSIGNAL);
  if (sent < 0) return Errno("sendmsg");
  // The descriptors went with the first byte; send any remainder plainly.
  size_t off = static_cast<size_t>(sent);
  while (off < frame.size()) {
    ssize_t n = ::send(socket, frame.data() + off, frame.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return Errno("send");
    off += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::StatusOr<Received> ReceiveWithFds(int socket, size_t max_fds) {
  Received out;
  uint32_t len = 0;
  std::vector<char> control(CMSG_SPACE(sizeof(int) * max_fds));
  iovec iov{&len, sizeof(len)};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control.data();
  msg.msg_controllen = control.size();
  ssize_t n = ::recvmsg(socket, &msg, MSG_CMSG_CLOEXEC | MSG_WAITALL);
  if (n == 0) return absl::UnavailableError("peer closed the connection");
  if (n < 0) return Errno("recvmsg");
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int fd = -1;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        out.fds.emplace_back(fd);
      }
    }
  }
  if (msg.msg_flags & MSG_CTRUNC) return absl::InvalidArgumentError("too many descriptors");
  if (static_cast<size_t>(n) < sizeof(len)) {
    // Read the rest of the length prefix.
    ssize_t m = ::recv(socket, reinterpret_cast<char*>(&len) + n, sizeof(len) - n, MSG_WAITALL);
    if (m != static_cast<ssize_t>(sizeof(len) - n)) return absl::DataLossError("truncated frame");
  }
  if (len == 0 || len > kMaxPayload) return absl::DataLossError("bad frame length");
  out.payload.resize(len);
  size_t off = 0;
  while (off < len) {
    ssize_t m = ::recv(socket, out.payload.data() + off, len - off, MSG_WAITALL);
    if (m <= 0) return absl::DataLossError("truncated frame");
    off += static_cast<size_t>(m);
  }
  return out;
}

absl::StatusOr<int> PeerPid(int socket) {
  auto cred = PeerCredentialsOf(socket);
  if (!cred.ok()) return cred.status();
  return cred->pid;
}

absl::StatusOr<PeerCredentials> PeerCredentialsOf(int socket) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(socket, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return Errno("SO_PEERCRED");
  return PeerCredentials{static_cast<int>(cred.pid), cred.uid, cred.gid};
}

}  // namespace ragshard
