// Recovery in place (issue 54; the wire: planner.proto JobOptions.recovery_deadline_ms,
// JOB_RECOVERING, JobRecovery). A recoverable failure report on a READY job with a recovery
// deadline starts epoch E + 1: the job turns RECOVERING, its daemons learn it from the report's
// answer or their next heartbeat, and each says ReportRecovered once its ranks re-attached. The
// last of the job's nodes to say so makes the job READY again. The recovery ends DEGRADED when
// its deadline passes first (checked by the ticker and by the heartbeats of the job's nodes), when
// another failure is reported during it, or when a node of the job is lost (DegradeJobsOn).
//
// A job with redundancy (JobOptions.redundancy, issue 55) survives a lost node: the node's loss
// (its heartbeats stopped) starts a recovery as a report does, or names the node in the one in
// progress (JobRecovery.lost_node_id); a replacement daemon with the same node id rebuilds the
// node's state from the other nodes and says ReportRecovered with `replacement`, which counts the
// node and the bytes it rebuilt. A second node lost during the rebuild ends it DEGRADED.
//
// A job that shrinks on a node's loss (JobOptions.on_node_loss "shrink") recovers from a lost
// node the same way, with or without redundancy; if the deadline passes with the node not back,
// it shrinks to its other nodes' ranks (service_shrink.cc) rather than ending DEGRADED, and a
// second node lost meanwhile is lost with it.
#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "engine/redundancy.h"
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
    if (ShrinksOnNodeLoss(job) && !job.recovery().lost_node_id().empty()) {
      // A survivor's daemon giving up on the lost node (its data plane cannot connect without
      // it): the deadline decides, and a shrink goes on without the lost node.
      LOG(INFO) << "job " << job.job_id() << ": during the recovery of epoch "
                << job.recovery_epoch() << ", awaiting node '" << job.recovery().lost_node_id()
                << "' or the shrink: " << ReportText(req);
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
  StartRecovery(
      js, req.message().empty() ? req.lost_peer() : req.message(), req.reporter_node_id(), "", now,
      absl::StrCat("recovering in place (epoch ", job.recovery_epoch() + 1, ") from ",
                   ReportText(req), "; its ranks re-attach within ", Seconds(deadline_ms), " s"),
      deferred);
  resp->set_recovery_epoch(job.recovery().epoch());
  resp->set_recovery_deadline_unix_ms(job.recovery().deadline_unix_ms());
  return true;
}

void PlannerService::StartRecovery(JobState* js, const std::string& lost,
                                   const std::string& reporter, const std::string& lost_node_id,
                                   int64_t now_ms, const std::string& error, Deferred* deferred) {
  v1::Job& job = js->job;
  if (absl::Status s = JobStatusMachine::Move(&job, v1::JOB_RECOVERING); !s.ok()) {
    LOG(ERROR) << s;
    return;
  }
  job.set_recovery_epoch(job.recovery_epoch() + 1);
  v1::JobRecovery& r = *job.mutable_recovery();
  r.Clear();
  r.set_job_id(job.job_id());
  r.set_epoch(job.recovery_epoch());
  r.set_lost(lost);
  r.set_reporter_node_id(reporter);
  r.set_lost_node_id(lost_node_id);
  r.set_started_unix_ms(now_ms);
  r.set_deadline_unix_ms(now_ms + job.options().recovery_deadline_ms());
  job.set_error(error);
  LOG(WARNING) << "job " << job.job_id() << " RECOVERING: " << job.error();
  (void)JobChanged(js, deferred);
}

bool PlannerService::Rebuilds(const v1::Job& job) {
  if (job.options().recovery_deadline_ms() <= 0) return false;
  const auto r = ParseRedundancy("options.redundancy", job.options().redundancy());
  return r.ok() && r->enabled();
}

