// A point-to-point communicator among the `size()` members of a process group, the one thing
// the collectives need from a transport. The UCX implementation is ucx_comm.h; tests also use an
// in-memory one.
//
// Every message is checked. Its 48-bit tag is a MessageStamp: the operation's sequence number,
// unit and kind, its lane, and the message's index within the operation. A receive matches the
// next message from its peer with the same index and lane, whatever the rest of its stamp (so
// that operations the nodes run in different orders fail at once, named, instead of waiting); the
// background lane holds the transfers that run across the foreground's operations, posted at
// moments of each node's own choosing (the redundancy's protect), which therefore must never
// match a foreground message (or the reverse); on completion the sender's
// stamp and size are compared with the receiver's, and a difference fails the operation with
// ABORTED naming both sides (through the describer the data plane installs). The job is implied
// by the connection: a job's daemons connect through a worker of their own and check the job in
// their hello (ucx_comm.h).
//
// Thread-compatible: one collective at a time per communicator.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace ragshard::daemon {

// What a message says about the operation it belongs to, packed into a 48-bit tag:
// bits 0-15 the index (a ring step, a piece), 16-18 the kind, 19-34 the unit (modulo 2^16),
// 35-46 the operation's sequence number (modulo 2^12), 47 the lane (1: background).
struct MessageStamp {
  enum Kind : uint32_t {
    kNone = 0,  // collectives called directly (tests, benchmarks)
    kAllGather = 1,
    kReduceScatter = 2,
    kAllReduce = 3,
    kGatherToOwner = 4,
    kScatterFromOwner = 5,
    kUpdateGather = 6,
    kControl = 7,  // the transport's own messages (hello, abort notices)
  };
  static constexpr int kIndexBits = 16, kKindBits = 3, kUnitBits = 16, kSeqBits = 12;
  static constexpr uint64_t kIndexMask = (uint64_t{1} << kIndexBits) - 1;
  static constexpr int kLaneShift = kIndexBits + kKindBits + kUnitBits + kSeqBits;
  static constexpr uint64_t kLaneBit = uint64_t{1} << kLaneShift;
  // The bits a receive matches on (besides its peer): the index and the lane.
  static constexpr uint64_t kMatchMask = kIndexMask | kLaneBit;
  // Indices the collectives may use; the rest are the transport's.
  static constexpr uint64_t kMaxDataIndex = kIndexMask - 16;

  uint64_t seq = 0;
  uint64_t unit = 0;
  uint32_t kind = kNone;
  uint64_t index = 0;
  bool background = false;  // the lane

  // The tag (bits beyond each field's width are dropped).
  uint64_t Tag() const {
    auto field = [](uint64_t v, int bits) { return v & ((uint64_t{1} << bits) - 1); };
    return field(index, kIndexBits) | field(kind, kKindBits) << kIndexBits |
           field(unit, kUnitBits) << (kIndexBits + kKindBits) |
           field(seq, kSeqBits) << (kIndexBits + kKindBits + kUnitBits) |
           (background ? kLaneBit : 0);
  }
  static MessageStamp FromTag(uint64_t tag) {
    auto field = [tag](int shift, int bits) {
      return (tag >> shift) & ((uint64_t{1} << bits) - 1);
    };
    MessageStamp s;
    s.index = field(0, kIndexBits);
    s.kind = static_cast<uint32_t>(field(kIndexBits, kKindBits));
    s.unit = field(kIndexBits + kKindBits, kUnitBits);
    s.seq = field(kIndexBits + kKindBits + kUnitBits, kSeqBits);
    s.background = (tag & kLaneBit) != 0;
    return s;
  }
};

// Names the operation a tag belongs to, for errors: "all-gather of unit 3 'layers.1'
// (operation 12)". The default names the fields.
using TagDescriber = std::function<std::string(uint64_t tag)>;
std::string DescribeTag(uint64_t tag);

