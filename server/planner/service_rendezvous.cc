#include <utility>

#include "absl/strings/str_cat.h"
#include "infra/rpc.h"
#include "server/planner/service.h"

namespace ragshard::planner {

grpc::ServerUnaryReactor* PlannerService::Put(Ctx* ctx, const v1::PutRequest* req,
                                              v1::PutResponse*) {
  return OnJob(ctx, Access::kUser, *req, ValidatePut, [&](JobState&, Deferred* deferred) {
    return rendezvous_.Put(req->job_id(), req->key(), req->value(), deferred);
  });
}

grpc::ServerUnaryReactor* PlannerService::GetOrWait(Ctx* ctx, const std::string& job_id,
                                                    const std::vector<std::string>& keys,
                                                    int64_t wait_ms,
                                                    const Rendezvous::Answer& answer) {
  // The call's one reactor, taken once: DefaultReactor() constructs it anew at every call, which
  // would drop a Finish that a Put, the job's deletion, the ticker or shutdown made after the call
  // parked and before this handler returned (the call was then never answered).
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  std::optional<absl::Status> answered;
  if (EntryPtr e = Entry(job_id); e == nullptr) {
    answered = LiveJob(job_id, nullptr).status();
  } else {
    // Under the job's lock: a job deleted meanwhile parks nothing.
    absl::MutexLock lock(&e->mu);
    auto job = LiveJob(job_id, &e->state);
    answered = job.ok() ? rendezvous_.Park(job_id, keys, wait_ms, reactor, answer) : job.status();
  }
  // Every key is there: the answer (every node's address, for a large job) is built outside the
  // job's lock, which the job's heartbeats and registrations take.
  if (answered && answered->ok()) answered = rendezvous_.Fill(job_id, keys, answer);
  if (answered) {
    reactor->Finish(ToGrpcStatus(*answered));
  } else if (options_.after_park) {
    options_.after_park(job_id);
  }
  // Parked: the reactor is finished by a Put, the job's deletion, the deadline or shutdown,
  // perhaps before this handler returns it (gRPC then finishes it once it is returned).
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

}  // namespace ragshard::planner
