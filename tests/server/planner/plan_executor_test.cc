// The planner's bounded plan executor: a fixed number of workers, tasks in submission order,
// Stop() drops what is queued and joins.
#include "server/planner/plan_executor.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"

namespace ragshard::planner {
namespace {

TEST(PlanExecutorTest, OneWorkerRunsTasksInOrder) {
  PlanExecutor e(1);
  absl::Mutex mu;
  std::vector<int> order;
  absl::Notification done;
  for (int i = 0; i < 100; ++i) {
    e.Submit([&, i] {
      absl::MutexLock lock(&mu);
      order.push_back(i);
      if (i == 99) done.Notify();
    });
  }
  done.WaitForNotification();
  absl::MutexLock lock(&mu);
  ASSERT_EQ(order.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(order[i], i);
}

TEST(PlanExecutorTest, NoMoreTasksRunAtOnceThanWorkers) {
  PlanExecutor e(3);
  EXPECT_EQ(e.threads(), 3);
  absl::Mutex mu;
  int running = 0, most = 0, finished = 0;
  absl::Notification release;
  for (int i = 0; i < 12; ++i) {
    e.Submit([&] {
      {
        absl::MutexLock lock(&mu);
        most = std::max(most, ++running);
      }
      release.WaitForNotification();
      absl::MutexLock lock(&mu);
      --running;
      ++finished;
    });
  }
  {
    // Three workers take three tasks and block; the other nine wait in the queue.
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(
        +[](int* r) { return *r == 3; }, &running));
  }
  EXPECT_EQ(e.queued(), 9u);
  release.Notify();
  absl::MutexLock lock(&mu);
  mu.Await(absl::Condition(
      +[](int* f) { return *f == 12; }, &finished));
  EXPECT_EQ(most, 3);
}

TEST(PlanExecutorTest, StopDropsQueuedTasksWaitsForRunningOnesAndIgnoresLaterOnes) {
  PlanExecutor e(1);
  absl::Notification started, release;
  std::atomic<int> ran{0};
  e.Submit([&] {
    started.Notify();
    release.WaitForNotification();
    ++ran;
  });
  for (int i = 0; i < 5; ++i) e.Submit([&] { ++ran; });
  started.WaitForNotification();
  std::thread stopper([&] { e.Stop(); });
  // Stop() empties the queue at once, and returns only after the running task: let it finish
  // once the queue is empty.
  while (e.queued() != 0) std::this_thread::yield();
  release.Notify();
  stopper.join();
  EXPECT_EQ(ran.load(), 1) << "the five queued tasks are dropped";
  e.Submit([&] { ++ran; });
  e.Stop();
  EXPECT_EQ(ran.load(), 1);
  EXPECT_EQ(e.queued(), 0u);
}

}  // namespace
}  // namespace ragshard::planner
