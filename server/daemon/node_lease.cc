#include "server/daemon/node_lease.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace ragshard::daemon {

bool NodeLease::Acknowledged(absl::Time sent, int64_t lease_ms) {
  absl::MutexLock lock(&mu_);
  last_sent_ = std::max(last_sent_, sent);
  lease_ = absl::Milliseconds(std::max<int64_t>(lease_ms, 0));
  const bool ended = !fence_.ok();
  fence_ = absl::OkStatus();
  return ended;
}

bool NodeLease::Expire(absl::Time now) {
  absl::MutexLock lock(&mu_);
  if (!fence_.ok() || lease_ <= absl::ZeroDuration() || now - last_sent_ <= lease_) return false;
  fence_ = absl::UnavailableError(absl::StrCat(
      "this node is fenced: the planner acknowledged no heartbeat for ",
      absl::ToInt64Milliseconds(now - last_sent_), " ms (its lease is ",
      absl::ToInt64Milliseconds(lease_),
      " ms, three quarters of the planner's node timeout): cut off from the planner, which may "
      "declare the node lost and go on without it, this node's jobs that recover in place or "
      "shrink stop here"));
  return true;
}

absl::Status NodeLease::AwaitUnfenced(absl::Time deadline) const {
  absl::MutexLock lock(&mu_);
  auto unfenced = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return fence_.ok(); };
  if (!fence_.ok()) {
    mu_.AwaitWithDeadline(absl::Condition(&unfenced),
                          std::min(deadline, last_sent_ + lease_ * 4 / 3));
  }
  return fence_;
}

absl::Status NodeLease::Fenced() const {
  absl::MutexLock lock(&mu_);
  return fence_;
}

}  // namespace ragshard::daemon
