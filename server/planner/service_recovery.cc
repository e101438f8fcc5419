// Recovery in place (issue 54; the wire: planner.proto JobOptions.recovery_deadline_ms,
// JOB_RECOVERING, JobRecovery). A recoverable failure report on a READY job with a recovery
// deadline starts epoch E + 1: the job turns RECOVERING, its daemons learn it from the report's
// answer or their next heartbeat, and each says ReportRecovered once its ranks re-attached. The
// last of the job's nodes to say so makes the job READY again. The recovery ends DEGRADED when
// its deadline passes first (checked by the ticker and by the heartbeats of the job's nodes), when
// another failure is reported during it, or when a node of the job is lost (DegradeJobsOn).
#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "glog/logging.h"
#include "infra/rpc.h"
#include "infra/status_macros.h"
#include "server/planner/service.h"

namespace ragshard::planner {

namespace {

// Nodes as an error names them: "'n1', 'n2'", the first 8 and how many more.
std::string NodeNames(const std::vector<std::string>& nodes) {
  constexpr size_t kShown = 8;
  std::vector<std::string> quoted;
  for (size_t i = 0; i < nodes.size() && i < kShown; ++i) quoted.push_back("'" + nodes[i] + "'");
  std::string out = absl::StrJoin(quoted, ", ");
  if (nodes.size() > kShown) absl::StrAppend(&out, " and ", nodes.size() - kShown, " more");
  return out;
}

// The job's nodes that have not said ReportRecovered in the recovery `r`.
std::vector<std::string> NotRecovered(const v1::ListJobNodesResponse& nodes,
                                      const v1::JobRecovery& r) {
  const std::set<std::string> recovered(r.recovered_node_ids().begin(),
                                        r.recovered_node_ids().end());
  std::vector<std::string> missing;
  for (const std::string& node : nodes.node_ids()) {
    if (recovered.count(node) == 0) missing.push_back(node);
  }
  return missing;
}

std::string Seconds(int64_t ms) { return absl::StrFormat("%g", static_cast<double>(ms) / 1000.0); }

}  // namespace

bool PlannerService::RecoveryReport(JobState* js, const v1::ReportFailureRequest& req,
                                    v1::ReportFailureResponse* resp, Deferred* deferred) {
  v1::Job& job = js->job;
  const int64_t now = NowMs();
  // A recovery past its deadline ends as such, whatever this report says.
  ExpireRecovery(js, now, deferred);
  if (job.status() == v1::JOB_RECOVERING) {
    if (req.recoverable() && req.epoch() < job.recovery_epoch()) {
      // Another daemon noticed the loss being recovered: it joins this recovery.
      resp->set_recovery_epoch(job.recovery_epoch());
      resp->set_recovery_deadline_unix_ms(job.recovery().deadline_unix_ms());
      return true;
    }
    EndRecovery(js, RecoveryOutcome::kSecondFailure,
                absl::StrCat("a second failure during the recovery of epoch ", job.recovery_epoch(),
                             " (from ", job.recovery().lost(), "): ", ReportText(req)),
                deferred);
    return true;
  }
  const int64_t deadline_ms = job.options().recovery_deadline_ms();
  if (!req.recoverable() || deadline_ms <= 0 || job.status() != v1::JOB_READY ||
      req.epoch() != job.recovery_epoch()) {
    return false;
  }
  job.set_recovery_epoch(job.recovery_epoch() + 1);
  job.set_status(v1::JOB_RECOVERING);
  v1::JobRecovery& r = *job.mutable_recovery();
  r.Clear();
  r.set_job_id(job.job_id());
  r.set_epoch(job.recovery_epoch());
  r.set_lost(req.message().empty() ? req.lost_peer() : req.message());
  r.set_reporter_node_id(req.reporter_node_id());
  r.set_started_unix_ms(now);
  r.set_deadline_unix_ms(now + deadline_ms);
  job.set_error(absl::StrCat("recovering in place (epoch ", r.epoch(), ") from ", ReportText(req),
                             "; its ranks re-attach within ", Seconds(deadline_ms), " s"));
  LOG(WARNING) << "job " << job.job_id() << " RECOVERING: " << job.error();
  (void)JobChanged(js, deferred);
  resp->set_recovery_epoch(r.epoch());
  resp->set_recovery_deadline_unix_ms(r.deadline_unix_ms());
  return true;
}

void PlannerService::EndRecovery(JobState* js, RecoveryOutcome outcome, const std::string& error,
                                 Deferred* deferred) {
  js->job.set_status(v1::JOB_DEGRADED);
  js->job.set_error(error);
  metrics_.RecoveryEnded(outcome, 0);
  LOG(WARNING) << "job " << js->job.job_id() << " DEGRADED: " << error;
  (void)JobChanged(js, deferred);
}

void PlannerService::ExpireRecovery(JobState* js, int64_t now_ms, Deferred* deferred) {
  const v1::Job& job = js->job;
  if (job.status() != v1::JOB_RECOVERING || job.recovery().deadline_unix_ms() > now_ms) return;
  const v1::JobRecovery& r = job.recovery();
  const std::vector<std::string> missing = NotRecovered(JobNodes(js), r);
  const bool one = missing.size() == 1;
  EndRecovery(js, RecoveryOutcome::kDeadline,
              absl::StrCat("the recovery of epoch ", r.epoch(), " (from ", r.lost(),
                           ") missed its deadline: ", one ? "node " : "nodes ", NodeNames(missing),
                           one ? " has" : " have", " not recovered (", one ? "its" : "their",
                           " ranks did not re-attach within ",
                           Seconds(r.deadline_unix_ms() - r.started_unix_ms()), " s)"),
              deferred);
}

grpc::ServerUnaryReactor* PlannerService::ReportRecovered(Ctx* ctx,
                                                          const v1::ReportRecoveredRequest* req,
                                                          v1::ReportRecoveredResponse* resp) {
  return OnJob(
      ctx, Access::kUser, req->job_id(),
      [&] { return ValidateReportRecovered(*req, options_.limits); },
      [&](JobState& js, Deferred* deferred) -> absl::Status {
        v1::Job& job = js.job;
        const int64_t now = NowMs();
        ExpireRecovery(&js, now, deferred);
        const google::protobuf::RepeatedPtrField<std::string>& done =
            job.recovery().recovered_node_ids();
        const bool counted = std::find(done.begin(), done.end(), req->node_id()) != done.end();
        if (job.status() == v1::JOB_READY && req->epoch() == job.recovery_epoch() && counted) {
          // A repeat of a report that completed (or was part of) the recovery: its answer.
          resp->set_status(job.status());
          return absl::OkStatus();
        }
        if (job.status() != v1::JOB_RECOVERING || req->epoch() != job.recovery_epoch()) {
          return absl::FailedPreconditionError(
              absl::StrCat("node '", req->node_id(), "' reports recovering epoch ", req->epoch(),
                           " of job '", job.job_id(), "', which is ",
                           v1::JobStatus_Name(job.status()), " in epoch ", job.recovery_epoch(),
                           job.error().empty() ? "" : absl::StrCat(" (", job.error(), ")")));
        }
        const v1::ListJobNodesResponse& nodes = JobNodes(&js);
        if (std::find(nodes.node_ids().begin(), nodes.node_ids().end(), req->node_id()) ==
            nodes.node_ids().end()) {
          return absl::FailedPreconditionError(absl::StrCat(
              "node '", req->node_id(), "' holds no rank of job '", job.job_id(), "' (its nodes: ",
              NodeNames({nodes.node_ids().begin(), nodes.node_ids().end()}), ")"));
        }
        v1::JobRecovery& r = *job.mutable_recovery();
        if (!counted) r.add_recovered_node_ids(req->node_id());
        if (NotRecovered(nodes, r).empty()) {
          r.set_finished_unix_ms(now);
          const double seconds = static_cast<double>(now - r.started_unix_ms()) / 1000.0;
          job.set_status(v1::JOB_READY);
          job.clear_error();
          job.set_recoveries(job.recoveries() + 1);
          job.set_recovery_seconds(job.recovery_seconds() + seconds);
          metrics_.RecoveryEnded(RecoveryOutcome::kRecovered, seconds);
          LOG(INFO) << "job " << job.job_id() << " READY: recovered epoch " << r.epoch() << " in "
                    << seconds << " s (" << r.lost() << ")";
        }
        // Each node's recovery is stored: a planner restarted meanwhile goes on counting.
        RAGSHARD_RETURN_IF_ERROR(JobChanged(&js, deferred));
        resp->set_status(job.status());
        return absl::OkStatus();
      });
}

}  // namespace ragshard::planner
