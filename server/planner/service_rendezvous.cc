#include <utility>

#include "absl/strings/str_cat.h"
#include "common/rpc.h"
#include "server/planner/service.h"

namespace ragshard::planner {

grpc::ServerUnaryReactor* PlannerService::Put(Ctx* ctx, const v1::PutRequest* req,
                                              v1::PutResponse*) {
  return OnJob(
      ctx, Access::kUser, req->job_id(), [&] { return ValidatePut(*req, options_.limits); },
      [&](JobState& js, Deferred* deferred) {
        absl::Status s = store_->PutKv(req->job_id(), req->key(), req->value());
        if (!s.ok()) return s;
        js.kv[req->key()] = req->value();
        for (auto g = pending_gets_.begin(); g != pending_gets_.end();) {
          if (g->job_id == req->job_id() && g->key == req->key()) {
            g->resp->set_value(req->value());
            Finish(deferred, g->parked.reactor, grpc::Status::OK);
            g = pending_gets_.erase(g);
          } else {
            ++g;
          }
        }
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* PlannerService::Get(Ctx* ctx, const v1::GetRequest* req,
                                              v1::GetResponse* resp) {
  absl::Status s = Admit(ctx, Access::kUser, [&] { return ValidateGet(*req, options_.limits); });
  if (!s.ok()) return ReplyUnary(ctx, s);
  absl::MutexLock lock(&mu_);
  auto job = FindJob(req->job_id());
  if (!job.ok()) return ReplyUnary(ctx, job.status());
  auto kv = (*job)->kv.find(req->key());
  if (kv != (*job)->kv.end()) {
    resp->set_value(kv->second);
    return ReplyUnary(ctx, absl::OkStatus());
  }
  if (req->wait_ms() == 0) {
    return ReplyUnary(ctx, absl::NotFoundError(absl::StrCat("key '", req->key(), "' of job '",
                                                            req->job_id(), "' not found")));
  }
  PendingGet g;
  g.job_id = req->job_id();
  g.key = req->key();
  g.resp = resp;
  g.parked.reactor = ctx->DefaultReactor();
  g.parked.deadline = Clock::now() + std::chrono::milliseconds(req->wait_ms());
  auto* reactor = g.parked.reactor;
  pending_gets_.push_back(std::move(g));
  return reactor;
}

void PlannerService::ExpireGets(Clock::time_point now, Deferred* deferred) {
  for (auto g = pending_gets_.begin(); g != pending_gets_.end();) {
    if (g->parked.deadline <= now) {
      Finish(deferred, g->parked.reactor,
             grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                          absl::StrCat("key '", g->key, "' of job '", g->job_id,
                                       "' was not put before the wait ended")));
      g = pending_gets_.erase(g);
    } else {
      ++g;
    }
  }
}

}  // namespace ragshard::planner
