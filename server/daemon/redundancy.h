// Redundancy of every local rank's persistent state across the job's nodes (JobOptions.redundancy;
// docs/recovery.md, "A lost node"), so that a lost node (its daemon and its pool) is rebuilt on a
// replacement daemon instead of costing a restart.
//
// A rank's protected state is its parameter shards and its state buffers (the optimizers' state,
// step counts, the step journal's marks and manifest), but not the journal's undo copies. It is
// read as one blob: a directory naming each segment and its size, then the segments. Where each
// chunk and parity lies is parity_layout.h's; the blob is state_blob.h's.
//
// A protect of a step's state: each node sends its chunks to their holders, window by window
// (kProtectWindowBytes, staged in the pool), which XOR what they receive into a new parity with a
// CRC-32 of each chunk, tagged with the step; once every node has its new parity (a barrier), each
// drops its parity of the step before. A node so holds the parity of the step before until the
// new one is whole everywhere.
//
// It runs in the background of the next step (docs/recovery.md, "One consistent step"): the ranks
// start it once a step commits (StartProtect), the job's thread moves it on without waiting for
// it, after each operation and in its idle moments (AdvanceProtect: while the ranks compute the
// forward and the backward, the windows land as their messages arrive and the next are posted),
// and the ranks finish it before the next step changes the state (FinishProtect: the windows
// left, waited for, then the barrier). The windows' messages travel in the background lane
// (comm.h), so each node posts them at moments of its own, in the same order on every node,
// without ever matching a collective's. Where a node is lost, every node holds
// the parity of the last step every rank committed, or of the one before, whose state every rank's
// undo copy still holds (no rank began the next step: the ranks roll back one step more).
//
// "hsdp" keeps nothing: each rank's state is the same as its HSDP replicas' (every replica
// group steps the same shards with the same gradients), so a lost node's ranks are rebuilt by
// copying the state of a replica on another node, as it is at the step every rank agreed on.
//
// Thread-compatible: the job's thread calls Protect and Rebuild, one at a time.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/daemon/comm.h"
#include "server/daemon/parity_layout.h"
#include "server/daemon/pool.h"
#include "server/daemon/state_blob.h"

namespace ragshard::daemon {

// Where a rebuilt segment goes: `bytes` to write into (the parameter shard of that size, or the
// state buffer made with it, in the memory it lives in), or an error naming what did not match.
using PlaceSegment =
    std::function<absl::StatusOr<StateSegment>(int local, const std::string& name, int64_t bytes)>;

class NodeRedundancy {
 public:
  // Protect moves each chunk in windows of at most this many bytes, through staging leased from
  // the pool for the protect's length (a window per chunk sent or received for each window in
  // flight, kWindowsPerOperation): its
  // memory beyond the parities is bounded, whatever the state's size, and in the pool's
  // figures. A window inside one segment is sent from where it lies, and where a parity has one
  // source (replica, parity:1) its chunk is received straight into the parity.
  static constexpr int64_t kProtectWindowBytes = int64_t{2} << 20;
  // Windows a background protect keeps in flight at most (posted together, landed together);
  // its staging is that many windows per flow.
  static constexpr int kWindowsPerOperation = 4;

  // This node is `node` of `node_names.size()`, with `locals` local ranks (the job's nodes hold
  // the same number of ranks). Parities are leased from `pool`.
  NodeRedundancy(RedundancyScheme scheme, int node, std::vector<std::string> node_names, int locals,
                 Pool* pool);
  ~NodeRedundancy();  // (a protect under way: Pending is redundancy.cc's)

