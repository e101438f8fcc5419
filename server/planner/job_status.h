// The one owner of a job's status machine (planner.proto's JobStatus): the transitions it
// allows, in one table, and the only way the planner's service changes a job's status (Move).
// A transition the table lacks is FAILED_PRECONDITION naming both statuses; nothing changes.
//
//   (new)        -> REGISTERING                      CreateJob
//   REGISTERING  -> READY                            every rank registered, the plan stored
//   REGISTERING  -> FAILED                           registration or planning failed
//   REGISTERING, READY -> DEGRADED                   a node lost, a failure reported
//   READY        -> RECOVERING                       a lost rank or node recovered in place
//   RECOVERING   -> RECOVERING                       a new epoch (another loss meanwhile)
//   RECOVERING   -> READY                            every node recovered
//   RECOVERING   -> DEGRADED                         the recovery failed or timed out
//   RECOVERING   -> SHRUNK                           a shrink's successor goes on
//   any but DELETED -> DELETED                       DeleteJob
#pragma once

#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "ragshard/v1/planner.pb.h"

namespace ragshard::planner {

class JobStatusMachine {
 public:
  // The allowed (from, to) pairs; a new job's `from` is JOB_STATUS_UNSPECIFIED.
  static const std::vector<std::pair<v1::JobStatus, v1::JobStatus>>& Transitions();
  static bool Allowed(v1::JobStatus from, v1::JobStatus to);
  // Sets `job`'s status to `to` where the table allows it from its status now; else
  // FAILED_PRECONDITION naming the job and both statuses, and `job` is left as it was.
  static absl::Status Move(v1::Job* job, v1::JobStatus to);
  // FAILED and DELETED: nothing runs again.
  static bool Terminal(v1::JobStatus s) { return s == v1::JOB_FAILED || s == v1::JOB_DELETED; }
};

}  // namespace ragshard::planner
