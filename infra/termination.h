// How the servers' mains wait for their end: SIGINT or SIGTERM.
#pragma once

namespace ragshard {

// Installs handlers for SIGINT and SIGTERM and returns once either has arrived (checked every
// 50 ms; the handler only sets a flag, which is async-signal-safe).
void WaitForTerminationSignal();

}  // namespace ragshard
