#include "server/daemon/command_poller.h"

#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace ragshard::daemon {
namespace {

using Clock = std::chrono::steady_clock;

void Relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// The poller's own wake-up eventfd (the queues' doorbells are pipes: DrainDoorbell).
void DrainEventFd(int fd) {
  uint64_t n = 0;
  while (::read(fd, &n, sizeof(n)) == sizeof(n)) {
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<CommandPoller>> CommandPoller::Create(
    Options options, std::function<void(const absl::Status&)> on_error) {
  ScopedFd epoll(::epoll_create1(EPOLL_CLOEXEC));
  ScopedFd wake(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!epoll.valid() || !wake.valid()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the command poller's epoll or eventfd: ", std::strerror(errno)));
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = wake.get();
  if (::epoll_ctl(epoll.get(), EPOLL_CTL_ADD, wake.get(), &ev) != 0) {
    return absl::InternalError(absl::StrCat("epoll_ctl: ", std::strerror(errno)));
  }
  return std::unique_ptr<CommandPoller>(
      new CommandPoller(options, std::move(on_error), std::move(epoll), std::move(wake)));
}

CommandPoller::CommandPoller(Options options, std::function<void(const absl::Status&)> on_error,
                             ScopedFd epoll, ScopedFd wake)
    : options_(options),
      on_error_(std::move(on_error)),
      epoll_(std::move(epoll)),
      wake_(std::move(wake)) {
  thread_ = std::thread([this] { Run(); });
}

CommandPoller::~CommandPoller() {
  stop_.store(true);
  const uint64_t one = 1;
  (void)!::write(wake_.get(), &one, sizeof(one));
  thread_.join();
}

absl::StatusOr<std::vector<ScopedFd>> CommandPoller::Add(const std::string& id,
                                                         std::weak_ptr<OpTarget> target,
                                                         int local) {
  {
    absl::MutexLock lock(&mu_);
    if (queues_.count(id) > 0) {
      return absl::AlreadyExistsError(
          absl::StrCat("attachment '", id, "' has a command queue already"));
    }
  }
  auto created = CreateQueue();
  if (!created.ok()) return created.status();
  auto q = std::make_shared<Queue>();
  q->id = id;
  q->memory = std::make_shared<Memory>();
  q->memory->mapping = std::move(created->mapping);
  q->doorbell = std::move(created->doorbell);
  q->target = std::move(target);
  q->local = local;
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = q->doorbell.get();
  if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, q->doorbell.get(), &ev) != 0) {
    return absl::InternalError(absl::StrCat("epoll_ctl: ", std::strerror(errno)));
  }
  {
    absl::MutexLock lock(&mu_);
    if (!queues_.emplace(id, q).second) {  // a concurrent Add of the same id won
      (void)::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, q->doorbell.get(), nullptr);
      return absl::AlreadyExistsError(
          absl::StrCat("attachment '", id, "' has a command queue already"));
    }
    generation_.fetch_add(1);
  }
  const uint64_t one = 1;
  (void)!::write(wake_.get(), &one, sizeof(one));
  std::vector<ScopedFd> pass;
  pass.push_back(std::move(created->memory));
  pass.push_back(std::move(created->doorbell_write));
  return pass;
}

void CommandPoller::Remove(const std::string& id) {
  std::shared_ptr<Queue> gone;
  {
    absl::MutexLock lock(&mu_);
    auto entry = queues_.extract(id);
    if (entry.empty()) return;
    gone = std::move(entry.mapped());
    generation_.fetch_add(1);
  }
  // Out of the epoll set before its descriptor can close (the thread may still hold the queue).
  (void)::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, gone->doorbell.get(), nullptr);
  const uint64_t one = 1;
  (void)!::write(wake_.get(), &one, sizeof(one));
}

void CommandPoller::Broken(Queue& q, const absl::Status& why) {
  if (!q.broken) LOG(ERROR) << "attachment " << q.id << ": " << why << " (logged once)";
  q.broken = true;
  if (on_error_) on_error_(why);
}

bool CommandPoller::Drain(Queue& q) {
  QueueLayout* l = q.memory->mapping.get();
  const uint32_t head = l->head.load(std::memory_order_acquire);
  uint32_t tail = l->tail.load(std::memory_order_relaxed);
  if (head == tail) return false;
  if (head - tail > kQueueCommands) {
    Broken(q, absl::InvalidArgumentError(absl::StrCat(
                  "the rank's command ring claims ", head - tail, " commands in its ",
                  kQueueCommands, " entries; skipped (the rank wrote over the queue's header)")));
    l->tail.store(head, std::memory_order_release);
    return true;
  }
  while (tail != head) {
    // A copy first: the rank may write over the entry while it is checked.
    const QueueCommand c = l->ring[tail % kQueueCommands];
    l->tail.store(++tail, std::memory_order_release);
    commands_.fetch_add(1, std::memory_order_relaxed);
    Handle(q, c);
  }
  return true;
}

