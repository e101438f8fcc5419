// The node's lease from the planner (HeartbeatResponse.lease_ms, docs/recovery.md "Partitions
// and fencing"): a daemon that has had no heartbeat acknowledged for the lease since it sent the
// last acknowledged one is fenced: it fails its jobs' operations and takes no attachment until
// a heartbeat is acknowledged again. The planner declares a node lost only after its node
// timeout (the lease is three quarters of it) counted from the heartbeat's arrival, so a
// partitioned daemon has stopped before the job can go on without it.
//
// Thread-safe (its own mutex, a leaf lock): the heartbeat thread acknowledges, the waiter clock
// expires, attaches read the fence.
#pragma once

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace ragshard::daemon {

class NodeLease {
 public:
  // A heartbeat sent at `sent` was acknowledged, with the lease `lease_ms` (0: none). True when
  // this ends a fence.
  bool Acknowledged(absl::Time sent, int64_t lease_ms);
  // True once, when at `now` the lease has run out (the caller fails the jobs with Fenced()).
  bool Expire(absl::Time now);
  // UNAVAILABLE naming the fence while fenced, else OK.
  absl::Status Fenced() const;
  // Waits while fenced, until `deadline` or until the planner counts the node lost (its node
  // timeout, four thirds of the lease, after the last acknowledged heartbeat was sent), the
  // sooner: OK once a heartbeat is acknowledged again, else Fenced(). A rank that registers or
  // attaches during a short partition goes on when it ends.
  absl::Status AwaitUnfenced(absl::Time deadline) const;

 private:
  mutable absl::Mutex mu_;
  absl::Time last_sent_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Duration lease_ ABSL_GUARDED_BY(mu_) = absl::ZeroDuration();
  absl::Status fence_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ragshard::daemon
