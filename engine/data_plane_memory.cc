#include "engine/data_plane_memory.h"

#include <algorithm>

#include "engine/layout.h"

namespace ragshard {

DataPlaneMemory DataPlanePeak(const std::vector<DataPlaneUnit>& units, int64_t ranks, bool shared,
                              int64_t prefetch, int64_t p_slots, int64_t g_slots,
                              int64_t g_ring_nodes, int64_t g_ring_slots) {
  DataPlaneMemory m;
  double largest_params = 0, largest_grads = 0;
  const int64_t ranks1 = std::max<int64_t>(ranks, 1);
  const double k = static_cast<double>(ranks1);
  const int64_t ps = p_slots > 0 ? p_slots : ranks1;
  const double pk = static_cast<double>(ps);
  const double gk = static_cast<double>(g_slots > 0 ? g_slots : ranks1);
  for (const DataPlaneUnit& u : units) {
    const double s = static_cast<double>(u.shard_elems);
    const double sg =
        static_cast<double>(u.grad_shard_elems >= 0 ? u.grad_shard_elems : u.shard_elems);
    m.shards += pk * s * u.param_bytes;
    m.grad_shards += gk * sg * 4;
    const double ring = g_ring_slots > 0 ? static_cast<double>(g_ring_slots) : gk;
    if (g_ring_nodes > 1) m.scratch = std::max(m.scratch, 2 * ring * sg * 4);
    const double unsharded = static_cast<double>(u.group) * s * u.param_bytes;
    // Shared by the node's ranks, the buffer maps their shards where they are whole pages
    // (protocol/unsharded_view.h): only the other nodes' shards are allocated.
    const bool view =
        shared && AliasesShards(ps, u.shard_elems, static_cast<int64_t>(u.param_bytes));
    largest_params =
        std::max(largest_params, view ? unsharded - pk * s * u.param_bytes : unsharded);
    largest_grads = std::max(largest_grads, unsharded);  // gradients in the parameter dtype
  }
  const double in_flight = static_cast<double>(std::max<int64_t>(prefetch, 0) + 1);
  m.unsharded = in_flight * largest_params * (shared ? 1 : k);
  m.grads = largest_grads * k;
  return m;
}

}  // namespace ragshard
