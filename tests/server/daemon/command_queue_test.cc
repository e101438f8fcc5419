// The command queue end to end in one process: the daemon's CommandPoller against a fake job,
// and the rank's RankQueue, over a real memfd, eventfd and futex. What crosses processes in
// production (the descriptors) is passed here as it is over the side channel, as descriptors.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <deque>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "client/rank_queue.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/daemon/command_poller.h"

namespace ragshard::daemon {
namespace {

using ::testing::HasSubstr;
using namespace std::chrono_literals;

// A job whose operations complete when the test says (Complete), or at once (`immediate`).
class FakeJob final : public OpTarget {
 public:
  explicit FakeJob(bool immediate) : immediate_(immediate) {}

  absl::StatusOr<uint64_t> StartOp(int local, const OpRequest& req) override {
    absl::MutexLock lock(&mu_);
    if (req.unit < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("unit_index: ", req.unit, " is not a unit of job 'fake'"));
    }
    last_ = req;
    last_local_ = local;
    return next_seq_++;
  }

  void AddWaiter(uint64_t seq, int, absl::Time, WaitCallback done) override {
    if (immediate_) return Done(seq, absl::OkStatus(), std::move(done));
    absl::MutexLock lock(&mu_);
    waiting_.push_back({seq, std::move(done)});
  }

  // Completes the oldest waiting operation with `status`; false when none waits. The poller
  // adds its waiter just after it tells the rank the operation started, so this first waits
  // for one (an event; the bound only stops a hang).
  bool Complete(const absl::Status& status) {
    std::pair<uint64_t, WaitCallback> w;
    {
      absl::MutexLock lock(&mu_);
      const auto waits = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !waiting_.empty(); };
      if (!mu_.AwaitWithTimeout(absl::Condition(&waits), absl::Seconds(60))) return false;
      w = std::move(waiting_.front());
      waiting_.pop_front();
    }
    Done(w.first, status, std::move(w.second));
    return true;
  }

  OpRequest last() {
    absl::MutexLock lock(&mu_);
    return last_;
  }
  int last_local() {
    absl::MutexLock lock(&mu_);
    return last_local_;
  }

 private:
  // The placement says which operation it was: unsharded_offset = 1000 * seq.
  static void Done(uint64_t seq, const absl::Status& status, WaitCallback done) {
    v1::UnitBuffers b;
    b.set_unsharded_offset(static_cast<int64_t>(1000 * seq));
    b.set_grad_offset(-1);
    OpTimes times;
    times.started_ns = static_cast<int64_t>(seq) * 10;
    times.finished_ns = static_cast<int64_t>(seq) * 10 + 5;
    done(true, status, status.ok() ? &b : nullptr, times);
  }

  const bool immediate_;
  absl::Mutex mu_;
  uint64_t next_seq_ ABSL_GUARDED_BY(mu_) = 1;
  OpRequest last_ ABSL_GUARDED_BY(mu_);
  int last_local_ ABSL_GUARDED_BY(mu_) = -1;
  std::deque<std::pair<uint64_t, WaitCallback>> waiting_ ABSL_GUARDED_BY(mu_);
};

class CommandQueueTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int sv[2];
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    daemon_side_ = ScopedFd(sv[0]);
    rank_side_ = ScopedFd(sv[1]);
    auto poller = CommandPoller::Create({}, [this](const absl::Status& s) {
      absl::MutexLock lock(&mu_);
      errors_.push_back(s);
    });
    ASSERT_TRUE(poller.ok()) << poller.status();
    poller_ = std::move(*poller);
  }

  // A rank's queue for local rank 3 of `job`; `memory` (when given) gets a second descriptor
  // of the queue's memory, to scribble on.
  std::unique_ptr<RankQueue> Open(const std::shared_ptr<OpTarget>& job,
                                  std::chrono::milliseconds peer_timeout = 30s,
                                  ScopedFd* memory = nullptr) {
    auto fds = poller_->Add("a1", job, 3);
    EXPECT_TRUE(fds.ok()) << fds.status();
    if (!fds.ok()) return nullptr;
    if (memory != nullptr) *memory = ScopedFd(::dup((*fds)[0].get()));
    RankQueueOptions o;
    o.daemon = "the daemon of node 'n0' (unix:/tmp/x.sock)";
    o.peer_timeout = peer_timeout;
    auto q = RankQueue::Open(std::move((*fds)[0]), std::move((*fds)[1]), rank_side_.get(), o);
    EXPECT_TRUE(q.ok()) << q.status();
    return q.ok() ? std::move(*q) : nullptr;
  }

  static QueueCommand Command(v1::OpKind kind, int unit) {
    QueueCommand c;
    c.kind = kind;
    c.unit = unit;
    c.reduce = v1::REDUCE_AVG;
    c.keep_ranks = 2;
    c.timeout_ms = 1234;
    return c;
  }

  // Until the poller has reported `n` broken commands (an event; the bound only stops a hang).
  bool AwaitErrors(size_t n) {
    absl::MutexLock lock(&mu_);
    const auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return errors_.size() >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&enough), absl::Seconds(60)) && errors_.size() == n;
  }

  std::vector<absl::Status> errors() {
    absl::MutexLock lock(&mu_);
    return errors_;
  }

  ScopedFd daemon_side_, rank_side_;
  std::unique_ptr<CommandPoller> poller_;
  absl::Mutex mu_;
  std::vector<absl::Status> errors_ ABSL_GUARDED_BY(mu_);
};

TEST_F(CommandQueueTest, AnOperationStartsAndCompletesWithItsPlacement) {
  auto job = std::make_shared<FakeJob>(/*immediate=*/false);
  auto q = Open(job);
  ASSERT_NE(q, nullptr);
  auto t = q->Start(Command(v1::OP_UNSHARD, 5));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->seq, 1u);
  // What the job was asked, as the rank wrote it.
  const OpRequest req = job->last();
  EXPECT_EQ(req.kind, v1::OP_UNSHARD);
  EXPECT_EQ(req.unit, 5);
  EXPECT_EQ(req.reduce, v1::REDUCE_AVG);
  EXPECT_EQ(req.keep_ranks, 2);
  EXPECT_EQ(req.timeout_ms, 1234);
  EXPECT_EQ(job->last_local(), 3);  // attachment a1's local rank

  QueueResult r;
  auto done = q->Wait(*t, 0us, &r);  // a poll: still running
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_FALSE(*done);
  std::thread completer([&] { ASSERT_TRUE(job->Complete(absl::OkStatus())); });
  done = q->Wait(*t, 10s, &r);
  completer.join();
  ASSERT_TRUE(done.ok()) << done.status();
  ASSERT_TRUE(*done);
  ASSERT_TRUE(r.status.ok()) << r.status;
  v1::UnitBuffers b;
  ASSERT_TRUE(b.ParseFromString(r.placement));
  EXPECT_EQ(b.unsharded_offset(), 1000);
  EXPECT_EQ(r.started_ns, 10);  // when the job ran it
  EXPECT_EQ(r.finished_ns, 15);
  // The result was taken: a second wait says so rather than reading a reused slot.
  done = q->Wait(*t, 0us, &r);
  EXPECT_EQ(done.status().code(), absl::StatusCode::kFailedPrecondition) << done.status();
  EXPECT_GE(poller_->commands(), 1);
}

