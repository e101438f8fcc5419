// The rank's end of its command queue to the daemon (protocol/command_queue.h): starts an
// operation with one write into shared memory and sees its start and its result in a completion
// slot, without a round trip of its own. A dead daemon is seen when its side channel closes, a
// hung or stopped one when its clock in the queue stands still for the peer timeout.
//
// Thread-safe: starts are serialized; any number of threads may wait at once, each on its own
// operation.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "infra/fd.h"
#include "protocol/command_queue.h"

namespace ragshard {

struct RankQueueOptions {
  // "the daemon of node 'n0' (unix:/run/ragshard.sock)": errors name it.
  std::string daemon;
  std::chrono::milliseconds peer_timeout{30'000};
  // How long a waiter checks its slot before it sleeps on the futex.
  std::chrono::microseconds spin{50};
};

// An operation started through the queue.
struct QueueTicket {
  uint64_t seq = 0;  // the daemon's sequence number (0 for a no-op)
  int slot = -1;
  uint64_t tag = 0;  // this queue's own number of the start; tells reuses of a slot apart
};

// An operation's result: its status and the serialized v1::UnitBuffers of the placement it
// reported (empty for none).
struct QueueResult {
  absl::Status status;
  std::string placement;
  uint64_t seq = 0;
  bool failed_at_start = false;  // the start itself failed: no operation exists
  // When the daemon ran it (CLOCK_MONOTONIC ns; 0: it did not run).
  int64_t started_ns = 0;
  int64_t finished_ns = 0;
};

class RankQueue {
 public:
  // Takes the queue's memfd and the daemon's doorbell (both from the side channel). The side
  // channel stays the caller's; it must outlive the queue.
  static absl::StatusOr<std::unique_ptr<RankQueue>> Open(ScopedFd memory, ScopedFd doorbell,
                                                         int side_channel,
                                                         RankQueueOptions options);

  // Submits `command` and waits for the daemon to start it: the ticket, or the start's own
  // error (the daemon's text), or UNAVAILABLE when the daemon is gone or hung. Blocks while
  // every completion slot holds an operation in flight (each completes without this rank).
  absl::StatusOr<QueueTicket> Start(QueueCommand command);

  // Waits up to `timeout` (0: a poll) for the operation's result. True with *result set once it
  // is done; false when `timeout` passed first. FAILED_PRECONDITION when an earlier wait took the
  // result already; UNAVAILABLE when the daemon is gone or hung.
  absl::StatusOr<bool> Wait(const QueueTicket& ticket, std::chrono::microseconds timeout,
                            QueueResult* result);

 private:
  RankQueue(QueueMapping mapping, ScopedFd doorbell, int side_channel, RankQueueOptions options);
  // Until slot `slot` reaches `state`, or no longer holds start `tag` (another thread moved its
  // result into harvested_): true; false at `deadline`; UNAVAILABLE for a daemon that exited or
  // stopped answering (`call` names what waited).
  absl::StatusOr<bool> AwaitSlot(int slot, uint64_t tag, uint32_t state,
                                 std::chrono::steady_clock::time_point deadline, const char* call);
  // The slot's result, and the slot freed (under mu_; the slot is done).
  QueueResult Take(int slot);
  // A free slot, harvesting finished ones into harvested_ when none is free; -1 when every slot
  // holds an operation in flight (under mu_).
  int FreeSlot();
  bool DaemonExited() const;

  QueueMapping q_;
  ScopedFd doorbell_;
  const int side_channel_;
  const RankQueueOptions options_;
  std::mutex mu_;
  // The tag of the start that holds each slot; 0: free. Written under mu_, read by waiters
  // without it.
  std::vector<std::atomic<uint64_t>> slot_tag_;
  std::vector<int> free_;
  std::map<uint64_t, QueueResult> harvested_;  // by tag: results taken out of reused slots
  uint64_t next_tag_ = 1;
};

}  // namespace ragshard
