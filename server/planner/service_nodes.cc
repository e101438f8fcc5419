#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "infra/rpc.h"
#include "infra/status_macros.h"
#include "server/planner/service.h"

namespace ragshard::planner {

grpc::ServerUnaryReactor* PlannerService::RegisterNode(Ctx* ctx, const v1::RegisterNodeRequest* req,
                                                       v1::RegisterNodeResponse* resp) {
  return Unlocked(
      ctx, Access::kUser, [&] { return ValidateRegisterNode(*req, options_.limits); },
      [&](Deferred* deferred) {
        resp->set_heartbeat_interval_ms(options_.heartbeat_interval.count());
        RAGSHARD_ASSIGN_OR_RETURN(const std::string lost, nodes_.Register(*req, NowMs()));
        // The daemon before is lost (as at the node timeout): its jobs recover with the new one
        // as the replacement, shrink or fail, named.
        if (!lost.empty()) DegradeJobsOn({req->node_id()}, deferred, lost);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* PlannerService::Heartbeat(Ctx* ctx, const v1::HeartbeatRequest* req,
                                                    v1::HeartbeatResponse* resp) {
  return Unlocked(
      ctx, Access::kUser, [&] { return ValidateHeartbeat(*req, options_.limits); },
      [&](Deferred* deferred) { return Beat(*req, resp, deferred); });
}

grpc::ServerBidiReactor<v1::HeartbeatRequest, v1::HeartbeatResponse>*
PlannerService::HeartbeatStream(Ctx* ctx) {
  // Admitted once, at the call: each heartbeat on it is validated and answered as a unary one.
  return beat_streams_.Open(Admit(ctx, Access::kUser, nullptr),
                            [this](const v1::HeartbeatRequest& req, v1::HeartbeatResponse* resp) {
                              RAGSHARD_RETURN_IF_ERROR(ValidateHeartbeat(req, options_.limits));
                              Deferred deferred;
                              absl::Status s = Beat(req, resp, &deferred);
                              RunDeferred(&deferred);
                              return s;
                            });
}

absl::Status PlannerService::Beat(const v1::HeartbeatRequest& req, v1::HeartbeatResponse* resp,
                                  Deferred* deferred) {
  RAGSHARD_RETURN_IF_ERROR(nodes_.Heartbeat(req, NowMs()));
  resp->set_lease_ms(LeaseMs(options_.node_timeout));
  const int64_t now_ms = NowMs();
  for (const std::string& job : req.jobs()) {
    EntryPtr e = Entry(job);
    if (e == nullptr) {
      resp->add_release_jobs(job);
      continue;
    }
    absl::MutexLock lock(&e->mu);
    // A recovery past its deadline ends here too, not only at the next tick.
    ExpireRecovery(&e->state, now_ms, deferred);
    const v1::Job& j = e->state.job;
    if (j.job_id().empty() || j.status() == v1::JOB_DELETED) {
      resp->add_release_jobs(job);
    } else if (j.status() == v1::JOB_DEGRADED || j.status() == v1::JOB_FAILED ||
               j.status() == v1::JOB_SHRUNK) {
      // A SHRUNK job's operations fail, naming its successor (its error); its buffers stay
      // until the successor's ranks took their state from them (they release them) or it
      // is deleted.
      v1::JobFailure* f = resp->add_failed_jobs();
      f->set_job_id(job);
      f->set_error(j.error());
    } else if (j.status() == v1::JOB_RECOVERING) {
      // Of the nodes recovered, only this one (if it is): every node of a large job
      // heartbeats, and the whole list in each answer would cost O(nodes^2) a round.
      const v1::JobRecovery& recovery = j.recovery();
      v1::JobRecovery* r = resp->add_recovering_jobs();
      r->set_job_id(job);
      r->set_epoch(recovery.epoch());
      r->set_lost(recovery.lost());
      r->set_reporter_node_id(recovery.reporter_node_id());
      r->set_lost_node_id(recovery.lost_node_id());
      r->set_started_unix_ms(recovery.started_unix_ms());
      r->set_deadline_unix_ms(recovery.deadline_unix_ms());
      for (const std::string& node : recovery.recovered_node_ids()) {
        if (node == req.node_id()) r->add_recovered_node_ids(node);
      }
    }
  }
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* PlannerService::ListNodes(Ctx* ctx, const v1::ListNodesRequest*,
                                                    v1::ListNodesResponse* resp) {
  return Unlocked(ctx, Access::kUser, nullptr, [&](Deferred*) {
    for (v1::Node& node : nodes_.List()) *resp->add_nodes() = std::move(node);
    return absl::OkStatus();
  });
}

void PlannerService::DegradeJobsOn(const std::vector<std::string>& lost_nodes, Deferred* deferred,
                                   const std::string& why) {
  if (lost_nodes.empty()) return;
  for (auto& [id, e] : Entries()) {
    absl::MutexLock lock(&e->mu);
    JobState& js = e->state;
    for (const std::string& node_id : lost_nodes) {
      const v1::JobStatus status = js.job.status();
      if (status != v1::JOB_READY && status != v1::JOB_REGISTERING &&
          status != v1::JOB_RECOVERING) {
        break;
      }
      bool has_rank = false;
      for (const auto& [rank, r] : js.ranks) has_rank |= r.node_id() == node_id;
      if (!has_rank) continue;
      const std::string lost = !why.empty()
                                   ? why
                                   : absl::StrCat("node '", node_id, "' lost (no heartbeat for ",
                                                  options_.node_timeout.count(), " ms)");
      // A job with redundancy rebuilds the node on a replacement daemon instead.
      if (NodeLostRecovery(&js, node_id, lost, deferred)) continue;
      if (status == v1::JOB_RECOVERING) {
        EndRecovery(&js, RecoveryOutcome::kNodeLost,
                    absl::StrCat(lost, " during the recovery of epoch ", js.job.recovery_epoch(),
                                 " (from ", js.job.recovery().lost(), ")"),
                    deferred);
        continue;
      }
      if (absl::Status s = JobStatusMachine::Move(&js.job, v1::JOB_DEGRADED); !s.ok()) {
        LOG(ERROR) << s;
        continue;
      }
      js.job.set_error(lost);
      (void)JobChanged(&js, deferred);
    }
  }
}

std::string PlannerService::ReportText(const v1::ReportFailureRequest& req) {
  // A daemon's message usually names the lost peer itself (the daemon's errors do).
  return absl::StrContains(req.message(), req.lost_peer())
             ? absl::StrCat("node '", req.reporter_node_id(), "' reports: ", req.message())
             : absl::StrCat("node '", req.reporter_node_id(), "' reports peer '", req.lost_peer(),
                            "' lost: ", req.message());
}

grpc::ServerUnaryReactor* PlannerService::ReportFailure(Ctx* ctx,
                                                        const v1::ReportFailureRequest* req,
                                                        v1::ReportFailureResponse* resp) {
  return OnJob(ctx, Access::kUser, *req, ValidateReportFailure,
               [&](JobState& js, Deferred* deferred) {
                 // A daemon another replaced (back from a partition, or woken) reports the
                 // connections it lost to the job's live daemons: nothing of it counts.
                 RAGSHARD_RETURN_IF_ERROR(
                     nodes_.CheckIncarnation(req->reporter_node_id(), req->reporter_incarnation()));
                 if (RecoveryReport(&js, *req, resp, deferred)) return absl::OkStatus();
                 // The first failure is the cause; the reports it provokes elsewhere do not replace
                 // it, nor do they undo a shrink (the failures of its survivors' last operations).
                 if (!JobStatusMachine::Terminal(js.job.status()) &&
                     js.job.status() != v1::JOB_DEGRADED && js.job.status() != v1::JOB_SHRUNK) {
                   RAGSHARD_RETURN_IF_ERROR(JobStatusMachine::Move(&js.job, v1::JOB_DEGRADED));
                   js.job.set_error(ReportText(*req));
                   LOG(WARNING) << "job " << req->job_id() << " DEGRADED: " << js.job.error();
                   (void)JobChanged(&js, deferred);
                 }
                 return absl::OkStatus();
               });
}

}  // namespace ragshard::planner
