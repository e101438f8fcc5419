#include "server/planner/job_status.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace ragshard::planner {

const std::vector<std::pair<v1::JobStatus, v1::JobStatus>>& JobStatusMachine::Transitions() {
  static const auto* table = [] {
    auto* t = new std::vector<std::pair<v1::JobStatus, v1::JobStatus>>{
        {v1::JOB_STATUS_UNSPECIFIED, v1::JOB_REGISTERING},
        {v1::JOB_REGISTERING, v1::JOB_READY},
        {v1::JOB_REGISTERING, v1::JOB_FAILED},
        {v1::JOB_REGISTERING, v1::JOB_DEGRADED},
        {v1::JOB_READY, v1::JOB_DEGRADED},
        {v1::JOB_READY, v1::JOB_RECOVERING},
        {v1::JOB_RECOVERING, v1::JOB_RECOVERING},
        {v1::JOB_RECOVERING, v1::JOB_READY},
        {v1::JOB_RECOVERING, v1::JOB_DEGRADED},
        {v1::JOB_RECOVERING, v1::JOB_SHRUNK},
    };
    for (int s = v1::JOB_REGISTERING; s <= v1::JobStatus_MAX; ++s) {
      if (s != v1::JOB_DELETED) t->push_back({static_cast<v1::JobStatus>(s), v1::JOB_DELETED});
    }
    return t;
  }();
  return *table;
}

bool JobStatusMachine::Allowed(v1::JobStatus from, v1::JobStatus to) {
  const auto& t = Transitions();
  return std::find(t.begin(), t.end(), std::make_pair(from, to)) != t.end();
}

absl::Status JobStatusMachine::Move(v1::Job* job, v1::JobStatus to) {
  if (!Allowed(job->status(), to)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", job->job_id(), "' cannot go from ", v1::JobStatus_Name(job->status()), " to ",
        v1::JobStatus_Name(to), " (server/planner/job_status.h lists the transitions)"));
  }
  job->set_status(to);
  return absl::OkStatus();
}

}  // namespace ragshard::planner
