// The daemon's end of the ranks' command queues (protocol/command_queue.h, docs/daemon.md): one
// thread reads every attachment's ring, starts each operation on its job (OpTarget::StartOp),
// and publishes the start and, through a waiter, the result into the rank's completion slot.
// It spins for `spin` after its last command and then sleeps in epoll on the queues' doorbells
// (pipes whose read ends only the daemon holds),
// waking at least every kQueueClockPeriod to advance each queue's clock (the ranks' sign that
// the daemon lives).
//
// Thread-safe: Add and Remove may be called from any thread. Waiter callbacks hold the queue's
// memory only (never the job), so a queue whose rank left frees its job.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "infra/fd.h"
#include "protocol/command_queue.h"
#include "server/daemon/op_target.h"

namespace ragshard::daemon {

class CommandPoller {
 public:
  struct Options {
    // How long the poller keeps reading after its last command before it sleeps.
    std::chrono::microseconds spin{0};
  };
  // Starts the thread. `on_error` hears of each command that breaks the queue's protocol
  // (counted in the daemon's metrics), on the poller's thread; it may be empty.
  static absl::StatusOr<std::unique_ptr<CommandPoller>> Create(
      Options options, std::function<void(const absl::Status&)> on_error);
  ~CommandPoller();  // stops the thread; the queues' memory lives on with pending callbacks

  // A queue for attachment `id`, local rank `local` of `target` (held weakly: a target that is
  // gone answers NOT_FOUND); ALREADY_EXISTS when `id` has one. Returns the descriptors to pass
  // to the rank, in order: the queue's memfd and the write end of the daemon's doorbell (both
  // the caller's to close once passed).
  absl::StatusOr<std::vector<ScopedFd>> Add(const std::string& id, std::weak_ptr<OpTarget> target,
                                            int local);
  // Stops serving attachment `id` (nothing when unknown).
  void Remove(const std::string& id);

  // Commands read, for tests and the daemon's figures.
  int64_t commands() const { return commands_.load(std::memory_order_relaxed); }

 private:
  struct Memory {  // what a completion holds on to
    QueueMapping mapping;
  };
  struct Queue {
    std::string id;
    std::shared_ptr<Memory> memory;
    ScopedFd doorbell;
    std::weak_ptr<OpTarget> target;
    int local = 0;
    bool broken = false;  // the rank broke the protocol (logged the first time)
  };
  CommandPoller(Options options, std::function<void(const absl::Status&)> on_error, ScopedFd epoll,
                ScopedFd wake);
  void Run();
  // Reads and handles `q`'s new commands; true when there were any.
  bool Drain(Queue& q);
  void Handle(Queue& q, const QueueCommand& c);
  void Broken(Queue& q, const absl::Status& why);

  const Options options_;
  const std::function<void(const absl::Status&)> on_error_;
  ScopedFd epoll_;
  ScopedFd wake_;  // eventfd: Add, Remove and the destructor wake the thread
  absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Queue>> queues_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> generation_{0};  // advanced by Add and Remove
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> commands_{0};
  std::thread thread_;
};

}  // namespace ragshard::daemon
