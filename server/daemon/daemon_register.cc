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
  auto* reactor = ctx->DefaultReactor();
  // The wait for the node's other ranks: the rank's, at most a day (as the rank's own timeout).
  const int64_t wait_ms = std::clamp<int64_t>(req->timeout_ms() > 0 ? req->timeout_ms() : 60000, 1,
                                              int64_t{86400} * 1000);
  const absl::Time deadline = absl::Now() + absl::Milliseconds(wait_ms);
  if (lease_.Fenced().ok()) {
    StartRegistration(*req, resp, reactor, deadline);
    return reactor;
  }
  // Fenced: the rank waits for the fence to end (a short partition) on a thread of its own.
  const absl::Status s = Spawn([this, req, resp, reactor, deadline] {
    if (absl::Status fenced = lease_.AwaitUnfenced(deadline); !fenced.ok()) {
      metrics_->Error(fenced);
      reactor->Finish(ToGrpcStatus(fenced));
      return;
    }
    StartRegistration(*req, resp, reactor, deadline);
  });
  if (!s.ok()) reactor->Finish(ToGrpcStatus(s));
  return reactor;
}

void NodeDaemon::StartRegistration(const v1::RegisterRequest& req, v1::RegisterResponse* resp,
                                   grpc::ServerUnaryReactor* reactor, absl::Time deadline) {
  auto batches = registrations_.Add(
      req, deadline, [reactor, resp, metrics = metrics_](const absl::StatusOr<v1::Job>& job) {
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
    return;
  }
  SendRegistrations(std::move(*batches));
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
