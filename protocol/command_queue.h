// The shared-memory command queue between a rank and its daemon (docs/daemon.md, "The command
// queue"): one per attachment, in a memfd the daemon creates and passes over the side channel
// with two event descriptors. The rank writes commands into a single-producer ring and reads
// their results from completion slots; neither side makes a system call while the other is
// awake, and a sleeping side is woken through its doorbell:
//   * the daemon's: a pipe the rank writes (the daemon's poller waits on many with epoll);
//   * the rank's: a futex on `rank_bell` in the shared memory (many threads of a rank may wait).
// gRPC stays for attach, detach, registration and stats.
//
// The memory is shared with a process the daemon does not trust: the daemon copies each command
// out before it checks it, and a rank that scribbles over the queue only hurts itself.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "infra/fd.h"

namespace ragshard {

inline constexpr uint32_t kQueueMagic = 0x52534351;  // "RSCQ"
inline constexpr uint32_t kQueueVersion = 2;
inline constexpr uint32_t kQueueCommands = 256;  // ring entries (a power of two)
inline constexpr uint32_t kQueueSlots = 128;     // completion slots
inline constexpr size_t kQueueSlotPayload = 2048;

// One command: start an operation (v1::OpKind; OP_NOOP answers at once) whose result goes to
// completion slot `slot`.
struct QueueCommand {
  uint32_t slot = 0;
  int32_t kind = 0;
  int32_t unit = 0;
  int32_t reduce = 0;
  int32_t keep_ranks = 0;
  int32_t accumulate = 0;  // OP_REDUCE_SCATTER: StartRequest.accumulate
  int64_t timeout_ms = 0;
};

// A completion slot's states. The rank moves a slot from kFree to kSubmitted (and back to
// kFree once it has read the result); the daemon moves it to kStarted (`seq` is set) and then
// kDone, or straight to kDone when the start failed (`failed_at_start`).
enum QueueSlotState : uint32_t {
  kSlotFree = 0,
  kSlotSubmitted = 1,
  kSlotStarted = 2,
  kSlotDone = 3
};

struct alignas(64) QueueSlot {
  std::atomic<uint32_t> state{kSlotFree};
  int32_t code = 0;              // absl::StatusCode of the result (kDone)
  uint32_t failed_at_start = 0;  // kDone: the start itself failed (no operation exists)
  uint32_t placement_bytes = 0;  // a serialized v1::UnitBuffers at payload[0], or none
  uint32_t message_bytes = 0;    // the error's text, after the placement
  uint32_t reserved = 0;
  uint64_t seq = 0;  // the daemon's sequence number of the operation (kStarted on)
  // When the daemon's job thread ran the operation (CLOCK_MONOTONIC ns; 0: it did not run).
  int64_t started_ns = 0;
  int64_t finished_ns = 0;
  char payload[kQueueSlotPayload] = {};
};

// Each side's words sit on cache lines of their own (the padding is the point).
struct QueueLayout {  // NOLINT(clang-analyzer-optin.performance.Padding)
  uint32_t magic = kQueueMagic;
  uint32_t version = kQueueVersion;
  uint32_t commands = kQueueCommands;
  uint32_t slots = kQueueSlots;
  // The ring: the rank writes ring[head % commands] and then advances head; the daemon reads up
  // to head and advances tail. Free running counters.
  alignas(64) std::atomic<uint32_t> head{0};
  alignas(64) std::atomic<uint32_t> tail{0};
  // 1 while the daemon's poller may sleep: the rank then rings the daemon's eventfd.
  std::atomic<uint32_t> daemon_sleeping{0};
  // Advanced by the daemon every kQueueClockPeriod while it lives: a rank that sees it stand
  // still for its peer timeout knows the daemon is hung or stopped.
  std::atomic<uint64_t> daemon_clock{0};
  // The rank's doorbell: the daemon advances it after each completion and wakes the futex when
  // `rank_sleepers` is not zero.
  alignas(64) std::atomic<uint32_t> rank_bell{0};
  std::atomic<uint32_t> rank_sleepers{0};
  alignas(64) QueueCommand ring[kQueueCommands];
  QueueSlot slot[kQueueSlots];
};

inline constexpr std::chrono::milliseconds kQueueClockPeriod{50};

// What a rank sends on the side channel before its attachment id to ask for a queue with the
// arena (a rank that sends the id alone gets the arena alone, and stays on gRPC).
inline constexpr char kQueueRequest[] = "queue ";

// One mapping of a queue's memory (either end); unmaps on destruction (logging a failure).
// Move-only.
class QueueMapping {
 public:
  QueueMapping() = default;

  QueueLayout* get() const { return layout_.get(); }
  QueueLayout* operator->() const { return layout_.get(); }

  // Maps the queue in memfd `fd`, checking its size and header (INVALID_ARGUMENT names what is
  // wrong: a daemon of another version, or not a queue).
  static absl::StatusOr<QueueMapping> Map(int fd);

 private:
  struct Unmap {
    void operator()(QueueLayout* layout) const;
  };
  explicit QueueMapping(QueueLayout* layout) : layout_(layout) {}
  std::unique_ptr<QueueLayout, Unmap> layout_;
};

// A memfd of `bytes` whose size is sealed (F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_SEAL): a process
// it is passed to cannot truncate it under the daemon's mappings (which would raise SIGBUS in
// the daemon). `what` names it in errors.
absl::StatusOr<ScopedFd> SealedMemfd(const char* what, size_t bytes);

// A new queue (the daemon's end): its memory, initialized, and its doorbell, a pipe: the daemon
// keeps the read end (non-blocking, its own) and passes the write end, so that nothing the rank
// does to its descriptor can block the daemon's reads.
struct NewQueue {
  ScopedFd memory;          // sealed memfd of sizeof(QueueLayout), to pass
  ScopedFd doorbell;        // the read end, the daemon's
  ScopedFd doorbell_write;  // the write end, to pass
  QueueMapping mapping;
};
absl::StatusOr<NewQueue> CreateQueue();

// Empties a doorbell's read end (non-blocking).
void DrainDoorbell(int fd);

// The daemon's side of the rank's doorbell: after publishing a completion, wakes the rank's
// sleeping threads (no system call when none sleeps).
void RingRank(QueueLayout* q);
// The rank's side of the daemon's doorbell, the pipe's write end (no system call while the
// daemon's poller is awake; a full pipe has rung already).
void RingDaemon(QueueLayout* q, int doorbell);
// Sleeps on the rank's doorbell until it moves from `seen` or `timeout` passes.
void WaitRankBell(QueueLayout* q, uint32_t seen, std::chrono::microseconds timeout);

// Writes a result into `slot` and publishes it (kDone); the message is cut to what fits and says
// so. Serialized placement bytes that do not fit make the result an INTERNAL error.
void PublishResult(QueueSlot* slot, bool failed_at_start, const absl::Status& status,
                   const std::string& placement);

// Reads a result the daemon published: its status (the daemon's code and text) and placement
// bytes. Bounds come from the shared memory, so they are checked.
absl::Status ReadResult(const QueueSlot& slot, std::string* placement);

}  // namespace ragshard