// Work a collective's own thread does while it waits for its peers, such as placing its own
// block: each call runs one short step and returns whether any is left.
using IdleWork = std::function<bool()>;

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Posts a send or a receive of exactly `bytes` bytes. A receive matches the next message from
  // `peer` whose tag has the same index (MessageStamp); on completion its whole tag and size
  // must equal `tag` and `bytes`, or WaitAll fails with ABORTED naming both. Tags fit in 48 bits.
  // The buffer must stay valid until the request completes or WaitAll returns.
  virtual absl::StatusOr<uint64_t> PostSend(int peer, uint64_t tag, const void* data,
                                            size_t bytes) = 0;
  virtual absl::StatusOr<uint64_t> PostRecv(int peer, uint64_t tag, void* data, size_t bytes) = 0;
  // Waits for every request. On a lost peer or at the deadline it cancels the requests that are
  // still pending and returns UNAVAILABLE or DEADLINE_EXCEEDED naming the peer; on a message
  // that does not match, or an abort notice from a peer, ABORTED (after telling every peer).
  // While it has nothing else to do it may run steps of `idle` (until one returns false) in the
  // calling thread, instead of sleeping; it need not run them all.
  virtual absl::Status WaitAll(const std::vector<uint64_t>& requests, absl::Time deadline,
                               const IdleWork& idle) = 0;
  absl::Status WaitAll(const std::vector<uint64_t>& requests, absl::Time deadline) {
    return WaitAll(requests, deadline, IdleWork());
  }
  // Moves the transfers on without waiting for them: true once every request completed (as
  // WaitAll's OK, the requests then waited for), false while some are in flight and `deadline`
  // has not passed (poll again, or WaitAll), or WaitAll's errors. For transfers in the
  // background lane, polled from the thread's idle moments. The default waits (a transport
  // whose waits cannot be cut short).
  virtual absl::StatusOr<bool> Poll(const std::vector<uint64_t>& requests, absl::Time deadline) {
    absl::Status s = WaitAll(requests, deadline);
    if (!s.ok()) return s;
    return true;
  }
  // Tells every peer that this member stopped the job (`why` is the error); their pending and
  // later WaitAll fail with ABORTED quoting it. Best effort, bounded by a short wait.
  virtual void Abort(const std::string& why) = 0;
  // Thread-safe: the WaitAll running now (or the next) ends at once with ABORTED quoting `why`
  // (its pending requests cancelled), as does every later one of this connection. For a recovery
  // the planner started (a node lost without a reset): the job's thread may be waiting on a peer
  // that will never answer. The default does nothing (a connection whose waits end by
  // themselves).
  virtual void Interrupt(const std::string& why) { (void)why; }
  // How errors name a tag's operation (the data plane's unit names); nullptr restores the default.
  virtual void SetDescriber(TagDescriber describe) = 0;
  // Bytes of the messages posted to peers so far (the daemon's metrics); 0 where not counted.
  virtual int64_t sent_bytes() const { return 0; }
  // The peers a WaitAll that has lasted more than about 100 ms still waits for ("peer 1 (node
  // 'node-1')"), or "": thread-safe, for ragshardctl job why.
  virtual std::string waiting_for() const { return ""; }
};

// The error member `self` gives for a message from `peer` whose stamp or size differs from its
// own, naming both operations.
absl::Status MismatchError(int self, int peer, uint64_t sent_tag, size_t sent_bytes,
                           uint64_t want_tag, size_t want_bytes, const TagDescriber& describe);

// The members `members` (ranks of `base`, in group order) of a larger communicator, as a
// communicator of their own: a shard group or a replicate group of an HSDP mesh. `base` must
// outlive it and its rank must be one of the members.
class SubComm final : public Comm {
 public:
  SubComm(Comm* base, std::vector<int> members) : base_(base), members_(std::move(members)) {
    for (size_t i = 0; i < members_.size(); ++i) {
      if (members_[i] == base_->rank()) rank_ = static_cast<int>(i);
    }
  }
  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(members_.size()); }
  absl::StatusOr<uint64_t> PostSend(int peer, uint64_t tag, const void* data,
                                    size_t bytes) override {
    return base_->PostSend(members_[peer], tag, data, bytes);
  }
  absl::StatusOr<uint64_t> PostRecv(int peer, uint64_t tag, void* data, size_t bytes) override {
    return base_->PostRecv(members_[peer], tag, data, bytes);
  }
  using Comm::WaitAll;
  absl::Status WaitAll(const std::vector<uint64_t>& requests, absl::Time deadline,
                       const IdleWork& idle) override {
    return base_->WaitAll(requests, deadline, idle);
  }
  absl::StatusOr<bool> Poll(const std::vector<uint64_t>& requests, absl::Time deadline) override {
    return base_->Poll(requests, deadline);
  }
  void Abort(const std::string& why) override { base_->Abort(why); }
  void Interrupt(const std::string& why) override { base_->Interrupt(why); }
  void SetDescriber(TagDescriber describe) override { base_->SetDescriber(std::move(describe)); }
  int64_t sent_bytes() const override { return base_->sent_bytes(); }
  std::string waiting_for() const override { return base_->waiting_for(); }

 private:
  Comm* base_;
  std::vector<int> members_;
  int rank_ = -1;
};

}  // namespace ragshard::daemon
