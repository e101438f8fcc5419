// ragshardctl, the admin CLI. The offline commands (`plan`, `compare`) need no server.
#pragma once

#include <ostream>

namespace ragshard {

// Runs ragshardctl with the given arguments. Writes results to `out` and one-line errors to
// `err`. Returns the process exit code: 0 on success, 2 for bad input (flags, files, shapes),
// 1 for other failures.
int RunCtl(int argc, const char* const* argv, std::ostream& out, std::ostream& err);

}  // namespace ragshard
