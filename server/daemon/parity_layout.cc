#include "server/daemon/parity_layout.h"

#include <algorithm>

namespace ragshard::daemon {

RedundancyScheme SchemeOf(const Redundancy& redundancy) {
  RedundancyScheme s;
  s.replica = redundancy.kind == Redundancy::Kind::kReplica;
  s.hsdp = redundancy.kind == Redundancy::Kind::kHsdp;
  s.k = s.replica || s.hsdp ? 1 : redundancy.k;
  return s;
}

std::vector<ChunkRef> ParitySources(const RedundancyScheme& scheme, int nodes, int holder) {
  if (scheme.replica) return {{(holder + nodes - 1) % nodes, 0}};
  const int g = scheme.k + 1;
  const int base = holder / g * g;
  const int s = holder - base;  // the stripe this holder keeps
  std::vector<ChunkRef> out;
  for (int q = 0; q < g; ++q) {
    if (q != s) out.push_back({base + q, s < q ? s : s - 1});
  }
  return out;
}

int ParityHolder(const RedundancyScheme& scheme, int nodes, int node, int chunk) {
  if (scheme.replica) return (node + 1) % nodes;
  const int g = scheme.k + 1;
  const int base = node / g * g;
  const int p = node - base;
  return base + (chunk < p ? chunk : chunk + 1);
}

std::vector<int64_t> StripeBytes(const RedundancyScheme& scheme, const std::vector<int64_t>& blob) {
  const int nodes = static_cast<int>(blob.size());
  std::vector<int64_t> out(blob.size(), 0);
  if (scheme.replica) {
    for (int h = 0; h < nodes; ++h) out[h] = blob[(h + nodes - 1) % nodes];
    return out;
  }
  const int g = scheme.k + 1;
  for (int base = 0; base + g <= nodes; base += g) {
    int64_t sum = 0;
    int64_t most = 0;
    for (int q = base; q < base + g; ++q) sum += blob[q], most = std::max(most, blob[q]);
    // Whether stripes max(0, p - blob[h]) cover every node's blob with its K chunks.
    auto covers = [&](int64_t p) {
      for (int q = base; q < base + g; ++q) {
        int64_t have = 0;
        for (int h = base; h < base + g; ++h) {
          if (h != q) have += std::max<int64_t>(0, p - blob[h]);
        }
        if (have < blob[q]) return false;
      }
      return true;
    };
    int64_t lo = 0;
    int64_t hi = most + sum;  // covers: each of K stripes is at least sum / K there
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (covers(mid)) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    for (int h = base; h < base + g; ++h) out[h] = std::max<int64_t>(0, lo - blob[h]);
  }
  return out;
}

ChunkSpan ChunkOf(const RedundancyScheme& scheme, const std::vector<int64_t>& stripes,
                  const std::vector<int64_t>& blob, int node, int chunk) {
  const int nodes = static_cast<int>(blob.size());
  if (scheme.replica) return {0, blob[node]};
  int64_t offset = 0;
  for (int c = 0; c < chunk; ++c) offset += stripes[ParityHolder(scheme, nodes, node, c)];
  const int64_t stripe = stripes[ParityHolder(scheme, nodes, node, chunk)];
  offset = std::min(offset, blob[node]);
  return {offset, std::min(blob[node] - offset, stripe)};
}

}  // namespace ragshard::daemon
