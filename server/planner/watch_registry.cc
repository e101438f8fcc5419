#include "server/planner/watch_registry.h"

#include <algorithm>
#include <utility>

namespace ragshard::planner {

bool WatchRegistry::Prune(std::vector<Channel>* channels) {
  const auto done = std::remove_if(channels->begin(), channels->end(),
                                   [](const Channel& c) { return c->done(); });
  count_ -= static_cast<int64_t>(channels->end() - done);
  channels->erase(done, channels->end());
  return channels->empty();
}

grpc::Status WatchRegistry::Add(const std::string& job_id, Channel channel) {
  absl::MutexLock lock(&mu_);
  if (closed_) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "planner shutting down");
  if (count_ >= max_) {
    // Streams that finished since they were last looked at do not count.
    for (auto it = by_job_.begin(); it != by_job_.end();) {
      it = Prune(&it->second) ? by_job_.erase(it) : std::next(it);
    }
  }
  if (count_ >= max_) {
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "too many watchers");
  }
  by_job_[job_id].push_back(std::move(channel));
  ++count_;
  return grpc::Status::OK;
}

std::vector<WatchRegistry::Channel> WatchRegistry::Live(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  auto it = by_job_.find(job_id);
  if (it == by_job_.end()) return {};
  if (Prune(&it->second)) {
    by_job_.erase(it);
    return {};
  }
  return it->second;
}

void WatchRegistry::CloseJob(const std::string& job_id, const grpc::Status& status,
                             Deferred* deferred) {
  absl::MutexLock lock(&mu_);
  auto it = by_job_.find(job_id);
  if (it == by_job_.end()) return;
  for (Channel& c : it->second) deferred->push_back([c, status] { c->Close(status); });
  count_ -= static_cast<int64_t>(it->second.size());
  by_job_.erase(it);
}

void WatchRegistry::CloseAll(const grpc::Status& status, Deferred* deferred) {
  absl::MutexLock lock(&mu_);
  for (auto& [id, channels] : by_job_) {
    for (Channel& c : channels) deferred->push_back([c, status] { c->Close(status); });
  }
  by_job_.clear();
  count_ = 0;
  closed_ = true;
}

int64_t WatchRegistry::size() const {
  absl::MutexLock lock(&mu_);
  return count_;
}

}  // namespace ragshard::planner