TEST_F(CommandQueueTest, ErrorsOfTheStartAndOfTheOperationCarryTheDaemonsText) {
  auto job = std::make_shared<FakeJob>(/*immediate=*/false);
  auto q = Open(job);
  ASSERT_NE(q, nullptr);
  auto bad = q->Start(Command(v1::OP_UNSHARD, -1));
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("unit_index: -1 is not a unit of job 'fake'"));
  auto kind = q->Start(Command(static_cast<v1::OpKind>(999), 0));
  EXPECT_EQ(kind.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(kind.status().message(), HasSubstr("kind: 999 is not an operation"));

  auto t = q->Start(Command(v1::OP_REDUCE_SCATTER, 0));
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_TRUE(job->Complete(absl::UnavailableError("peer node-1 (rank 2) closed its connection")));
  QueueResult r;
  auto done = q->Wait(*t, 10s, &r);
  ASSERT_TRUE(done.ok() && *done);
  EXPECT_EQ(r.status.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(r.status.message(), "peer node-1 (rank 2) closed its connection");
  EXPECT_TRUE(r.placement.empty());

  // A text longer than a slot is cut, and says so.
  auto t2 = q->Start(Command(v1::OP_REDUCE_SCATTER, 0));
  ASSERT_TRUE(t2.ok());
  ASSERT_TRUE(job->Complete(absl::InternalError(std::string(5000, 'x'))));
  done = q->Wait(*t2, 10s, &r);
  ASSERT_TRUE(done.ok() && *done);
  EXPECT_EQ(r.status.code(), absl::StatusCode::kInternal);
  EXPECT_LE(r.status.message().size(), kQueueSlotPayload);
  EXPECT_THAT(r.status.message(), HasSubstr("[cut: the whole text is in the daemon's log]"));
}

TEST_F(CommandQueueTest, MoreOperationsInFlightThanSlotsAllComplete) {
  // The job completes each operation as it starts; the rank waits for none until the end, so
  // the starts beyond the slots move finished results out of their slots.
  auto job = std::make_shared<FakeJob>(/*immediate=*/true);
  auto q = Open(job);
  ASSERT_NE(q, nullptr);
  std::vector<QueueTicket> tickets;
  for (int i = 0; i < 3 * static_cast<int>(kQueueSlots); ++i) {
    auto t = q->Start(Command(v1::OP_ALLOCATE_GRAD, i));
    ASSERT_TRUE(t.ok()) << i << ": " << t.status();
    EXPECT_EQ(t->seq, static_cast<uint64_t>(i + 1));
    tickets.push_back(*t);
  }
  for (const QueueTicket& t : tickets) {
    QueueResult r;
    auto done = q->Wait(t, 10s, &r);
    ASSERT_TRUE(done.ok() && *done) << t.seq;
    v1::UnitBuffers b;
    ASSERT_TRUE(b.ParseFromString(r.placement));
    EXPECT_EQ(b.unsharded_offset(), static_cast<int64_t>(1000 * t.seq));
  }
}

TEST_F(CommandQueueTest, ThreadsStartAndWaitAtOnce) {
  auto job = std::make_shared<FakeJob>(/*immediate=*/true);
  auto q = Open(job);
  ASSERT_NE(q, nullptr);
  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&] {
      for (int i = 0; i < 500; ++i) {
        auto t = q->Start(Command(i % 2 ? v1::OP_NOOP : v1::OP_RESHARD, 0));
        QueueResult r;
        auto done = t.ok() ? q->Wait(*t, 10s, &r) : t.status();
        if (!done.ok() || !*done || !r.status.ok()) bad.fetch_add(1);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(bad.load(), 0);
}

TEST_F(CommandQueueTest, AReleasedJobAnswersNotFound) {
  auto job = std::make_shared<FakeJob>(/*immediate=*/true);
  auto q = Open(job);
  ASSERT_NE(q, nullptr);
  job.reset();
  auto t = q->Start(Command(v1::OP_UNSHARD, 0));
  EXPECT_EQ(t.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(t.status().message(), HasSubstr("the job was released"));
}

TEST_F(CommandQueueTest, ADaemonThatExitsIsNamed) {
  auto job = std::make_shared<FakeJob>(/*immediate=*/false);
  auto q = Open(job);
  ASSERT_NE(q, nullptr);
  auto t = q->Start(Command(v1::OP_UNSHARD, 0));
  ASSERT_TRUE(t.ok());
  // The daemon's process ends: its poller stops and the kernel closes its side channel.
  poller_.reset();
  daemon_side_.Reset();
  QueueResult r;
  auto done = q->Wait(*t, 60s, &r);
  EXPECT_EQ(done.status().code(), absl::StatusCode::kUnavailable) << done.status();
  EXPECT_THAT(done.status().message(),
              HasSubstr("the daemon of node 'n0' (unix:/tmp/x.sock) is unreachable"));
  EXPECT_THAT(done.status().message(), HasSubstr("during a wait"));
}

TEST_F(CommandQueueTest, ADaemonThatStopsAnsweringIsNamedAfterThePeerTimeout) {
  auto job = std::make_shared<FakeJob>(/*immediate=*/false);
  auto q = Open(job, /*peer_timeout=*/300ms);
  ASSERT_NE(q, nullptr);
  auto t = q->Start(Command(v1::OP_UNSHARD, 0));
  ASSERT_TRUE(t.ok());
  poller_.reset();  // stopped, as SIGSTOP stops it: the side channel stays open
  QueueResult r;
  const auto start = std::chrono::steady_clock::now();
  auto done = q->Wait(*t, 60s, &r);
  EXPECT_GE(std::chrono::steady_clock::now() - start, 300ms);
  EXPECT_EQ(done.status().code(), absl::StatusCode::kUnavailable) << done.status();
  EXPECT_THAT(done.status().message(),
              HasSubstr("did not answer a wait within 300 ms: it is hung or stopped"));
}

TEST_F(CommandQueueTest, ARankThatBreaksTheQueueHurtsOnlyItself) {
  auto job = std::make_shared<FakeJob>(/*immediate=*/true);
  ScopedFd memory;
  auto q = Open(job, 30s, &memory);
  ASSERT_NE(q, nullptr);
  auto m = QueueMapping::Map(memory.get());
  ASSERT_TRUE(m.ok()) << m.status();
  // A command naming a slot that does not exist, then a head far past the ring.
  QueueCommand c = Command(v1::OP_UNSHARD, 0);
  c.slot = 999;
  uint32_t head = (*m)->head.load();
  (*m)->ring[head % kQueueCommands] = c;
  (*m)->head.store(head + 1);
  ASSERT_TRUE(AwaitErrors(1));
  EXPECT_THAT(errors()[0].message(), HasSubstr("completion slot 999"));
  // The queue still serves well-formed commands.
  auto t = q->Start(Command(v1::OP_NOOP, 0));
  ASSERT_TRUE(t.ok()) << t.status();
  head = (*m)->head.load();
  (*m)->head.store(head + 100000);
  ASSERT_TRUE(AwaitErrors(2));
  EXPECT_THAT(errors()[1].message(), HasSubstr("command ring claims"));
}

TEST_F(CommandQueueTest, WhatTheRankHoldsCannotHarmTheDaemon) {
  auto job = std::make_shared<FakeJob>(/*immediate=*/true);
  auto fds = poller_->Add("a2", job, 0);
  ASSERT_TRUE(fds.ok()) << fds.status();
  // A second queue for the same attachment is refused (it would replace the first's).
  auto again = poller_->Add("a2", job, 0);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(again.status().message(), HasSubstr("'a2' has a command queue already"));
  // The memory's size is sealed: truncating it under the daemon's mapping fails.
  EXPECT_NE(::ftruncate((*fds)[0].get(), 0), 0);
  EXPECT_NE(::ftruncate((*fds)[0].get(), 2 * sizeof(QueueLayout)), 0);
  // The doorbell is the write end of a pipe: making it blocking is the rank's own affair, the
  // daemon's read end stays non-blocking, and the queue goes on serving.
  ASSERT_EQ(::fcntl((*fds)[1].get(), F_SETFL, 0), 0);
  RankQueueOptions o;
  o.daemon = "the daemon";
  auto q = RankQueue::Open(std::move((*fds)[0]), std::move((*fds)[1]), rank_side_.get(), o);
  ASSERT_TRUE(q.ok()) << q.status();
  for (int i = 0; i < 100; ++i) {
    auto t = (*q)->Start(Command(v1::OP_NOOP, 0));
    ASSERT_TRUE(t.ok()) << t.status();
    QueueResult r;
    auto done = (*q)->Wait(*t, 10s, &r);
    ASSERT_TRUE(done.ok() && *done) << i;
  }
}

TEST(CommandQueueMapTest, AMemfdOfAnotherSizeOrVersionIsNamed) {
  ScopedFd small(::memfd_create("x", MFD_CLOEXEC));
  ASSERT_EQ(::ftruncate(small.get(), 4096), 0);
  auto m = QueueMapping::Map(small.get());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(m.status().message(), HasSubstr("different versions"));
  ScopedFd wrong(::memfd_create("y", MFD_CLOEXEC));
  ASSERT_EQ(::ftruncate(wrong.get(), sizeof(QueueLayout)), 0);
  m = QueueMapping::Map(wrong.get());  // zeros: no magic
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(m.status().message(), HasSubstr("upgrade them together"));
}

}  // namespace
}  // namespace ragshard::daemon
