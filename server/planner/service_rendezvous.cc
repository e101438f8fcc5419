#include <utility>

#include "absl/strings/str_cat.h"
#include "infra/rpc.h"
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
          if (g->job_id == req->job_id() && g->missing.erase(req->key()) > 0 &&
              g->missing.empty()) {
            g->answer(js.kv);
            Finish(deferred, g->parked.reactor, grpc::Status::OK);
            g = pending_gets_.erase(g);
          } else {
            ++g;
          }
        }
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* PlannerService::GetOrWait(
    Ctx* ctx, const std::string& job_id, const std::vector<std::string>& keys, int64_t wait_ms,
    std::function<void(const std::map<std::string, std::string>& kv)> answer) {
  absl::MutexLock lock(&mu_);
  auto job = FindJob(job_id);
  if (!job.ok()) return ReplyUnary(ctx, job.status());
  const auto& kv = (*job)->kv;
  PendingGet g;
  g.job_id = job_id;
  for (const std::string& key : keys) {
    if (!kv.count(key)) g.missing.insert(key);
  }
  if (g.missing.empty()) {
    answer(kv);
    return ReplyUnary(ctx, absl::OkStatus());
  }
  if (wait_ms == 0) {
    return ReplyUnary(
        ctx,
        absl::NotFoundError(absl::StrCat(
            "key '", *g.missing.begin(), "' of job '", job_id, "' not found",
            g.missing.size() > 1 ? absl::StrCat(" (nor ", g.missing.size() - 1, " more)") : "")));
  }
  g.answer = std::move(answer);
  g.parked.reactor = ctx->DefaultReactor();
  g.parked.deadline = Clock::now() + std::chrono::milliseconds(wait_ms);
  auto* reactor = g.parked.reactor;
  pending_gets_.push_back(std::move(g));
  return reactor;
}

grpc::ServerUnaryReactor* PlannerService::Get(Ctx* ctx, const v1::GetRequest* req,
                                              v1::GetResponse* resp) {
  absl::Status s = Admit(ctx, Access::kUser, [&] { return ValidateGet(*req, options_.limits); });
  if (!s.ok()) return ReplyUnary(ctx, s);
  return GetOrWait(ctx, req->job_id(), {req->key()}, req->wait_ms(),
                   [resp, key = req->key()](const std::map<std::string, std::string>& kv) {
                     resp->set_value(kv.at(key));
                   });
}

grpc::ServerUnaryReactor* PlannerService::GetKeys(Ctx* ctx, const v1::GetKeysRequest* req,
                                                  v1::GetKeysResponse* resp) {
  absl::Status s =
      Admit(ctx, Access::kUser, [&] { return ValidateGetKeys(*req, options_.limits); });
  if (!s.ok()) return ReplyUnary(ctx, s);
  std::vector<std::string> keys(req->keys().begin(), req->keys().end());
  return GetOrWait(ctx, req->job_id(), keys, req->wait_ms(),
                   [resp, keys](const std::map<std::string, std::string>& kv) {
                     for (const std::string& key : keys) resp->add_values(kv.at(key));
                   });
}

void PlannerService::ExpireGets(Clock::time_point now, Deferred* deferred) {
  for (auto g = pending_gets_.begin(); g != pending_gets_.end();) {
    if (g->parked.deadline <= now) {
      const std::string more =
          g->missing.size() > 1 ? absl::StrCat(" (nor ", g->missing.size() - 1, " more keys)") : "";
      Finish(deferred, g->parked.reactor,
             grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                          absl::StrCat("key '", *g->missing.begin(), "' of job '", g->job_id,
                                       "' was not put before the wait ended", more)));
      g = pending_gets_.erase(g);
    } else {
      ++g;
    }
  }
}

}  // namespace ragshard::planner
