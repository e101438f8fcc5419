// Test helper: runs a body in N forked processes connected by a UCX communicator. UCX state is
// created only in the children (it must not be inherited across fork), and the parent forks only
// while it runs no other thread: a thread of the parent that was exiting at a fork (its stack's
// madvise, hooked by UCX's memory events) left the children a UCM lock that nobody would release,
// and both children hung in ucp_init.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/daemon/ucx_comm.h"

namespace ragshard::daemon::testing {

// Marks from the bodies to the parent, for a test that acts once the children have reached a
// point (an operation under way) rather than after a delay. Make it before Spawn, so that the
// children inherit it, and call Spawned() after: a body calls Mark(), the parent Await(n).
class Marks {
 public:
  Marks() {
    if (pipe(fds_) != 0) fds_[0] = fds_[1] = -1;
  }
  ~Marks() {
    for (int fd : fds_) {
      if (fd >= 0) close(fd);
    }
  }
  Marks(const Marks&) = delete;
  Marks& operator=(const Marks&) = delete;
  // In a child: one mark.
  void Mark() {
    const char one = 1;
    if (write(fds_[1], &one, 1) != 1) {
      // the parent is gone; nothing waits for the mark
    }
  }
  // In the parent, once the children are forked: closes its own write end, so that Await ends
  // when every child has exited without marking.
  void Spawned() {
    if (fds_[1] >= 0) close(fds_[1]);
    fds_[1] = -1;
  }
  // In the parent: true once `n` marks came; false when every child ended first.
  bool Await(int n) {
    char c;
    for (int got = 0; got < n; ++got) {
      if (read(fds_[0], &c, 1) != 1) return false;
    }
    return true;
  }

 private:
  int fds_[2];
};

// A data-plane check's failure, as a message: in a child of a UcxGroup it goes to the parent
// through the group's pipe (UcxGroup::ExpectSucceeded reports it as a gtest failure naming the
// child); in the test's own process it is a gtest failure at once. Returns 1, for the body's
// exit code: `if (bad) return Fail("what differed");`.
inline int g_failure_fd = -1;    // the group's pipe, in a child
inline int g_failure_rank = -1;  // the child's rank
inline int Fail(const std::string& what) {
  if (g_failure_fd < 0) {
    ADD_FAILURE() << what;
    return 1;
  }
  const std::string line = absl::StrCat("rank ", g_failure_rank, ": ", what, "\n");
  if (write(g_failure_fd, line.data(), line.size()) < 0) {
    // the parent is gone; the exit code still says it
  }
  return 1;
}

struct UcxGroup {
  // A child still running after this long has hung (every body's operations have deadlines far
  // shorter); SIGALRM ends it, and its exit code (128 + 14) names the hang instead of a test
  // that waits for ctest's timeout.
  static constexpr unsigned kWatchdogSeconds = 300;

  std::vector<pid_t> pids;
  std::vector<int> ready_fds;  // each child writes one byte once connected
  std::thread releaser;        // releases the children once every body has returned
  int failure_fd = -1;         // the read end of the children's failure messages (Fail)

  UcxGroup() = default;
  UcxGroup(UcxGroup&&) = default;
  UcxGroup& operator=(UcxGroup&&) = delete;
  // Joined, so that no thread of this group is running (or exiting) when the next group forks.
  ~UcxGroup() {
    if (releaser.joinable()) releaser.join();
    if (failure_fd >= 0) close(failure_fd);
  }

  // Waits for every child: each message a child sent with Fail, and each exit code other than
  // 0, is a gtest failure naming the child.
  void ExpectSucceeded() {
    for (size_t r = 0; r < pids.size(); ++r) {
      EXPECT_EQ(ExitCode(pids[r]), 0) << "rank " << r << "'s exit code";
    }
    std::string messages;
    char buf[4096];
    for (ssize_t n; failure_fd >= 0 && (n = read(failure_fd, buf, sizeof(buf))) > 0;) {
      messages.append(buf, static_cast<size_t>(n));
    }
    for (size_t at = 0; at < messages.size();) {
      const size_t end = messages.find('\n', at);
      ADD_FAILURE() << messages.substr(at, end - at);
      at = end == std::string::npos ? messages.size() : end + 1;
    }
  }

