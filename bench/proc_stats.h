// What the benchmarks read about a process they started (the planner): /proc/PID/status
// figures, CPU time, and the bytes its TCP sockets on a port have sent (the kernel's
// tcp_info bytes_sent, read with iproute2's `ss`).
#pragma once

#include <sys/types.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>

namespace ragshard::bench {

// A figure of /proc/PID/status ("Threads"; "VmRSS" and "VmHWM" in kB), or -1.
inline int64_t ProcStatus(pid_t pid, const std::string& key) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(key + ":", 0) == 0) return std::stoll(line.substr(key.size() + 1));
  }
  return -1;
}

// User plus system CPU seconds of the process so far.
inline double CpuSeconds(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const size_t close = text.rfind(')');
  if (close == std::string::npos) return -1;
  std::istringstream in(text.substr(close + 2));
  std::string field;
  long utime = 0, stime = 0;
  for (int i = 3; i <= 15 && in >> field; ++i) {
    if (i == 14) utime = std::stol(field);
    if (i == 15) stime = std::stol(field);
  }
  return static_cast<double>(utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// The bytes sent so far by the established TCP sockets whose local port is `port` (a server's
// accepted connections), or -1 when `ss` cannot be run. Closed sockets are not counted: read it
// while the connections are open.
inline int64_t TcpBytesSent(int port) {
  const std::string cmd =
      "ss -tinH state established '( sport = :" + std::to_string(port) + " )' 2>/dev/null";
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return -1;
  std::string out;
  char buf[65536];
  for (size_t n; (n = std::fread(buf, 1, sizeof(buf), p)) > 0;) out.append(buf, n);
  if (::pclose(p) != 0) return -1;
  int64_t total = 0;
  const std::string key = "bytes_sent:";
  for (size_t at = out.find(key); at != std::string::npos; at = out.find(key, at + 1)) {
    total += std::stoll(out.substr(at + key.size(), 24));
  }
  return total;
}

}  // namespace ragshard::bench
