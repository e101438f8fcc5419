// A copy for data the copying thread will not read again (the all-gather's placement of a
// rank's own shard into the unsharded buffer): on x86-64 its stores bypass the caches
// (non-temporal), so that it neither reads the destination first nor evicts what the transfers
// beside it are using. glibc's memcpy does the same only above a threshold of hundreds of MiB.
#pragma once

#include <cstddef>

namespace ragshard::daemon {

// Copies `bytes` from `src` to `dst` (not overlapping). Its stores are ordered before return.
void StreamCopy(char* dst, const char* src, size_t bytes);

}  // namespace ragshard::daemon
