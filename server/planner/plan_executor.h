// The planner's bounded plan executor: a fixed set of threads that run the plans of jobs in the
// order they were submitted. Nothing of a job outlives its plan (a thread per plan, joined only at
// shutdown, kept a stack mapping per planned job until the planner ran out of maps).
#pragma once

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace ragshard::planner {

class PlanExecutor {
 public:
  // `threads` >= 1 workers, started now.
  explicit PlanExecutor(int threads);
  ~PlanExecutor();
  PlanExecutor(const PlanExecutor&) = delete;
  PlanExecutor& operator=(const PlanExecutor&) = delete;

  // Queues `task`; after Stop() it is dropped.
  void Submit(std::function<void()> task);
  // Drops the queued tasks, waits for the running ones and joins the workers. Idempotent.
  void Stop();

  int threads() const { return static_cast<int>(workers_.size()); }
  // Tasks queued and not yet started.
  size_t queued() const;

 private:
  void Work();
  bool HasWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopped_ || !queue_.empty(); }

  mutable absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

}  // namespace ragshard::planner
