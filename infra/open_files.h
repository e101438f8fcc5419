// The open-file limit of a server process: the planner holds a connection per daemon (2,048
// nodes are more than the usual soft limit of 1,024 descriptors) and a daemon one per peer node.
#pragma once

#include <sys/resource.h>

#include <cstdint>

namespace ragshard {

// Raises the soft limit on open files to the hard limit; returns the soft limit now in force
// (-1 when it cannot be read).
inline int64_t RaiseOpenFileLimit() {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0) return -1;
  if (lim.rlim_cur < lim.rlim_max) {
    rlimit raised = lim;
    raised.rlim_cur = lim.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) lim = raised;
  }
  return lim.rlim_cur == RLIM_INFINITY ? INT64_MAX : static_cast<int64_t>(lim.rlim_cur);
}

}  // namespace ragshard
