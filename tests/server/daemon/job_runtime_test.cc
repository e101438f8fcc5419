// JobRuntime in the test's process: one node of two local ranks on the host backend, with a fake
// planner. Operations run once every local rank has started them; a wait ends at its deadline;
// ranks that disagree, a rank that leaves and the planner's failure stop the job, name the cause
// and answer every waiter; the planner hears of a failure the node found.
#include "server/daemon/job_runtime.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <utility>
#include <vector>

#include "absl/synchronization/notification.h"
#include "engine/planner.h"
#include "server/daemon/data_backend.h"
#include "server/daemon/pool.h"
#include "tests/testing/fake_planner_client.h"

namespace ragshard::daemon {
namespace {

using ::testing::HasSubstr;

Inventory TwoUnits() {
  Inventory inv;
  for (int u = 0; u < 2; ++u) {
    UnitSpec* unit = inv.add_units();
    unit->set_name("layers." + std::to_string(u));
    TensorSpec* t = unit->add_tensors();
    t->set_name(unit->name() + ".w");
    t->add_shape(1024);
    t->set_dtype(v1::DTYPE_FP32);
  }
  return inv;
}

OpRequest Op(v1::OpKind kind, int unit) {
  OpRequest r;
  r.kind = kind;
  r.unit = unit;
  return r;
}

// One waiter's answer, once it came.
struct Answer {
  absl::Notification came;
  bool done = false;
  absl::Status status;
  OpTimes times;
};

// A job of one node of two local ranks, with a fake planner, and the tests' ways to drive it.
class JobRuntimeFixture : public ::testing::Test {
 protected:
  // Registers a waiter of `local` for `seq`, ending at `deadline` from now.
  std::shared_ptr<Answer> Wait(uint64_t seq, int local, absl::Duration deadline) {
    auto answer = std::make_shared<Answer>();
    job_->AddWaiter(
        seq, local, absl::Now() + deadline,
        [answer](bool done, const absl::Status& status, const v1::UnitBuffers*, OpTimes times) {
          answer->done = done;
          answer->status = status;
          answer->times = times;
          answer->came.Notify();
        });
    return answer;
  }

  // Both local ranks start `req`; the sequence number they agree on.
  uint64_t StartBoth(const OpRequest& req) {
    auto a = job_->StartOp(0, req);
    auto b = job_->StartOp(1, req);
    EXPECT_TRUE(a.ok() && b.ok()) << a.status() << " " << b.status();
    EXPECT_EQ(*a, *b);
    return *a;
  }

