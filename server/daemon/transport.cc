#include "server/daemon/transport.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace ragshard::daemon {

absl::StatusOr<NodeMesh> NodeMesh::Of(const v1::Plan& plan, const std::vector<int64_t>& local_ranks,
                                      int node, int nodes, int64_t replicas) {
  const int64_t f = plan.world_size();
  const int64_t k = static_cast<int64_t>(local_ranks.size());
  if (k == 0) return absl::InvalidArgumentError("no local ranks");
  if (replicas < 1) return absl::InvalidArgumentError("replicas must be at least 1");
  if (k * nodes != f * replicas) {
    return absl::UnimplementedError(absl::StrCat("every node must hold the same number of ranks (",
                                                 k, " here, ", nodes, " nodes, world ",
                                                 f * replicas, ")"));
  }
  for (int64_t i = 0; i < k; ++i) {
    if (local_ranks[i] != node * k + i) {
      return absl::UnimplementedError(absl::StrCat("node ", node, " must hold ranks [", node * k,
                                                   ", ", (node + 1) * k, "); got rank ",
                                                   local_ranks[i]));
    }
  }
  auto sharding = ShardingOf(plan, f * replicas, k);
  if (!sharding.ok()) {
    if (sharding.status().code() == absl::StatusCode::kInvalidArgument) return sharding.status();
    return absl::UnimplementedError(sharding.status().message());
  }
  NodeMesh m;
  m.sharding = *sharding;
  m.node = node;
  m.nodes = nodes;
  m.local = k;
  m.shard = f;
  m.replicas = m.sharding.world() / m.sharding.g.size();
  return m;
}

int64_t GradShardBlockElems(const NodeMesh& mesh, int64_t slots, int64_t shard_elems) {
  const int64_t r = mesh.node_replicas();
  const int64_t n = std::max<int64_t>(slots * shard_elems, 1);
  return (n + r - 1) / r * r;
}

}  // namespace ragshard::daemon