bool PlannerService::NodeLostRecovery(JobState* js, const std::string& node_id,
                                      const std::string& lost, Deferred* deferred) {
  v1::Job& job = js->job;
  const bool rebuilds = Rebuilds(job), shrinks = ShrinksOnNodeLoss(job);
  if ((!rebuilds && !shrinks) || job.status() == v1::JOB_REGISTERING) return false;
  const int64_t now = NowMs();
  // A recovery past its deadline ends as such first.
  ExpireRecovery(js, now, deferred);
  const std::string within = absl::StrCat(Seconds(job.options().recovery_deadline_ms()), " s");
  const std::string rebuilt_within =
      rebuilds ? absl::StrCat("a replacement daemon with node id '", node_id,
                              "' rebuilds it within ", within)
               : absl::StrCat("node '", node_id, "' comes back within ", within);
  const std::string or_shrinks =
      shrinks ? ", else the job shrinks to the ranks on its other nodes (on_node_loss shrink)" : "";
  if (job.status() == v1::JOB_READY) {
    const std::string redundancy =
        rebuilds ? absl::StrCat(" (redundancy ", job.options().redundancy(), ")") : "";
    StartRecovery(js, lost, "", node_id, now,
                  absl::StrCat("recovering in place (epoch ", job.recovery_epoch() + 1, ") from ",
                               lost, "; ", rebuilt_within, redundancy, or_shrinks),
                  deferred);
    return true;
  }
  if (job.status() != v1::JOB_RECOVERING) return true;  // it ended just now
  v1::JobRecovery& r = *job.mutable_recovery();
  auto* done = r.mutable_recovered_node_ids();
  if (!r.lost_node_id().empty() && r.lost_node_id() != node_id && shrinks) {
    // A job that shrinks loses this node too if it is not back by the deadline.
    done->erase(std::remove(done->begin(), done->end(), node_id), done->end());
    job.set_error(absl::StrCat(job.error(), "; ", lost, " too (after node '", r.lost_node_id(),
                               "'): the job shrinks without both unless they recover by the "
                               "deadline"));
    LOG(WARNING) << "job " << job.job_id() << " RECOVERING: " << job.error();
    (void)JobChanged(js, deferred);
    return true;
  }
  if (!r.lost_node_id().empty() && r.lost_node_id() != node_id) {
    EndRecovery(js, RecoveryOutcome::kNodeLost,
                absl::StrCat("a second node '", node_id, "' lost during the rebuild of node '",
                             r.lost_node_id(), "' (recovery epoch ", r.epoch(), ", from ", r.lost(),
                             "): ", lost, "; the job's redundancy (", job.options().redundancy(),
                             ") rebuilds one lost node at a time"),
                deferred);
    return true;
  }
  // The recovery was started by a report (a survivor's, naming its lost peer, or a lost rank's):
  // the node is now known lost, and only a replacement's report counts it as recovered, even if
  // it had recovered this epoch before.
  r.set_lost_node_id(node_id);
  done->erase(std::remove(done->begin(), done->end(), node_id), done->end());
  job.set_error(absl::StrCat("recovering in place (epoch ", r.epoch(), ") from ", r.lost(), "; ",
                             lost, ": ", rebuilt_within, " of the recovery's start", or_shrinks));
  LOG(WARNING) << "job " << job.job_id() << " RECOVERING: " << job.error();
  (void)JobChanged(js, deferred);
  return true;
}

void PlannerService::EndRecovery(JobState* js, RecoveryOutcome outcome, const std::string& error,
                                 Deferred* deferred) {
  if (absl::Status s = JobStatusMachine::Move(&js->job, v1::JOB_DEGRADED); !s.ok()) {
    LOG(ERROR) << s;
    return;
  }
  js->job.set_error(error);
  metrics_.RecoveryEnded(outcome, 0);
  LOG(WARNING) << "job " << js->job.job_id() << " DEGRADED: " << error;
  (void)JobChanged(js, deferred);
}

void PlannerService::ExpireRecovery(JobState* js, int64_t now_ms, Deferred* deferred) {
  const v1::Job& job = js->job;
  if (job.status() != v1::JOB_RECOVERING || job.recovery().deadline_unix_ms() > now_ms) return;
  const v1::JobRecovery& r = job.recovery();
  std::vector<std::string> missing = NotRecovered(JobNodes(js), r);
  // A job that shrinks does so without the lost node and every other node that did not recover
  // and is not UP; a node UP that did not recover (its ranks could not re-attach: the lost node's
  // data plane is gone) holds survivors.
  std::set<std::string> gone;
  for (const std::string& node : missing) {
    if (node == r.lost_node_id() || !nodes_.Up(node)) gone.insert(node);
  }
  const std::string within = Seconds(r.deadline_unix_ms() - r.started_unix_ms());
  std::vector<std::string> why;
  const auto lost_node = std::find(missing.begin(), missing.end(), r.lost_node_id());
  const bool lost = !r.lost_node_id().empty() && lost_node != missing.end();
  if (lost) {
    why.push_back(
        absl::StrCat("node '", r.lost_node_id(), "' was lost and ",
                     Rebuilds(job) ? "no replacement daemon rebuilt it" : "did not come back",
                     " within ", within, " s"));
    missing.erase(lost_node);
  }
  if (!missing.empty()) {
    const bool one = missing.size() == 1;
    why.push_back(absl::StrCat(one ? "node " : "nodes ", NodeNames(missing), one ? " has" : " have",
                               " not recovered (", one ? "its" : "their",
                               " ranks did not re-attach within ", within, " s)"));
  }
  std::string error = absl::StrCat("the recovery of epoch ", r.epoch(), " (from ", r.lost(),
                                   ") missed its deadline: ", absl::StrJoin(why, "; "));
  if (lost && ShrinksOnNodeLoss(job)) {
    // What the shrink is for: the nodes it goes on without (a node UP that did not recover goes
    // on).
    std::vector<std::string> lost_why = {why.front()};
    for (const std::string& node : gone) {
      if (node != r.lost_node_id()) {
        lost_why.push_back(absl::StrCat("node '", node, "' was lost too and did not come back"));
      }
    }
    const absl::Status shrunk = Shrink(js, gone, absl::StrJoin(lost_why, "; "), deferred);
    if (shrunk.ok()) return;
    absl::StrAppend(&error, "; it cannot shrink: ", shrunk.message());
  }
  EndRecovery(js, RecoveryOutcome::kDeadline, error, deferred);
}

