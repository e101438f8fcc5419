// A job's state buffers on this node (the StateBuffer RPC; docs/recovery.md): each local rank's
// buffers, kept by name in the node's pool for the job's life, and what the pool contract
// (protocol/pool_contract.h) says some of them hold: the step journal's marks, and which
// buffers a rank's protected state counts.
//
// Thread-safe: the attaches' gRPC handlers make buffers while the job's thread reads them.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/daemon/data_backend.h"
#include "server/daemon/pool.h"
#include "server/daemon/state_blob.h"

namespace ragshard::daemon {

class RankStates {
 public:
  explicit RankStates(std::string job_id) : job_id_(std::move(job_id)) {}

  // Rank `rank`'s buffer `name` of `bytes` bytes, made (zeroed) at the first ask: in the rank's
  // own memory where pool::InRankMemory names it and `dp` has such memory (local rank `local`'s,
  // its GPU's on the CUDA backend), else from `pool`. FAILED_PRECONDITION where it exists with
  // another size.
  struct Buffer {
    const Lease* lease = nullptr;
    bool existed = false;
    bool rank_memory = false;  // the lease is of the data plane's memory of the rank
  };
  absl::StatusOr<Buffer> Get(int64_t rank, const std::string& name, int64_t bytes, Pool* pool,
                             const DataBackend* dp, int local);
  bool Has(int64_t rank, const std::string& name);
  // Makes rank `rank`'s buffer `name` a copy of `bytes` bytes at `data` (one byte at least),
  // unless it exists; the pool's error where it has no room.
  absl::Status PutCopy(int64_t rank, const std::string& name, const char* data, int64_t bytes,
                       Pool* pool);

  // The rank's step journal's marks (pool::kJournalMeta), or -1 and -1 where it has none.
  // The journal's transactions (committed, begun), and the base that makes them training
  // steps (a checkpoint load sets it: step = transaction + base).
  struct JournalMarks {
    int64_t committed = -1;
    int64_t begun = -1;
    int64_t base = 0;
  };
  JournalMarks Journal(int64_t rank);
  // The rank's buffers that its protected state counts (every one but the step journal's: its
  // marks, which a commit or a rollback changes outside the step's state, its manifest, and
  // the undo copies), by name.
  std::vector<StateSegment> Protected(int64_t rank);

 private:
  const std::string job_id_;
  absl::Mutex mu_;
  struct Held {
    Lease lease;
    int64_t bytes = 0;  // asked for (the lease may be larger: aligned)
    bool rank_memory = false;
    const SegmentMemory* memory = nullptr;  // how the daemon reaches it (nullptr: directly)
  };
  std::map<std::pair<int64_t, std::string>, Held> buffers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ragshard::daemon
