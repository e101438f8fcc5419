// Shared by the collective benchmarks: sizes, timing and the CSV line every implementation prints
// ("impl,op,members,bytes,seconds,algbw_GBps,busbw_GBps"), with nccl-tests' definitions:
// `bytes` is the size of the full (gathered, or to-be-reduced) buffer, algbw = bytes / time and
// busbw = algbw * (n - 1) / n for all-gather and reduce-scatter.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace ragshard::bench {

// The command line's first word for every benchmark with "--flag value" pairs: -h or --help
// prints `usage` and answers 0 (exit with it: the benchmark does not run); a flag without its
// value is an error (2) naming it; otherwise -1 (go on).
inline int UsageCheck(int argc, char** argv, const char* usage) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "-h") == 0 || std::strcmp(argv[i], "--help") == 0) {
      std::fputs(usage, stdout);
      return 0;
    }
  }
  if ((argc - 1) % 2 != 0) {
    std::fprintf(stderr, "error: %s needs a value\n%s", argv[argc - 1], usage);
    return 2;
  }
  return -1;
}

inline std::vector<size_t> Sizes(size_t min_bytes = size_t{1} << 20,
                                 size_t max_bytes = size_t{256} << 20) {
  std::vector<size_t> out;
  for (size_t s = min_bytes; s <= max_bytes; s *= 4) out.push_back(s);
  return out;
}

// Timed iterations per size, the same in every benchmark of this folder. The small sizes run
// more of them: an operation of 1 MiB takes a few hundred microseconds, and 20 of them were a
// few milliseconds of a shared 2-core machine, whose medians moved by 2x between runs.
inline int Iterations(size_t bytes) {
  return bytes <= (size_t{1} << 20)    ? 200
         : bytes <= (size_t{4} << 20)  ? 50
         : bytes <= (size_t{64} << 20) ? 5
                                       : 3;
}

inline double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline void PrintRow(const std::string& impl, const std::string& op, int n, size_t bytes,
                     double seconds) {
  const double alg = static_cast<double>(bytes) / seconds / 1e9;
  const double bus = alg * (n - 1) / n;
  std::printf("%s,%s,%d,%zu,%.6f,%.4f,%.4f\n", impl.c_str(), op.c_str(), n, bytes, seconds, alg,
              bus);
  std::fflush(stdout);
}

// `n` lines from `fd`, without their newlines (fewer where it ends first).
inline std::vector<std::string> ReadLines(int fd, int n) {
  std::vector<std::string> lines;
  std::string cur;
  char c;
  while (static_cast<int>(lines.size()) < n && read(fd, &c, 1) == 1) {
    if (c == '\n') {
      lines.push_back(cur);
      cur.clear();
    } else {
      cur.push_back(c);
    }
  }
  return lines;
}

// The processes of a benchmark's group, one per member (ForkMembers).
struct Members {
  std::vector<pid_t> pids;
  std::vector<int> up;  // the read end of each member's pipe to the parent
};

// Forks `n` members: member r exits with `run(r, up, down)`, `up` its pipe to the parent and
// `down` the parent's to it. Each member first writes its address, one line, up; once all have,
// every member gets all of them in rank order down (ReadLines(down, n)), which then closes. What
// members write up after their address stays for the parent to read (Members::up). False when a
// pipe cannot be made.
inline bool ForkMembers(int n, const std::function<int(int rank, int up, int down)>& run,
                        Members* out) {
  std::vector<int> down(n);
  out->up.assign(n, -1);
  for (int r = 0; r < n; ++r) {
    int u[2], d[2];
    if (pipe(u) != 0 || pipe(d) != 0) return false;
    std::fflush(stdout);
    const pid_t pid = fork();
    if (pid == 0) {
      close(u[0]);
      close(d[1]);
      for (int q = 0; q < r; ++q) {
        close(out->up[q]);
        close(down[q]);
      }
      _exit(run(r, u[1], d[0]));
    }
    close(u[1]);
    close(d[0]);
    out->up[r] = u[0];
    down[r] = d[1];
    out->pids.push_back(pid);
  }
  std::string addresses;
  for (int r = 0; r < n; ++r) {
    for (const std::string& line : ReadLines(out->up[r], 1)) addresses += line + "\n";
  }
  bool written = true;
  for (int r = 0; r < n; ++r) {
    written &= write(down[r], addresses.data(), addresses.size()) >= 0;
    close(down[r]);
  }
  return written;
}

// Waits for every member: 0 when each exited 0, else 1, naming each failure on stderr.
inline int WaitMembers(const Members& members) {
  int rc = 0;
  for (size_t r = 0; r < members.pids.size(); ++r) {
    int status = 0;
    waitpid(members.pids[r], &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      std::fprintf(stderr, "error: member %zu failed (%s %d)\n", r,
                   WIFEXITED(status) ? "exit" : "signal",
                   WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
      rc = 1;
    }
  }
  return rc;
}

}  // namespace ragshard::bench