void CommandPoller::Handle(Queue& q, const QueueCommand& c) {
  QueueLayout* l = q.memory->mapping.get();
  if (c.slot >= kQueueSlots) {
    Broken(q, absl::InvalidArgumentError(absl::StrCat("a command names completion slot ", c.slot,
                                                      " of ", kQueueSlots, "; ignored")));
    return;
  }
  QueueSlot* slot = &l->slot[c.slot];
  const auto fail = [&](const absl::Status& s) {
    PublishResult(slot, /*failed_at_start=*/true, s, "");
    RingRank(l);
  };
  slot->started_ns = 0;
  slot->finished_ns = 0;
  if (c.kind == v1::OP_NOOP) {
    slot->seq = 0;
    PublishResult(slot, false, absl::OkStatus(), "");
    RingRank(l);
    return;
  }
  auto req = MakeOpRequest(c.kind, c.unit, c.reduce, c.keep_ranks, c.accumulate != 0, c.timeout_ms);
  if (!req.ok()) return fail(req.status());
  std::shared_ptr<OpTarget> target = q.target.lock();
  if (target == nullptr) return fail(absl::NotFoundError("the job was released"));
  auto seq = target->StartOp(q.local, *req);
  if (!seq.ok()) return fail(seq.status());
  slot->seq = *seq;
  slot->state.store(kSlotStarted, std::memory_order_seq_cst);
  RingRank(l);
  target->AddWaiter(
      *seq, q.local, absl::InfiniteFuture(),
      [memory = q.memory, s = c.slot](bool done, const absl::Status& status,
                                      const v1::UnitBuffers* placement, OpTimes times) {
        std::string bytes;
        if (placement != nullptr) placement->SerializeToString(&bytes);
        const absl::Status result =
            done ? status : absl::InternalError("a queued wait ended before its operation");
        QueueSlot* out = &memory->mapping->slot[s];
        out->started_ns = times.started_ns;
        out->finished_ns = times.finished_ns;
        PublishResult(out, false, result, bytes);
        RingRank(memory->mapping.get());
      });
}

void CommandPoller::Run() {
  std::vector<std::shared_ptr<Queue>> live;
  uint64_t seen = ~uint64_t{0};
  Clock::time_point last_work = Clock::now(), last_tick = last_work;
  epoll_event events[16];
  while (!stop_.load(std::memory_order_relaxed)) {
    if (generation_.load() != seen) {
      absl::MutexLock lock(&mu_);
      seen = generation_.load();
      live.clear();
      for (const auto& [id, q] : queues_) live.push_back(q);
    }
    bool worked = false;
    for (const auto& q : live) worked |= Drain(*q);
    const Clock::time_point now = Clock::now();
    if (now - last_tick >= kQueueClockPeriod) {
      for (const auto& q : live) q->memory->mapping->daemon_clock.fetch_add(1);
      last_tick = now;
    }
    if (worked || now - last_work < options_.spin) {
      if (worked) last_work = now;
      for (int i = 0; i < 32; ++i) Relax();
      // Yields while it spins: the rank it just answered is often woken on this core (the
      // scheduler places a woken thread beside its waker), and would otherwise wait for the
      // spin to end.
      if (!worked) std::this_thread::yield();
      continue;
    }
    // Sleep: tell the ranks to ring, then look once more (a command written before the flag
    // was seen would otherwise wait for the next tick).
    for (const auto& q : live) q->memory->mapping->daemon_sleeping.store(1);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    bool pending = false;
    for (const auto& q : live) {
      const QueueLayout* l = q->memory->mapping.get();
      pending |= l->head.load() != l->tail.load(std::memory_order_relaxed);
    }
    const auto until_tick = std::chrono::duration_cast<std::chrono::milliseconds>(
        last_tick + kQueueClockPeriod - Clock::now());
    if (!pending) {
      (void)::epoll_wait(epoll_.get(), events, 16,
                         static_cast<int>(std::max<int64_t>(until_tick.count(), 0) + 1));
    }
    for (const auto& q : live) {
      q->memory->mapping->daemon_sleeping.store(0, std::memory_order_relaxed);
      DrainDoorbell(q->doorbell.get());
    }
    DrainEventFd(wake_.get());
    last_work = Clock::now();
  }
}

}  // namespace ragshard::daemon