  // body(rank, comm) runs in child `rank`; its return value is the exit code. Child `rank`
  // connects for job job_of(rank) ("" when not given); a failed connect exits with
  // connect_failed(rank, status), or 12 when not given. Bodies start once every child has
  // connected (or failed to), and a child closes its comm only once every body has returned (or
  // its child died), as a daemon keeps a failed job's comm: no member leaves while another is
  // still saying hello or reading a notice.
  static UcxGroup Spawn(int n, std::function<int(int, Comm&)> body,
                        std::function<std::string(int)> job_of = nullptr,
                        std::function<int(int, const absl::Status&)> connect_failed = nullptr) {
    UcxGroup g;
    std::vector<int> to_parent(n), from_parent(n), go_fds(n), fin_fds(n), release_fds(n);
    int failures[2];
    if (pipe(failures) != 0) return g;
    for (int r = 0; r < n; ++r) {
      int up[2], down[2], ready[2], go[2], fin[2], release[2];
      if (pipe(up) != 0 || pipe(down) != 0 || pipe(ready) != 0 || pipe(go) != 0 || pipe(fin) != 0 ||
          pipe(release) != 0) {
        return g;
      }
      pid_t pid = fork();
      if (pid == 0) {
        alarm(kWatchdogSeconds);
        close(failures[0]);
        g_failure_fd = failures[1];
        g_failure_rank = r;
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
        auto comm =
            (*w)->Connect(r, addrs, absl::Now() + absl::Seconds(20), job_of ? job_of(r) : "");
        if (!comm.ok()) {
          std::fprintf(stderr, "rank %d connect: %s\n", r,
                       std::string(comm.status().message()).c_str());
          _exit(connect_failed ? connect_failed(r, comm.status()) : 12);
        }
        char one = 1;
        if (write(ready[1], &one, 1) != 1) _exit(13);
        if (read(go[0], &one, 1) != 1) _exit(14);
        const int code = body(r, **comm);
        if (write(fin[1], &one, 1) != 1) _exit(15);
        // Released by the end of file, once the parent's end closes (and those of the children
        // forked later, which inherited it, have exited).
        close(release[1]);
        if (read(release[0], &one, 1) < 0) _exit(16);
        comm->reset();  // what it sent reaches the peers before the process ends
        _exit(code);
      }
      close(up[1]);
      close(down[0]);
      close(ready[1]);
      close(go[0]);
      close(fin[1]);
      close(release[0]);
      go_fds[r] = go[1];
      fin_fds[r] = fin[0];
      release_fds[r] = release[1];
      to_parent[r] = up[0];
      from_parent[r] = down[1];
      g.pids.push_back(pid);
      g.ready_fds.push_back(ready[0]);
    }
    close(failures[1]);  // the children hold the write ends: end of file once all exited
    g.failure_fd = failures[0];
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
    g.WaitConnected();
    signal(SIGPIPE, SIG_IGN);  // a child that exited early must not take the test with it
    for (int r = 0; r < n; ++r) {
      const char go = 1;
      if (write(go_fds[r], &go, 1) != 1) {
        // The child is gone already; its exit code tells.
      }
      close(go_fds[r]);
    }
    // Releases the children once every one has finished its body or died.
    g.releaser = std::thread([fin_fds, release_fds] {
      for (int fd : fin_fds) {
        char c;
        if (read(fd, &c, 1) != 1) {
          // died
        }
        close(fd);
      }
      for (int fd : release_fds) close(fd);  // end of file releases every child
    });
    return g;
  }

  // Reads each child's "connected" byte (or its end, when it exited); Spawn does it before it
  // lets the bodies start, so later calls return at once.
  void WaitConnected() {
    for (int& fd : ready_fds) {
      if (fd < 0) continue;
      char c;
      if (read(fd, &c, 1) != 1) {
        // exited without connecting
      }
      close(fd);
      fd = -1;
    }
  }

  static int ExitCode(pid_t pid) {
    int status = 0;
    waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
};

}  // namespace ragshard::daemon::testing
