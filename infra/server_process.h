// The start of a server program (ragshard-planner, ragshardd): logging to stderr, the mutex
// settings and the open-file limit, before its flags are read.
#pragma once

namespace ragshard {

// Logs to stderr from the first line (glog would otherwise leave a log file in /tmp), turns off
// Abseil's mutex deadlock detection and raises the open-file limit (infra/open_files.h), logging
// the limit in force. Call first in main.
void StartServerProcess(const char* argv0);

}  // namespace ragshard