  const std::shared_ptr<testing::FakePlannerClient> planner_ =
      std::make_shared<testing::FakePlannerClient>();
  std::unique_ptr<Pool> pool_;  // before job_, which returns its leases to it when destroyed
  std::unique_ptr<JobRuntime> job_;
};

class JobRuntimeTest : public JobRuntimeFixture {
 protected:
  void SetUp() override {
    PlanOptions o;
    o.world = 2;
    auto plan = BuildPlan(TwoUnits(), o);
    ASSERT_TRUE(plan.ok()) << plan.status();
    auto pool = Pool::Create(16 << 20);
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = std::move(*pool);
    BackendContext context;
    context.plan = &*plan;
    context.local_ranks = {0, 1};
    context.host_pool = pool_.get();
    auto dp = CreateDataBackend(BackendKind::kHost, context);
    ASSERT_TRUE(dp.ok()) << dp.status();
    job_ = std::make_unique<JobRuntime>("job", "node-0", *plan, std::vector<int64_t>{0, 1}, nullptr,
                                        nullptr, std::move(*dp), planner_,
                                        std::make_shared<DaemonMetrics>());
  }
};

TEST_F(JobRuntimeTest, AnOperationRunsOnceEveryLocalRankStartedItAndAnswersBothWaiters) {
  auto first = job_->StartOp(0, Op(v1::OP_UNSHARD, 0));
  ASSERT_TRUE(first.ok()) << first.status();
  auto early = Wait(*first, 0, absl::Seconds(30));
  // One rank of two has started it: nothing runs, so the waiter is not answered.
  job_->ServeWaiters();
  EXPECT_FALSE(early->came.HasBeenNotified());
  auto second = job_->StartOp(1, Op(v1::OP_UNSHARD, 0));
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(*second, *first);
  auto late = Wait(*second, 1, absl::Seconds(30));
  for (const auto& a : {early, late}) {
    ASSERT_TRUE(a->came.WaitForNotificationWithTimeout(absl::Seconds(30)));
    EXPECT_TRUE(a->done);
    EXPECT_TRUE(a->status.ok()) << a->status;
    EXPECT_GT(a->times.finished_ns, 0);
    EXPECT_LE(a->times.started_ns, a->times.finished_ns);
  }
  // The next operation has the next number, for both ranks.
  EXPECT_EQ(StartBoth(Op(v1::OP_RESHARD, 0)), *first + 1);
  EXPECT_TRUE(planner_->failures().empty());
}

TEST_F(JobRuntimeTest, AWaitEndsAtItsDeadlineWhileTheOperationCannotRun) {
  auto seq = job_->StartOp(0, Op(v1::OP_UNSHARD, 1));  // local rank 1 never starts it
  ASSERT_TRUE(seq.ok());
  auto answer = Wait(*seq, 0, absl::Milliseconds(20));
  // The daemon's clock serves the waits (NodeDaemon::RunWaiterClock); here the test does, until
  // the deadline has passed.
  while (!answer->came.HasBeenNotified()) {
    job_->ServeWaiters();
    answer->came.WaitForNotificationWithTimeout(absl::Milliseconds(5));
  }
  EXPECT_FALSE(answer->done);
  EXPECT_TRUE(answer->status.ok());
}

TEST_F(JobRuntimeTest, RanksThatDisagreeStopTheJobNamingBothAndThePlannerHears) {
  auto a = job_->StartOp(0, Op(v1::OP_UNSHARD, 0));
  auto b = job_->StartOp(1, Op(v1::OP_UNSHARD, 1));
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_EQ(*a, *b);
  auto answer = Wait(*a, 0, absl::Seconds(30));
  ASSERT_TRUE(answer->came.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_TRUE(answer->done);
  EXPECT_EQ(answer->status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(answer->status.message()),
              HasSubstr("OP_UNSHARD of unit 0 against OP_UNSHARD of unit 1"));
  ASSERT_TRUE(planner_->AwaitFailures(1));
  const v1::ReportFailureRequest failure = planner_->failures()[0];
  EXPECT_EQ(failure.job_id(), "job");
  EXPECT_EQ(failure.reporter_node_id(), "node-0");
  EXPECT_THAT(failure.message(), HasSubstr("local ranks disagree"));
  // Later operations fail the same way.
  auto later = job_->StartOp(0, Op(v1::OP_RESHARD, 0));
  EXPECT_FALSE(later.ok());
  EXPECT_THAT(std::string(later.status().message()), HasSubstr("local ranks disagree"));
}

TEST_F(JobRuntimeTest, ARankThatLeavesFailsTheOperationsWaitingForItNamingIt) {
  auto seq = job_->StartOp(0, Op(v1::OP_UNSHARD, 0));
  ASSERT_TRUE(seq.ok());
  auto answer = Wait(*seq, 0, absl::Seconds(30));
  job_->LocalRankLeft(1, 7);
  ASSERT_TRUE(answer->came.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_TRUE(answer->done);
  EXPECT_EQ(answer->status.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(answer->status.message()), HasSubstr("rank 7 of job 'job'"));
  ASSERT_TRUE(planner_->AwaitFailures(1));
  EXPECT_THAT(planner_->failures()[0].message(), HasSubstr("rank 7"));
  // Until it attaches again, nothing starts; then operations run again.
  EXPECT_FALSE(job_->StartOp(0, Op(v1::OP_RESHARD, 0)).ok());
}

TEST_F(JobRuntimeTest, ThePlannersFailureAnswersEveryPendingWaiterAndEveryLaterStart) {
  auto seq = job_->StartOp(0, Op(v1::OP_UNSHARD, 0));
  ASSERT_TRUE(seq.ok());
  auto answer = Wait(*seq, 0, absl::Seconds(30));
  job_->Fail(absl::UnavailableError("node 'node-1' lost"));
  ASSERT_TRUE(answer->came.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_TRUE(answer->done);
  EXPECT_THAT(std::string(answer->status.message()), HasSubstr("node 'node-1' lost"));
  auto later = job_->StartOp(1, Op(v1::OP_UNSHARD, 0));
  EXPECT_FALSE(later.ok());
  EXPECT_THAT(std::string(later.status().message()), HasSubstr("node 'node-1' lost"));
  // The planner said it: nothing is reported back to it.
  EXPECT_TRUE(planner_->failures().empty());
}

// Recovery in place (docs/recovery.md): a job whose planner recovers lost ranks.
class JobRecoveryTest : public JobRuntimeTest {
 protected:
  void Recoverable(absl::Duration deadline) {
    planner_->EnableRecovery(deadline);
    job_->EnableRecovery(0, deadline, nullptr, nullptr);
    for (int local = 0; local < 2; ++local) generation_[local] = job_->Rejoined(local).generation;
  }
  uint64_t generation_[2] = {0, 0};
};

TEST_F(JobRecoveryTest, ALostRankStopsTheJobWithANoticeAndItRunsAgainOnceEveryRankIsBack) {
  Recoverable(absl::Seconds(60));
  const uint64_t ran = StartBoth(Op(v1::OP_UNSHARD, 0));
  auto first = Wait(ran, 0, absl::Seconds(30));
  ASSERT_TRUE(first->came.WaitForNotificationWithTimeout(absl::Seconds(30)));
  ASSERT_TRUE(first->status.ok()) << first->status;
  // Rank 1 waits on an operation rank 0 never starts: rank 0's process is lost.
  auto pending = job_->StartOp(1, Op(v1::OP_RESHARD, 0));
  ASSERT_TRUE(pending.ok());
  auto answer = Wait(*pending, 1, absl::Seconds(30));
  job_->LocalRankLeft(0, 0, generation_[0], /*clean=*/false);
  ASSERT_TRUE(answer->came.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_EQ(answer->status.code(), absl::StatusCode::kAborted);
  EXPECT_THAT(std::string(answer->status.message()),
              HasSubstr("ragshard recovery in progress: rank 0 of job 'job'"));
  auto refused = job_->StartOp(1, Op(v1::OP_UNSHARD, 1));
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("recovery in progress"));
  // The job's thread asks the planner for a recovery of the epoch after 0.
  ASSERT_TRUE(planner_->AwaitFailures(1));
  EXPECT_TRUE(planner_->failures()[0].recoverable());
  EXPECT_EQ(planner_->failures()[0].epoch(), 0);
  // Rank 0's new process attaches: it adopts the rank's state, and waits for rank 1's.
  const JobRuntime::Joined again = job_->Rejoined(0);
  EXPECT_TRUE(again.adopted);
  EXPECT_EQ(job_->AwaitRunning(absl::Now() + absl::Milliseconds(100)).code(),
            absl::StatusCode::kDeadlineExceeded);
  job_->LocalRankLeft(1, 1, generation_[1], /*clean=*/false);  // left on the notice
  job_->Rejoined(1);
  ASSERT_TRUE(job_->AwaitRunning(absl::Now() + absl::Seconds(30)).ok());
  EXPECT_EQ(job_->epoch(), 1);
  // The job's thread tells the planner once the job runs again.
  ASSERT_EQ(planner_->recovered(1).size(), 1u);
  EXPECT_EQ(planner_->recovered()[0].epoch(), 1);
  // Operations run again, numbered from 1.
  const uint64_t next = StartBoth(Op(v1::OP_UNSHARD, 0));
  EXPECT_EQ(next, 1u);
  auto done = Wait(next, 0, absl::Seconds(30));
  ASSERT_TRUE(done->came.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_TRUE(done->status.ok()) << done->status;
}

TEST_F(JobRecoveryTest, ARankThatDetachesIsNotRecovered) {
  Recoverable(absl::Seconds(60));
  auto pending = job_->StartOp(1, Op(v1::OP_UNSHARD, 0));
  ASSERT_TRUE(pending.ok());
  auto answer = Wait(*pending, 1, absl::Seconds(30));
  job_->LocalRankLeft(0, 0, generation_[0], /*clean=*/true);
  ASSERT_TRUE(answer->came.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_EQ(answer->status.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(answer->status.message()), HasSubstr("detached"));
  ASSERT_TRUE(planner_->AwaitFailures(1));
  EXPECT_FALSE(planner_->failures()[0].recoverable());
}

TEST_F(JobRecoveryTest, AnOlderProcessOfARankThatAttachedAgainLeavesWithoutEffect) {
  Recoverable(absl::Seconds(60));
  job_->Rejoined(0);  // a new process of rank 0, before its old one's side channel closed
  job_->LocalRankLeft(0, 0, generation_[0], /*clean=*/false);
  const uint64_t seq = StartBoth(Op(v1::OP_UNSHARD, 0));
  auto answer = Wait(seq, 0, absl::Seconds(30));
  ASSERT_TRUE(answer->came.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_TRUE(answer->status.ok()) << answer->status;
  EXPECT_TRUE(planner_->failures().empty());
}

TEST_F(JobRecoveryTest, ARecoveryWhoseRanksDoNotAttachAgainFailsAtItsDeadlineNamingThem) {
  Recoverable(absl::Milliseconds(200));
  job_->LocalRankLeft(0, 0, generation_[0], /*clean=*/false);
  // Nothing attaches again: the job fails at the deadline, named, and the planner hears it.
  const absl::Status s = job_->AwaitRunning(absl::Now() + absl::Seconds(30));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(s.message()), HasSubstr("ran past its deadline: rank(s) 0, 1"));
  ASSERT_TRUE(planner_->AwaitFailures(2));
  EXPECT_FALSE(planner_->failures()[1].recoverable());
  EXPECT_THAT(job_->StartOp(0, Op(v1::OP_UNSHARD, 0)).status().message(),
              HasSubstr("did not attach again"));
}

TEST_F(JobRecoveryTest, StateBuffersKeepTheirBytesAndRefuseAnotherSize) {
  auto a = job_->StateBuffer(3, 1, "opt/adam/exp_avg/0", 100, pool_.get());
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_FALSE(a->existed);
  EXPECT_EQ(a->lease->data()[99], 0);
  a->lease->data()[7] = 42;
  auto again = job_->StateBuffer(3, 1, "opt/adam/exp_avg/0", 100, pool_.get());
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->existed);
  EXPECT_EQ(again->lease->data()[7], 42);
  auto other_rank = job_->StateBuffer(2, 0, "opt/adam/exp_avg/0", 100, pool_.get());
  ASSERT_TRUE(other_rank.ok());
  EXPECT_FALSE(other_rank->existed);
  auto resized = job_->StateBuffer(3, 1, "opt/adam/exp_avg/0", 200, pool_.get());
  EXPECT_EQ(resized.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(resized.status().message()), HasSubstr("has 100 bytes; asked for 200"));
}

TEST(OpRequestTest, KindsAndReduceKindsThatAreNotOnesAreRefusedAtTheBoundary) {
  EXPECT_TRUE(MakeOpRequest(v1::OP_UNSHARD, 0, v1::REDUCE_AVG, 0, false, 0).ok());
  EXPECT_TRUE(MakeOpRequest(v1::OP_NOOP, 0, v1::REDUCE_SUM, 0, false, 0).ok());
  auto unspecified = MakeOpRequest(v1::OP_KIND_UNSPECIFIED, 0, v1::REDUCE_SUM, 0, false, 0);
  EXPECT_THAT(std::string(unspecified.status().message()), HasSubstr("kind: 0 is not"));
  auto unknown = MakeOpRequest(99, 0, v1::REDUCE_SUM, 0, false, 0);
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(unknown.status().message()), HasSubstr("kind: 99"));
  auto reduce = MakeOpRequest(v1::OP_REDUCE_SCATTER, 0, 42, 0, false, 0);
  EXPECT_THAT(std::string(reduce.status().message()), HasSubstr("reduce: 42"));
  v1::StartRequest start;
  start.set_kind(v1::OP_RESHARD);
  start.set_unit_index(3);
  start.set_keep_ranks(2);
  start.set_timeout_ms(1500);
  auto from_start = MakeOpRequest(start);
  ASSERT_TRUE(from_start.ok());
  EXPECT_EQ(from_start->kind, v1::OP_RESHARD);
  EXPECT_EQ(from_start->unit, 3);
  EXPECT_EQ(from_start->keep_ranks, 2);
  EXPECT_EQ(from_start->timeout_ms, 1500);
}

TEST_F(JobRuntimeTest, AUnitThatIsNotTheJobsIsRefusedNamingIt) {
  auto bad = job_->StartOp(0, Op(v1::OP_UNSHARD, 5));
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("unit_index: 5"));
  // The job goes on.
  const uint64_t seq = StartBoth(Op(v1::OP_UNSHARD, 0));
  auto answer = Wait(seq, 0, absl::Seconds(30));
  ASSERT_TRUE(answer->came.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_TRUE(answer->status.ok()) << answer->status;
}

// A backend whose unshard fails with `result`, after waiting for `release` where given: what a
// lost peer or a transfer stuck past its deadline looks like to the job layer.
class FakeBackend final : public DataBackend {
 public:
  FakeBackend(absl::Status result, absl::Notification* release)
      : result_(std::move(result)), release_(release) {}
  const char* name() const override { return "fake"; }
  int units() const override { return 2; }
  int64_t replicas() const override { return 1; }
  int64_t staging_bytes() const override { return 0; }
  absl::Status Unshard(int, absl::Time) override {
    if (release_ != nullptr) release_->WaitForNotification();
    return result_;
  }
  absl::Status AllocateUnsharded(int) override { return absl::OkStatus(); }
  absl::Status Reshard(int, int64_t) override { return absl::OkStatus(); }
  absl::Status AllocateGrad(int) override { return absl::OkStatus(); }
  absl::Status ReduceScatter(int, ReduceOp, bool accumulate, absl::Time) override {
    accumulated.push_back(accumulate);
    return absl::OkStatus();
  }
  absl::Status AllReduce(int, ReduceOp, absl::Time) override { return absl::OkStatus(); }
  absl::Status GatherToOwner(int, absl::Time) override { return absl::OkStatus(); }
  absl::Status ScatterFromOwner(int, absl::Time) override { return absl::OkStatus(); }
  absl::Status UpdateGather(int, absl::Time) override { return absl::OkStatus(); }
  void ResetTransient() override {}
  void Placement(int, int, v1::UnitBuffers*) const override {}
  void Describe(int, const v1::Plan&, v1::AttachResponse*) const override {}

  std::vector<bool> accumulated;  // each reduce-scatter's `accumulate`, in order

 private:
  const absl::Status result_;
  absl::Notification* const release_;
};

// The job layer over a fake backend (the seam DataBackend keeps: data_backend.h).
class JobRuntimeFaultTest : public JobRuntimeFixture {
 protected:
  void Start(absl::Status unshard_result, absl::Notification* release = nullptr) {
    PlanOptions o;
    o.world = 2;
    auto plan = BuildPlan(TwoUnits(), o);
    ASSERT_TRUE(plan.ok()) << plan.status();
    auto backend = std::make_unique<FakeBackend>(std::move(unshard_result), release);
    backend_ = backend.get();
    job_ = std::make_unique<JobRuntime>("job", "node-0", *plan, std::vector<int64_t>{0, 1}, nullptr,
                                        nullptr, std::move(backend), planner_,
                                        std::make_shared<DaemonMetrics>());
  }
  FakeBackend* backend_ = nullptr;  // owned by job_
};

// A rank whose gradient shard is known to be zero asks for no accumulation; where one local rank
// asks (the shards may be shared, or the ranks' zero_grad calls differ), the reduce-scatter adds.
TEST_F(JobRuntimeFaultTest, TheLocalRanksRequestsToAccumulateAreOred) {
  Start(absl::OkStatus());
  for (const auto& [first, second] : std::vector<std::pair<bool, bool>>{
           {false, false}, {false, true}, {true, false}, {true, true}}) {
    OpRequest a = Op(v1::OP_REDUCE_SCATTER, 0), b = a;
    a.accumulate = first;
    b.accumulate = second;
    auto sa = job_->StartOp(0, a);
    auto sb = job_->StartOp(1, b);
    ASSERT_TRUE(sa.ok() && sb.ok() && *sa == *sb);
    auto answer = Wait(*sa, 0, absl::Seconds(30));
    ASSERT_TRUE(answer->came.WaitForNotificationWithTimeout(absl::Seconds(30)));
    ASSERT_TRUE(answer->status.ok()) << answer->status;
  }
  EXPECT_EQ(backend_->accumulated, (std::vector<bool>{false, true, true, true}));
}

TEST_F(JobRuntimeFaultTest, ALostPeerStopsTheJobReportsItAndFailsEveryLaterOperation) {
  Start(absl::UnavailableError("peer 1 (node 'node-1') lost (connection closed)"));
  const uint64_t seq = StartBoth(Op(v1::OP_UNSHARD, 0));
  auto answer = Wait(seq, 1, absl::Seconds(30));
  ASSERT_TRUE(answer->came.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_TRUE(answer->done);
  EXPECT_EQ(answer->status.code(), absl::StatusCode::kUnavailable);
  ASSERT_TRUE(planner_->AwaitFailures(1));
  EXPECT_THAT(planner_->failures()[0].message(), HasSubstr("node 'node-1'"));
  auto later = job_->StartOp(0, Op(v1::OP_RESHARD, 0));
  EXPECT_EQ(later.status().code(), absl::StatusCode::kUnavailable);
}

// A node cut off from the planner: its report waits (out its retries), and the ranks have their
// answer, naming the peer, before it ends.
TEST_F(JobRuntimeFaultTest, AFailedOperationAnswersItsRanksBeforeThePlannerHears) {
  absl::Notification reachable;
  planner_->HoldReports(&reachable);
  Start(absl::DeadlineExceededError(
      "transfer with peer 1 (node 'node-1') did not complete before the deadline"));
  const uint64_t seq = StartBoth(Op(v1::OP_UNSHARD, 0));
  auto answer = Wait(seq, 0, absl::Seconds(30));
  ASSERT_TRUE(answer->came.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_EQ(answer->status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(answer->status.message()), HasSubstr("node 'node-1'"));
  EXPECT_TRUE(planner_->failures().empty());
  reachable.Notify();
  ASSERT_TRUE(planner_->AwaitFailures(1));
  EXPECT_THAT(planner_->failures()[0].message(), HasSubstr("node 'node-1'"));
}

TEST_F(JobRuntimeFaultTest, AWaitEndsAtItsDeadlineWhileTheOperationBlocksTheJobThread) {
  absl::Notification release;
  Start(absl::OkStatus(), &release);
  const uint64_t seq = StartBoth(Op(v1::OP_UNSHARD, 0));
  auto answer = Wait(seq, 0, absl::Milliseconds(20));
  // The job thread is inside the operation; the daemon's clock (here the test) serves the waits.
  while (!answer->came.HasBeenNotified()) {
    job_->ServeWaiters();
    answer->came.WaitForNotificationWithTimeout(absl::Milliseconds(5));
  }
  EXPECT_FALSE(answer->done);
  release.Notify();
  auto finished = Wait(seq, 0, absl::Seconds(30));
  ASSERT_TRUE(finished->came.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_TRUE(finished->done);
  EXPECT_TRUE(finished->status.ok()) << finished->status;
  EXPECT_TRUE(planner_->failures().empty());
}

}  // namespace
}  // namespace ragshard::daemon