  // Every node, once its ranks are at step `step`: `state[l]` is local rank l's protected
  // segments, which must not change until the protect finishes. `seq`: the operation's sequence
  // number (message stamps). Protect runs it whole; StartProtect plans it (the nodes exchange
  // their blobs' sizes, the new parities and the staging are leased) and leaves the windows to
  // AdvanceProtect and FinishProtect. A protect still under way is finished first.
  absl::Status Protect(Comm& comm, std::vector<std::vector<StateSegment>> state, int64_t step,
                       absl::Time deadline, uint64_t seq);
  absl::Status StartProtect(Comm& comm, std::vector<std::vector<StateSegment>> state, int64_t step,
                            absl::Time deadline, uint64_t seq);
  // The protect under way (none: nothing to do) moves on without waiting: where the windows in
  // flight have all arrived (Comm::Poll), the parities take what they brought and up to `windows`
  // more (at most kWindowsPerOperation) are posted and left in flight, their messages moving
  // while the job's thread waits for its operations' or for the next operation. Windows in
  // flight for longer than `patience` fail it (DEADLINE_EXCEEDED naming the peer).
  absl::Status AdvanceProtect(Comm& comm, int windows, absl::Duration patience);
  // Whether the protect under way has windows in flight or still to post (AdvanceProtect has
  // something to do).
  bool protect_in_flight() const;
  // The protect under way, whole: its windows left, the barrier, the parity of the step before
  // dropped. OK where none is under way. A failure leaves the parities from before it.
  absl::Status FinishProtect(Comm& comm, absl::Time deadline);
  // Gives up the protect under way (a recovery in place), once the connection its windows in
  // flight used is closed or they landed: their messages
  // write into its parities and staging until then.
  void AbandonProtect();
  bool protecting() const { return pending_ != nullptr; }

  // Every node, once every rank is back at step `step` (the one all agreed on): where a node is a
  // replacement (`replacement`, its `state` ignored), the others send it what it needs, and it
  // rebuilds each local rank's blob, checks each chunk's CRC and writes the segments through
  // `place`. Every node then keeps only its parity of `step` (another step's would cover state
  // the ranks no longer hold). Returns the bytes this node rebuilt (0 on the others, and where
  // no node is a replacement). A lost chunk that cannot be rebuilt (two nodes of one group
  // replaced, a holder without the step's parity) is FAILED_PRECONDITION, and a rebuilt chunk whose
  // CRC differs is DATA_LOSS, naming the chunk.
  absl::StatusOr<int64_t> Rebuild(Comm& comm, bool replacement,
                                  const std::vector<std::vector<StateSegment>>& state, int64_t step,
                                  const PlaceSegment& place, absl::Time deadline, uint64_t seq);

  // Where this node's parity of `step` for local rank `local` is another node's whole state
  // (replica, or parity:1's pair: one source): that node and its segments, pointing into the
  // parity, once its CRC is checked. A shrink that re-cuts the shards reads the lost node's state
  // here (docs/recovery.md, "Shrinking in place"). FAILED_PRECONDITION where parities are XORs
  // of several nodes, NOT_FOUND where this node holds no parity of `step`, DATA_LOSS naming the
  // chunk where its CRC differs. Only while nothing protects (a stopped job).
  struct Copy {
    int node = 0;
    std::string node_name;
    std::vector<StateSegment> segments;
  };
  // `check` false: the CRC was checked before (the parity has not changed since).
  absl::StatusOr<Copy> CopyHeld(int local, int64_t step, bool check = true) const;

  // Bytes of the pool this node's parities hold, and of the local ranks' blobs the last Protect
  // covered, and the steps this node holds every local rank's parity of (one, or two between a
  // protect and its barrier or after a failed one). Thread-safe (the stats read them while the
  // job's thread protects).
  int64_t parity_bytes() const;
  int64_t protected_bytes() const { return protected_bytes_.load(); }
  std::vector<int64_t> parity_steps() const;
  // Tests: flips byte `at` of local rank `local`'s parity of `step` (where it has one).
  void FlipParityByteForTest(int local, int64_t step, int64_t at);
  // Tests: runs inside Protect once this node's new parity is whole, before the barrier; an error
  // ends the Protect there (a node lost at that point).
  void SetBeforeBarrierForTest(std::function<absl::Status()> hook) {
    before_barrier_ = std::move(hook);
  }

