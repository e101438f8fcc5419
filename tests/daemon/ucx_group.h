// Test helper: runs a body in N forked processes connected by a UCX communicator. UCX state is
// created only in the children (it must not be inherited across fork).
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "server/daemon/ucx_comm.h"

namespace ragshard::daemon::testing {

struct UcxGroup {
  std::vector<pid_t> pids;
  std::vector<int> ready_fds;  // each child writes one byte once connected

  // body(rank, comm) runs in child `rank`; its return value is the exit code.
  static UcxGroup Spawn(int n, std::function<int(int, Comm&)> body) {
    UcxGroup g;
    std::vector<int> to_parent(n), from_parent(n);
    for (int r = 0; r < n; ++r) {
      int up[2], down[2], ready[2];
      if (pipe(up) != 0 || pipe(down) != 0 || pipe(ready) != 0) return g;
      pid_t pid = fork();
      if (pid == 0) {
        auto w = UcxWorker::Create("127.0.0.1", 0);
        if (!w.ok()) _exit(10);
        (*w)->AllowPeerHosts({"127.0.0.1"});
        std::string addr = (*w)->address() + "\n";
        if (write(up[1], addr.data(), addr.size()) != static_cast<ssize_t>(addr.size())) _exit(11);
        std::vector<std::string> addrs;
        std::string cur;
        char c;
        while (static_cast<int>(addrs.size()) < n && read(down[0], &c, 1) == 1) {
          if (c == '\n') {
            addrs.push_back(cur);
            cur.clear();
          } else {
            cur.push_back(c);
          }
        }
        auto comm = (*w)->Connect(r, addrs, absl::Now() + absl::Seconds(20));
        if (!comm.ok()) {
          std::fprintf(stderr, "rank %d connect: %s\n", r,
                       std::string(comm.status().message()).c_str());
          _exit(12);
        }
        char one = 1;
        if (write(ready[1], &one, 1) != 1) _exit(13);
        _exit(body(r, **comm));
      }
      close(up[1]);
      close(down[0]);
      close(ready[1]);
      to_parent[r] = up[0];
      from_parent[r] = down[1];
      g.pids.push_back(pid);
      g.ready_fds.push_back(ready[0]);
    }
    std::string all;
    for (int r = 0; r < n; ++r) {
      char c;
      while (read(to_parent[r], &c, 1) == 1) {
        all.push_back(c);
        if (c == '\n') break;
      }
    }
    for (int r = 0; r < n; ++r) {
      if (write(from_parent[r], all.data(), all.size()) < 0) break;
      close(from_parent[r]);
      close(to_parent[r]);
    }
    return g;
  }

  void WaitConnected() const {
    for (int fd : ready_fds) {
      char c;
      if (read(fd, &c, 1) != 1) break;
    }
  }

  static int ExitCode(pid_t pid) {
    int status = 0;
    waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
};

}  // namespace ragshard::daemon::testing
