// Redundancy of every local rank's persistent state across the job's nodes (JobOptions.redundancy;
// docs/recovery.md, "A lost node"), so that a lost node (its daemon and its pool) is rebuilt on a
// replacement daemon instead of costing a restart.
//
// A rank's protected state is its parameter shards and its state buffers (the optimizers' state,
// step counts, the step journal's marks and manifest), but not the journal's undo copies. It is
// read as one blob: a directory naming each segment and its size, then the segments. With
// "parity:K", the job's nodes form groups of K + 1; each node's blob (per local rank) is cut into K
// chunks, and chunk c of the node at position p of its group is covered by the XOR parity that the
// node at position s = (c < p ? c : c + 1) holds for stripe s: each node holds one stripe's
// parity, 1/K of a blob. "replica" is K = 1 on a ring: node n's whole blob is copied on node n + 1.
//
// Protect runs inside every optimizer step's transaction: each node sends its chunks to their
// holders, which keep the XOR of what they receive with a CRC-32 of each chunk, tagged with the
// step. A holder keeps the parity of the last two steps it protected, since the ranks' committed
// steps may differ by one when a node is lost (docs/recovery.md, "One consistent step"): the
// rebuild uses the one of the step every rank agreed on.
//
// Thread-compatible: the job's thread calls Protect and Rebuild, one at a time.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "infra/redundancy.h"
#include "server/daemon/comm.h"
#include "server/daemon/pool.h"

namespace ragshard::daemon {

struct RedundancyScheme {
  int k = 0;             // chunks per blob; 0: no redundancy
  bool replica = false;  // k = 1 on a ring of all the job's nodes
  bool enabled() const { return k > 0; }
};

// The scheme of a job's JobOptions.redundancy (infra/redundancy.h parses and checks it).
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
// Bytes of each of the k chunks of a blob of `blob_bytes`: ceil(blob / k), rounded up to 64.
int64_t ChunkBytes(int64_t blob_bytes, int k);

// One segment of a rank's protected state: "shard/<unit>" (a parameter shard) or a state
// buffer's name.
struct StateSegment {
  std::string name;
  char* data = nullptr;
  int64_t bytes = 0;
};
// Where a rebuilt segment goes: `bytes` to write into (the parameter shard of that size, or the
// state buffer made with it), or an error naming what did not match.
using PlaceSegment =
    std::function<absl::StatusOr<char*>(int local, const std::string& name, int64_t bytes)>;

class NodeRedundancy {
 public:
  // This node is `node` of `node_names.size()`, with `locals` local ranks (the job's nodes hold
  // the same number of ranks). Parities are leased from `pool`.
  NodeRedundancy(RedundancyScheme scheme, int node, std::vector<std::string> node_names, int locals,
                 Pool* pool);

  // Every node, inside optimizer step `step`'s transaction: `state[l]` is local rank l's
  // protected segments. `seq`: the operation's sequence number (message stamps).
  absl::Status Protect(Comm& comm, const std::vector<std::vector<StateSegment>>& state,
                       int64_t step, absl::Time deadline, uint64_t seq);

  // Every node, once every rank is back at step `step` (the one all agreed on): where a node is a
  // replacement (`replacement`, its `state` ignored), the others send it what it needs, and it
  // rebuilds each local rank's blob, checks each chunk's CRC and writes the segments through
  // `place`. Returns the bytes this node rebuilt (0 on the others, and where no node is a
  // replacement). A lost chunk that cannot be rebuilt (two nodes of one group replaced, a holder
  // without the step's parity) is FAILED_PRECONDITION, and a rebuilt chunk whose CRC differs is
  // DATA_LOSS, naming the chunk.
  absl::StatusOr<int64_t> Rebuild(Comm& comm, bool replacement,
                                  const std::vector<std::vector<StateSegment>>& state, int64_t step,
                                  const PlaceSegment& place, absl::Time deadline, uint64_t seq);

  // Bytes of the pool this node's parities hold, and of the local ranks' blobs the last Protect
  // covered. Thread-safe (the stats read them while the job's thread protects).
  int64_t parity_bytes() const;
  int64_t protected_bytes() const { return protected_bytes_.load(); }
  // Tests: flips byte `at` of local rank `local`'s parity of `step` (where it has one).
  void FlipParityByteForTest(int local, int64_t step, int64_t at);

 private:
  struct Slot {
    Lease lease;
    int64_t bytes = 0;                 // the parity's length: the largest source chunk
    int64_t step = -1;                 // the step it protects; -1 while unused
    std::vector<int64_t> source_blob;  // by ParitySources order: the source's blob bytes
    std::vector<uint32_t> source_crc;  // and the CRC-32 of its chunk
  };
  // This node's own blob at a step it protected: its segments' names and sizes. A rebuild at
  // that step sends the chunks of the same blob (segments made since are left out).
  struct Own {
    int64_t step = -1;
    std::vector<std::pair<std::string, int64_t>> segments;
  };
  // `state`'s segments as they were at `step`: FAILED_PRECONDITION where one is gone or resized.
  absl::StatusOr<std::vector<StateSegment>> AsProtected(int local,
                                                        const std::vector<StateSegment>& state,
                                                        int64_t step) const;
  void Record(int local, const std::vector<StateSegment>& state, int64_t step);
  Slot& SlotFor(int local, int64_t step);
  void CountParities();
  const Slot* FindSlot(int local, int64_t step) const;
  absl::Status Fill(Slot* slot, int64_t bytes);

  const RedundancyScheme scheme_;
  const int node_;
  const std::vector<std::string> node_names_;
  const int nodes_, locals_;
  Pool* const pool_;
  std::vector<std::array<Slot, 2>> slots_;  // by local rank
  std::vector<std::array<Own, 2>> own_;     // by local rank
  std::atomic<int64_t> protected_bytes_{0};
  std::atomic<int64_t> parity_bytes_{0};
};

}  // namespace ragshard::daemon
