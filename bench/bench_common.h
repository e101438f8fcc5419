// Shared by the collective benchmarks: sizes, timing and the CSV line every implementation prints
// ("impl,op,members,bytes,seconds,algbw_GBps,busbw_GBps"), with nccl-tests' definitions:
// `bytes` is the size of the full (gathered, or to-be-reduced) buffer, algbw = bytes / time and
// busbw = algbw * (n - 1) / n for all-gather and reduce-scatter.
#pragma once

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

namespace ragshard::bench {

inline std::vector<size_t> Sizes(size_t min_bytes = size_t{1} << 20,
                                 size_t max_bytes = size_t{256} << 20) {
  std::vector<size_t> out;
  for (size_t s = min_bytes; s <= max_bytes; s *= 4) out.push_back(s);
  return out;
}

inline int Iterations(size_t bytes) {
  return bytes <= (size_t{4} << 20) ? 20 : bytes <= (size_t{64} << 20) ? 5 : 3;
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
