#include "client/rank_queue.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"

namespace ragshard {
namespace {

using Clock = std::chrono::steady_clock;

void Relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

}  // namespace

absl::StatusOr<std::unique_ptr<RankQueue>> RankQueue::Open(ScopedFd memory, ScopedFd doorbell,
                                                           int side_channel,
                                                           RankQueueOptions options) {
  auto mapping = QueueMapping::Map(memory.get());
  if (!mapping.ok()) return mapping.status();
  if (!doorbell.valid())
    return absl::InvalidArgumentError("the queue's doorbell: not a descriptor");
  return std::unique_ptr<RankQueue>(
      new RankQueue(std::move(*mapping), std::move(doorbell), side_channel, std::move(options)));
}

RankQueue::RankQueue(QueueMapping mapping, ScopedFd doorbell, int side_channel,
                     RankQueueOptions options)
    : q_(std::move(mapping)),
      doorbell_(std::move(doorbell)),
      side_channel_(side_channel),
      options_(std::move(options)),
      slot_tag_(kQueueSlots) {
  for (int s = kQueueSlots - 1; s >= 0; --s) free_.push_back(s);
}

bool RankQueue::DaemonExited() const {
  // The daemon never writes to the side channel after the attach: anything readable there is
  // its end closing.
  pollfd p{side_channel_, POLLIN, 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  char c = 0;
  return (p.revents & (POLLHUP | POLLERR)) != 0 ||
         ::recv(side_channel_, &c, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

absl::StatusOr<bool> RankQueue::AwaitSlot(int slot, uint64_t tag, uint32_t state,
                                          Clock::time_point deadline, const char* call) {
  const std::atomic<uint32_t>& s = q_->slot[slot].state;
  const auto reached = [&] {
    return s.load(std::memory_order_acquire) >= state ||
           slot_tag_[slot].load(std::memory_order_acquire) != tag;
  };
  if (reached()) return true;
  Clock::time_point now = Clock::now();
  if (now >= deadline) return false;
  // A short spin: the daemon's poller answers a start within microseconds while it is awake.
  // After the first microseconds the spin yields, so that it does not keep the daemon's threads
  // off a busy machine's cores.
  const auto until = std::min(deadline, now + options_.spin);
  for (int round = 0; Clock::now() < until; ++round) {
    for (int i = 0; i < 64; ++i) {
      if (reached()) return true;
      Relax();
    }
    if (round >= 16) std::this_thread::yield();
  }
  uint64_t clock = q_->daemon_clock.load(std::memory_order_relaxed);
  Clock::time_point clock_moved = Clock::now();
  while (true) {
    const uint32_t bell = q_->rank_bell.load(std::memory_order_seq_cst);
    if (reached()) return true;
    now = Clock::now();
    if (now >= deadline) return false;
    const uint64_t c = q_->daemon_clock.load(std::memory_order_relaxed);
    if (c != clock) {
      clock = c;
      clock_moved = now;
    } else if (now - clock_moved > 2 * kQueueClockPeriod) {
      if (DaemonExited()) {
        return absl::UnavailableError(
            absl::StrCat(options_.daemon,
                         " is unreachable: it closed its side channel (the "
                         "daemon exited) during ",
                         call));
      }
      if (now - clock_moved > options_.peer_timeout) {
        return absl::UnavailableError(absl::StrCat(options_.daemon, " did not answer ", call,
                                                   " within ", options_.peer_timeout.count(),
                                                   " ms: it is hung or stopped"));
      }
    }
    q_->rank_sleepers.fetch_add(1, std::memory_order_seq_cst);
    if (!reached()) {
      const auto left = std::chrono::duration_cast<std::chrono::microseconds>(deadline - now);
      WaitRankBell(
          q_.get(), bell,
          std::min<std::chrono::microseconds>(left, std::chrono::microseconds(kQueueClockPeriod)));
    }
    q_->rank_sleepers.fetch_sub(1, std::memory_order_seq_cst);
  }
}

int RankQueue::FreeSlot() {
  if (free_.empty()) {
    // Results nobody has waited for yet move out of their slots (Wait finds them by tag); a
    // thread waiting on one sees its slot's tag change, once woken.
    bool moved = false;
    for (int s = 0; s < static_cast<int>(kQueueSlots); ++s) {
      const uint64_t tag = slot_tag_[s].load(std::memory_order_relaxed);
      if (tag != 0 && q_->slot[s].state.load(std::memory_order_acquire) == kSlotDone) {
        harvested_[tag] = Take(s);
        moved = true;
      }
    }
    if (moved) RingRank(q_.get());
  }
  if (free_.empty()) return -1;
  const int s = free_.back();
  free_.pop_back();
  return s;
}

QueueResult RankQueue::Take(int slot) {
  QueueResult r;
  const QueueSlot& s = q_->slot[slot];
  r.status = ReadResult(s, &r.placement);
  r.seq = s.seq;
  r.failed_at_start = s.failed_at_start != 0;
  r.started_ns = s.started_ns;
  r.finished_ns = s.finished_ns;
  slot_tag_[slot].store(0, std::memory_order_release);
  q_->slot[slot].state.store(kSlotFree, std::memory_order_relaxed);
  free_.push_back(slot);
  return r;
}

absl::StatusOr<QueueTicket> RankQueue::Start(QueueCommand command) {
  QueueTicket t;
  {
    std::unique_lock<std::mutex> lock(mu_);
    uint64_t clock = q_->daemon_clock.load(std::memory_order_relaxed);
    Clock::time_point clock_moved = Clock::now();
    while (true) {
      // The bell before the look: a completion after the look moves it, and the sleep ends.
      const uint32_t bell = q_->rank_bell.load(std::memory_order_seq_cst);
      if ((t.slot = FreeSlot()) >= 0) break;
      // Every slot holds an operation in flight: the oldest completes without this rank (the
      // other ranks start it on their own), so waiting here cannot deadlock.
      lock.unlock();
      q_->rank_sleepers.fetch_add(1, std::memory_order_seq_cst);
      WaitRankBell(q_.get(), bell, std::chrono::microseconds(kQueueClockPeriod));
      q_->rank_sleepers.fetch_sub(1, std::memory_order_seq_cst);
      const Clock::time_point now = Clock::now();
      if (const uint64_t c = q_->daemon_clock.load(std::memory_order_relaxed); c != clock) {
        clock = c;
        clock_moved = now;
      } else if (now - clock_moved > 2 * kQueueClockPeriod && DaemonExited()) {
        return absl::UnavailableError(absl::StrCat(
            options_.daemon, " is unreachable: it closed its side channel (the daemon exited)"));
      } else if (now - clock_moved > options_.peer_timeout) {
        return absl::UnavailableError(
            absl::StrCat(options_.daemon, " did not answer the start of an operation within ",
                         options_.peer_timeout.count(), " ms: it is hung or stopped"));
      }
      lock.lock();
    }
    t.tag = next_tag_++;
    slot_tag_[t.slot].store(t.tag, std::memory_order_release);
    q_->slot[t.slot].state.store(kSlotSubmitted, std::memory_order_relaxed);
    command.slot = static_cast<uint32_t>(t.slot);
    const uint32_t head = q_->head.load(std::memory_order_relaxed);
    // The ring holds at most one start per thread that starts (each waits for its start), so it
    // is never full in practice; a full ring waits for the daemon to read.
    while (head - q_->tail.load(std::memory_order_acquire) >= kQueueCommands) {
      RingDaemon(q_.get(), doorbell_.get());
      std::this_thread::yield();
    }
    q_->ring[head % kQueueCommands] = command;
    q_->head.store(head + 1, std::memory_order_seq_cst);
    RingDaemon(q_.get(), doorbell_.get());
  }
  auto started =
      AwaitSlot(t.slot, t.tag, kSlotStarted, Clock::time_point::max(), "the start of an operation");
  if (!started.ok()) return started.status();
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = harvested_.find(t.tag); it != harvested_.end()) {  // another start's harvest
    if (it->second.failed_at_start) {
      const absl::Status error = it->second.status;
      harvested_.erase(it);
      return error;
    }
    t.seq = it->second.seq;
    return t;
  }
  const QueueSlot& s = q_->slot[t.slot];
  if (s.state.load(std::memory_order_acquire) == kSlotDone && s.failed_at_start != 0) {
    return Take(t.slot).status;
  }
  t.seq = s.seq;
  return t;
}

absl::StatusOr<bool> RankQueue::Wait(const QueueTicket& ticket, std::chrono::microseconds timeout,
                                     QueueResult* result) {
  const auto taken = [&]() -> absl::StatusOr<bool> {
    // Under mu_: the result moved out of its slot, or an earlier wait took it.
    if (auto it = harvested_.find(ticket.tag); it != harvested_.end()) {
      *result = std::move(it->second);
      harvested_.erase(it);
      return true;
    }
    if (ticket.slot < 0 || ticket.slot >= static_cast<int>(kQueueSlots) ||
        slot_tag_[ticket.slot].load(std::memory_order_relaxed) != ticket.tag) {
      return absl::FailedPreconditionError(
          absl::StrCat("operation ", ticket.seq, ": an earlier wait on this rank took its result"));
    }
    return false;
  };
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto t = taken();
    if (!t.ok() || *t) return t;
  }
  auto done = AwaitSlot(ticket.slot, ticket.tag, kSlotDone, Clock::now() + timeout, "a wait");
  if (!done.ok() || !*done) return done;
  std::lock_guard<std::mutex> lock(mu_);
  auto t = taken();  // a start harvested it meanwhile
  if (!t.ok() || *t) return t;
  *result = Take(ticket.slot);
  return true;
}

}  // namespace ragshard
