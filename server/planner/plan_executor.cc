#include "server/planner/plan_executor.h"

#include <algorithm>
#include <utility>

namespace ragshard::planner {

PlanExecutor::PlanExecutor(int threads) {
  for (int i = 0; i < std::max(threads, 1); ++i) workers_.emplace_back([this] { Work(); });
}

PlanExecutor::~PlanExecutor() { Stop(); }

void PlanExecutor::Submit(std::function<void()> task) {
  absl::MutexLock lock(&mu_);
  if (!stopped_) queue_.push_back(std::move(task));
}

size_t PlanExecutor::queued() const {
  absl::MutexLock lock(&mu_);
  return queue_.size();
}

void PlanExecutor::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopped_ = true;
    queue_.clear();
  }
  for (std::thread& t : workers_) {
    if (t.joinable()) t.join();
  }
}

void PlanExecutor::Work() {
  for (;;) {
    std::function<void()> task;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &PlanExecutor::HasWork));
      if (stopped_) return;
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

}  // namespace ragshard::planner
