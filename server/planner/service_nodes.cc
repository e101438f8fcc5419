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
      [&](Deferred*) {
        resp->set_heartbeat_interval_ms(options_.heartbeat_interval.count());
        return nodes_.Register(*req, NowMs());
      });
}

grpc::ServerUnaryReactor* PlannerService::Heartbeat(Ctx* ctx, const v1::HeartbeatRequest* req,
                                                    v1::HeartbeatResponse* resp) {
  return Unlocked(
      ctx, Access::kUser, [&] { return ValidateHeartbeat(*req, options_.limits); },
      [&](Deferred*) {
        RAGSHARD_RETURN_IF_ERROR(nodes_.Heartbeat(*req, NowMs()));
        for (const std::string& job : req->jobs()) {
          EntryPtr e = Entry(job);
          if (e == nullptr) {
            resp->add_release_jobs(job);
            continue;
          }
          absl::MutexLock lock(&e->mu);
          const v1::Job& j = e->state.job;
          if (j.job_id().empty() || j.status() == v1::JOB_DELETED) {
            resp->add_release_jobs(job);
          } else if (j.status() == v1::JOB_DEGRADED || j.status() == v1::JOB_FAILED) {
            v1::JobFailure* f = resp->add_failed_jobs();
            f->set_job_id(job);
            f->set_error(j.error());
          }
        }
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* PlannerService::ListNodes(Ctx* ctx, const v1::ListNodesRequest*,
                                                    v1::ListNodesResponse* resp) {
  return Unlocked(ctx, Access::kUser, nullptr, [&](Deferred*) {
    for (v1::Node& node : nodes_.List()) *resp->add_nodes() = std::move(node);
    return absl::OkStatus();
  });
}

void PlannerService::DegradeJobsOn(const std::vector<std::string>& lost_nodes, Deferred* deferred) {
  if (lost_nodes.empty()) return;
  for (auto& [id, e] : Entries()) {
    absl::MutexLock lock(&e->mu);
    JobState& js = e->state;
    for (const std::string& node_id : lost_nodes) {
      if (js.job.status() != v1::JOB_READY && js.job.status() != v1::JOB_REGISTERING) break;
      bool has_rank = false;
      for (const auto& [rank, r] : js.ranks) has_rank |= r.node_id() == node_id;
      if (!has_rank) continue;
      js.job.set_status(v1::JOB_DEGRADED);
      js.job.set_error(absl::StrCat("node '", node_id, "' lost (no heartbeat for ",
                                    options_.node_timeout.count(), " ms)"));
      (void)JobChanged(&js, deferred);
    }
  }
}

grpc::ServerUnaryReactor* PlannerService::ReportFailure(Ctx* ctx,
                                                        const v1::ReportFailureRequest* req,
                                                        v1::ReportFailureResponse*) {
  return OnJob(
      ctx, Access::kUser, req->job_id(),
      [&] { return ValidateReportFailure(*req, options_.limits); },
      [&](JobState& js, Deferred* deferred) {
        // The first failure is the cause; the reports it provokes elsewhere do not replace it.
        if (!Terminal(js.job.status()) && js.job.status() != v1::JOB_DEGRADED) {
          js.job.set_status(v1::JOB_DEGRADED);
          // A daemon's message usually names the lost peer itself (the daemon's errors do).
          js.job.set_error(
              absl::StrContains(req->message(), req->lost_peer())
                  ? absl::StrCat("node '", req->reporter_node_id(), "' reports: ", req->message())
                  : absl::StrCat("node '", req->reporter_node_id(), "' reports peer '",
                                 req->lost_peer(), "' lost: ", req->message()));
          LOG(WARNING) << "job " << req->job_id() << " DEGRADED: " << js.job.error();
          (void)JobChanged(&js, deferred);
        }
        return absl::OkStatus();
      });
}

}  // namespace ragshard::planner
