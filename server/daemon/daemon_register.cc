// NodeDaemon's registrations: a rank registers with the planner through its daemon, which sends
// the node's ranks in one RegisterNodeRanks call (node_registration.h, docs/daemon.md).
#include <algorithm>
#include <memory>
#include <utility>

#include "infra/rpc.h"
#include "server/daemon/daemon.h"

namespace ragshard::daemon {

grpc::ServerUnaryReactor* NodeDaemon::Register(Ctx* ctx, const v1::RegisterRequest* req,
                                               v1::RegisterResponse* resp) {
  if (absl::Status fenced = lease_.Fenced(); !fenced.ok()) return ReplyUnary(ctx, fenced);
  auto* reactor = ctx->DefaultReactor();
  // The wait for the node's other ranks: the rank's, at most a day (as the rank's own timeout).
  const int64_t wait_ms = std::clamp<int64_t>(req->timeout_ms() > 0 ? req->timeout_ms() : 60000, 1,
                                              int64_t{86400} * 1000);
  auto batches =
      registrations_.Add(*req, absl::Now() + absl::Milliseconds(wait_ms),
                         [reactor, resp, metrics = metrics_](const absl::StatusOr<v1::Job>& job) {
                           if (job.ok()) {
                             *resp->mutable_job() = *job;
                           } else {
                             metrics->Error(job.status());
                           }
                           reactor->Finish(ToGrpcStatus(job.status()));
                         });
  if (!batches.ok()) {
    metrics_->Error(batches.status());
    reactor->Finish(ToGrpcStatus(batches.status()));
    return reactor;
  }
  SendRegistrations(std::move(*batches));
  return reactor;
}

void NodeDaemon::SendRegistrations(std::vector<NodeRegistrationBatch> batches) {
  for (auto& b : batches) {
    auto batch = std::make_shared<NodeRegistrationBatch>(std::move(b));
    const absl::Status s =
        Spawn([planner = planner_, batch] { SendNodeRegistration(*planner, *batch); });
    if (!s.ok()) {
      for (auto& done : batch->waiters) done(s);
    }
  }
}

}  // namespace ragshard::daemon
