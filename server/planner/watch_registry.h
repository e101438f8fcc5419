// Which WatchPlan streams watch which job, and how many are open.
//
// Thread-safe: its own mutex guards the membership and the count. The service adds and reads a
// job's watchers holding the job's lock (lock order job -> watchers), and that lock guards each
// channel's `sent_version`. Streams are written and closed after the locks are released (the
// Deferred the caller runs).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "server/planner/parked.h"
#include "server/planner/watch_channel.h"

namespace ragshard::planner {

class WatchRegistry {
 public:
  using Channel = std::shared_ptr<WatchChannel>;

  explicit WatchRegistry(int64_t max_watchers) : max_(max_watchers) {}

  // Adds a watcher of the job; RESOURCE_EXHAUSTED when `max_watchers` streams are open,
  // UNAVAILABLE after CloseAll.
  grpc::Status Add(const std::string& job_id, Channel channel);
  // The job's open streams (finished ones are dropped).
  std::vector<Channel> Live(const std::string& job_id);
  // Closes the job's streams with `status` and forgets them.
  void CloseJob(const std::string& job_id, const grpc::Status& status, Deferred* deferred);
  // Closes every stream and refuses new ones (shutdown).
  void CloseAll(const grpc::Status& status, Deferred* deferred);
  // Streams added and not yet dropped.
  int64_t size() const;

 private:
  // Drops the job's finished streams; true when none is left.
  bool Prune(std::vector<Channel>* channels) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int64_t max_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::vector<Channel>> by_job_ ABSL_GUARDED_BY(mu_);
  int64_t count_ ABSL_GUARDED_BY(mu_) = 0;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace ragshard::planner