absl::Status PlannerService::CountReplacement(JobState* js, const v1::ReportRecoveredRequest& req,
                                              bool counted, Deferred* deferred) {
  v1::Job& job = js->job;
  v1::JobRecovery& r = *job.mutable_recovery();
  const std::string& node = req.node_id();
  if (!req.replacement()) {
    // The lost node's own daemon came back with its state (its heartbeats had only stalled):
    // nothing was rebuilt.
    if (r.lost_node_id() == node) {
      LOG(INFO) << "job " << job.job_id() << ": node " << node
                << ", lost, recovered with its state; nothing rebuilt";
      r.clear_lost_node_id();
    }
    return absl::OkStatus();
  }
  std::string error;
  if (!Rebuilds(job)) {
    error = absl::StrCat("node '", node, "' was replaced during the recovery of epoch ", r.epoch(),
                         " (from ", r.lost(), "), but job '", job.job_id(),
                         "' has no redundancy to rebuild its state from (options.redundancy '",
                         job.options().redundancy(), "')");
  } else if (!r.lost_node_id().empty() && r.lost_node_id() != node) {
    error = absl::StrCat("a second node '", node, "' lost during the rebuild of node '",
                         r.lost_node_id(), "' (recovery epoch ", r.epoch(), ", from ", r.lost(),
                         "): a replacement daemon for it reported; the job's redundancy (",
                         job.options().redundancy(), ") rebuilds one lost node at a time");
  }
  if (!error.empty()) {
    EndRecovery(js, RecoveryOutcome::kNodeLost, error, deferred);
    return absl::FailedPreconditionError(error);
  }
  // A replacement that came up before the planner saw the node's heartbeats stop: its report
  // names the lost node.
  r.set_lost_node_id(node);
  if (!counted) r.set_rebuilt_bytes(req.rebuilt_bytes());
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* PlannerService::ReportRecovered(Ctx* ctx,
                                                          const v1::ReportRecoveredRequest* req,
                                                          v1::ReportRecoveredResponse* resp) {
  return OnJob(
      ctx, Access::kUser, *req, ValidateReportRecovered,
      [&](JobState& js, Deferred* deferred) -> absl::Status {
        v1::Job& job = js.job;
        const int64_t now = NowMs();
        ExpireRecovery(&js, now, deferred);
        // A survivor's daemon goes on with the successor (just now, if the deadline passed).
        if (job.status() == v1::JOB_SHRUNK) return absl::FailedPreconditionError(ShrunkText(js));
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
        RAGSHARD_RETURN_IF_ERROR(CountReplacement(&js, *req, counted, deferred));
        v1::JobRecovery& r = *job.mutable_recovery();
        if (!counted) r.add_recovered_node_ids(req->node_id());
        if (NotRecovered(nodes, r).empty()) {
          r.set_finished_unix_ms(now);
          const double seconds = static_cast<double>(now - r.started_unix_ms()) / 1000.0;
          RAGSHARD_RETURN_IF_ERROR(JobStatusMachine::Move(&job, v1::JOB_READY));
          job.clear_error();
          job.set_recoveries(job.recoveries() + 1);
          job.set_recovery_seconds(job.recovery_seconds() + seconds);
          metrics_.RecoveryEnded(RecoveryOutcome::kRecovered, seconds);
          if (!r.lost_node_id().empty()) {
            job.set_rebuilds(job.rebuilds() + 1);
            job.set_rebuilt_bytes(job.rebuilt_bytes() + r.rebuilt_bytes());
            metrics_.NodeRebuilt(r.rebuilt_bytes());
          }
          LOG(INFO) << "job " << job.job_id() << " READY: recovered epoch " << r.epoch() << " in "
                    << seconds << " s (" << r.lost() << ")"
                    << (r.lost_node_id().empty()
                            ? ""
                            : absl::StrCat("; node '", r.lost_node_id(), "' rebuilt, ",
                                           r.rebuilt_bytes(), " bytes"));
        }
        // Each node's recovery is stored: a planner restarted meanwhile goes on counting.
        RAGSHARD_RETURN_IF_ERROR(JobChanged(&js, deferred));
        resp->set_status(job.status());
        return absl::OkStatus();
      });
}

}  // namespace ragshard::planner
