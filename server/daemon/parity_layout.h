// Where a job's redundancy puts each node's protected state (JobOptions.redundancy;
// docs/recovery.md, "A lost node"): the parity groups, which node holds the parity covering which
// chunk of which node's blob, and how long each stripe is. Pure arithmetic, the same on every
// node; NodeRedundancy (redundancy.h) moves the bytes.
//
// With "parity:K", the job's nodes form groups of K + 1; each node's blob (per local rank) is cut
// into K chunks, and chunk c of the node at position p of its group is covered by the XOR parity
// that the node at position s = (c < p ? c : c + 1) holds for stripe s. The chunks of one stripe
// have one length (StripeBytes), so that the group's parities add up to 1/K of its blobs even
// where the blobs differ in size. "replica" is K = 1 on a ring: node n's whole blob is copied on
// node n + 1.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/redundancy.h"

namespace ragshard::daemon {

struct RedundancyScheme {
  int k = 0;             // chunks per blob; 0: no redundancy
  bool replica = false;  // k = 1 on a ring of all the job's nodes
  // "hsdp": no parity; a lost rank's state is copied from an HSDP replica of it (rank q and
  // q + shard_ranks hold the same shards) on another node, as it is at the rebuild's step.
  bool hsdp = false;
  int64_t shard_ranks = 0;  // hsdp: the shard group's size
  bool enabled() const { return k > 0; }
};

// The scheme of a job's JobOptions.redundancy (engine/redundancy.h parses and checks it).
RedundancyScheme SchemeOf(const Redundancy& redundancy);

// A chunk of a node's blob: which node, which of its chunks.
struct ChunkRef {
  int node = 0;
  int chunk = 0;
};
// The chunks whose XOR node `holder` keeps, in a fixed order (scheme.k of them).
std::vector<ChunkRef> ParitySources(const RedundancyScheme& scheme, int nodes, int holder);
// The node that keeps the parity covering chunk `chunk` of node `node`.
int ParityHolder(const RedundancyScheme& scheme, int nodes, int node, int chunk);
// The parity bytes each node holds (by node) for one local rank, from every node's blob bytes at
// the step (`blob`, by node). With parity:K, per group: the least P such that every node's K
// chunks, of lengths max(0, P - blob[h]) over its chunks' holders h, cover its blob; the stripe of
// holder h is that length. P = ceil(sum / K) where no blob exceeds sum / K, and then the
// parities add up to 1/K of the group's blobs. With replica: the blob of the node before.
std::vector<int64_t> StripeBytes(const RedundancyScheme& scheme, const std::vector<int64_t>& blob);
// Where chunk `chunk` of node `node`'s blob lies in it: [offset, offset + bytes), clipped to the
// blob (its stripe's parity is longer where the chunk ends early: zeros beyond).
struct ChunkSpan {
  int64_t offset = 0;
  int64_t bytes = 0;
};
ChunkSpan ChunkOf(const RedundancyScheme& scheme, const std::vector<int64_t>& stripes,
                  const std::vector<int64_t>& blob, int node, int chunk);

}  // namespace ragshard::daemon