 private:
  struct Slot {
    Lease lease;
    int64_t bytes = 0;                 // the parity's length: its stripe's
    int64_t step = -1;                 // the step it protects; -1 while unused
    uint64_t made = 0;                 // when it was made whole (Protect's count): newest wins
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
  // Where a new parity of `step` goes: not the slot of the step before (the fallback until the
  // barrier), nor that of `step` itself where there is another.
  Slot& SlotFor(int local, int64_t step);
  // After a protect's barrier, or a rebuild: every parity but the newest of `step` goes back to
  // the pool.
  void DropAllBut(int64_t step);
  // Rebuild's steps (redundancy_rebuild.cc), each on every node alike. What the nodes told each
  // other at its start, and what follows from it:
  struct Census;
  // A chunk (or a source of a replacement's own parity) a replacement receives.
  struct Incoming;
  // 1. Every node tells the others whether it is a replacement, its pool's free bytes, and per
  // local rank its blob at `step` and the parity it holds of it.
  absl::Status TakeCensus(Comm& comm, bool replacement,
                          const std::vector<std::vector<StateSegment>>& state, int64_t step,
                          absl::Time deadline, uint64_t seq, Census* census) const;
  // 2. Every lost chunk has a parity and every other source of it survived.
  absl::Status CheckRebuildable(const Census& census, int64_t step) const;
  // 3. Every node's blob bytes and the stripes they make; each holder's parity has its stripe's
  // length, and each replacement's pool has room for its ranks' state and parity.
  absl::Status SizeStripes(Census* census, int64_t step) const;
  // 4. The holders and sources send each replacement what rebuilds its chunks and its parity.
  absl::StatusOr<std::vector<Incoming>> ExchangeChunks(Comm& comm, const Census& census,
                                                       int64_t step, absl::Time deadline,
                                                       uint64_t seq) const;
  // 5. A replacement: each local rank's blob from what arrived, its chunks' CRCs checked, its
  // segments placed; then its own parity. Returns the bytes rebuilt.
  absl::StatusOr<int64_t> Reassemble(const Census& census, const std::vector<Incoming>& incoming,
                                     int64_t step, const PlaceSegment& place);
  // Rebuild's "hsdp" way: from the replicas' live state.
  absl::StatusOr<int64_t> RebuildFromReplicas(Comm& comm, bool replacement,
                                              const std::vector<std::vector<StateSegment>>& state,
                                              int64_t step, const PlaceSegment& place,
                                              absl::Time deadline, uint64_t seq);
  // A protect under way (redundancy.cc).
  struct Pending;
  // StartProtect's and FinishProtect's bodies (they count the parities after, however it ends).
  absl::Status PlanProtect(Comm& comm, std::vector<std::vector<StateSegment>> state, int64_t step,
                           absl::Time deadline, uint64_t seq);
  absl::Status EndProtect(Comm& comm, absl::Time deadline);
  // AdvanceProtect's parts: posts up to `windows` windows; folds what the windows in flight
  // brought (all arrived) into the parities.
  absl::Status PostWindows(Comm& comm, int windows);
  void Land();
  void CountParities();
  const Slot* FindSlot(int local, int64_t step) const;
  // `slot` leased for a parity of `bytes`, zeros from byte `zero_from` on (what comes before
  // is written whole by the caller).
  absl::Status Fill(Slot* slot, int64_t bytes, int64_t zero_from = 0);

  const RedundancyScheme scheme_;
  const int node_;
  const std::vector<std::string> node_names_;
  const int nodes_, locals_;
  Pool* const pool_;
  std::vector<std::array<Slot, 2>> slots_;  // by local rank
  std::vector<std::array<Own, 2>> own_;     // by local rank
  std::atomic<int64_t> protected_bytes_{0};
  std::atomic<int64_t> parity_bytes_{0};
  std::array<std::atomic<int64_t>, 2> parity_steps_{-1, -1};
  uint64_t made_ = 0;  // parities made whole so far
  std::function<absl::Status()> before_barrier_;
  std::unique_ptr<Pending> pending_;
};

}  // namespace ragshard::daemon
