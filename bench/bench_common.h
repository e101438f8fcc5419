// Shared by the collective benchmarks: sizes, timing and the CSV line every implementation prints
// ("impl,op,members,bytes,seconds,algbw_GBps,busbw_GBps"), with nccl-tests' definitions:
// `bytes` is the size of the full (gathered, or to-be-reduced) buffer, algbw = bytes / time and
// busbw = algbw * (n - 1) / n for all-gather and reduce-scatter.
#pragma once

#include <chrono>
#include <cstdio>
#include <cstring>
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

}  // namespace ragshard::bench
