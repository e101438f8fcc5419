#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "infra/rpc.h"
#include "server/planner/service.h"

namespace ragshard::planner {

grpc::ServerUnaryReactor* PlannerService::RegisterNode(Ctx* ctx, const v1::RegisterNodeRequest* req,
                                                       v1::RegisterNodeResponse* resp) {
  return Locked(
      ctx, Access::kUser, [&] { return ValidateRegisterNode(*req, options_.limits); },
      [&](Deferred*) {
        v1::Node& node = nodes_[req->node_id()];
        node.set_node_id(req->node_id());
        node.set_data_address(req->data_address());
        node.set_capacity_bytes(req->capacity_bytes());
        node.set_status(v1::NODE_UP);
        node.set_last_heartbeat_unix_ms(NowMs());
        resp->set_heartbeat_interval_ms(options_.heartbeat_interval.count());
        LOG(INFO) << "node " << req->node_id() << " registered at '" << req->data_address() << "'";
        return store_->PutNode(node);
      });
}

grpc::ServerUnaryReactor* PlannerService::Heartbeat(Ctx* ctx, const v1::HeartbeatRequest* req,
                                                    v1::HeartbeatResponse* resp) {
  return Locked(
      ctx, Access::kUser, [&] { return ValidateHeartbeat(*req, options_.limits); },
      [&](Deferred*) {
        auto it = nodes_.find(req->node_id());
        if (it == nodes_.end()) {
          return absl::NotFoundError(
              absl::StrCat("node '", req->node_id(), "' is not registered; call RegisterNode"));
        }
        v1::Node& node = it->second;
        *node.mutable_figures() = req->figures();
        node.set_last_heartbeat_unix_ms(NowMs());
        if (node.status() != v1::NODE_UP) {
          node.set_status(v1::NODE_UP);
          (void)store_->PutNode(node);
          LOG(INFO) << "node " << node.node_id() << " is back";
        }
        for (const std::string& job : req->jobs()) {
          auto j = jobs_.find(job);
          if (j == jobs_.end() || j->second.job.status() == v1::JOB_DELETED) {
            resp->add_release_jobs(job);
          } else if (j->second.job.status() == v1::JOB_DEGRADED ||
                     j->second.job.status() == v1::JOB_FAILED) {
            v1::JobFailure* f = resp->add_failed_jobs();
            f->set_job_id(job);
            f->set_error(j->second.job.error());
          }
        }
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* PlannerService::ListNodes(Ctx* ctx, const v1::ListNodesRequest*,
                                                    v1::ListNodesResponse* resp) {
  return Locked(ctx, Access::kUser, nullptr, [&](Deferred*) {
    for (const auto& [id, node] : nodes_) *resp->add_nodes() = node;
    return absl::OkStatus();
  });
}

void PlannerService::ExpireNodes(int64_t now_ms, Deferred* deferred) {
  for (auto& [node_id, node] : nodes_) {
    if (node.status() != v1::NODE_UP ||
        now_ms - node.last_heartbeat_unix_ms() <= options_.node_timeout.count()) {
      continue;
    }
    node.set_status(v1::NODE_LOST);
    (void)store_->PutNode(node);
    LOG(WARNING) << "node " << node_id << " LOST: no heartbeat for "
                 << now_ms - node.last_heartbeat_unix_ms() << " ms";
    for (auto& [id, js] : jobs_) {
      if (js.job.status() != v1::JOB_READY && js.job.status() != v1::JOB_REGISTERING) continue;
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
