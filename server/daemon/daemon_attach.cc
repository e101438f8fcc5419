// NodeDaemon's attachments: a training process attaches for one rank of a job, and detaches (or
// dies, which the side channel notices).
#include <utility>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "infra/ids.h"
#include "infra/rpc.h"
#include "server/daemon/daemon.h"
#include "server/daemon/job_runtime.h"

namespace ragshard::daemon {

grpc::ServerUnaryReactor* NodeDaemon::Attach(Ctx* ctx, const v1::AttachRequest* req,
                                             v1::AttachResponse* resp) {
  if (auto s = ValidateId("job_id", req->job_id()); !s.ok()) return ReplyUnary(ctx, s);
  if (req->rank() < 0)
    return ReplyUnary(ctx, absl::InvalidArgumentError("rank: must not be negative"));
  // Setting a job up waits for the plan and for the peers, so it runs on a thread of its own
  // rather than blocking one of gRPC's callback threads.
  auto* reactor = ctx->DefaultReactor();
  const absl::Status s = Spawn([this, req, resp, reactor] {
    const absl::Status s = DoAttach(*req, resp);
    if (!s.ok()) metrics_->Error(s);
    reactor->Finish(ToGrpcStatus(s));
  });
  if (!s.ok()) reactor->Finish(ToGrpcStatus(s));
  return reactor;
}

absl::Status NodeDaemon::Spawn(std::function<void()> work) {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return absl::UnavailableError("daemon shutting down");
  // Join the threads that have finished (they only return after setting `done`).
  for (auto it = attach_threads_.begin(); it != attach_threads_.end();) {
    if (it->done->load()) {
      it->thread.join();
      it = attach_threads_.erase(it);
    } else {
      ++it;
    }
  }
  if (attach_threads_.size() >= kMaxAttaching) {
    return absl::ResourceExhaustedError(absl::StrCat(
        attach_threads_.size(), " attaches and registrations are in progress on node '",
        options_.node_id, "', the most it runs at once; retry"));
  }
  auto done = std::make_shared<std::atomic<bool>>(false);
  attach_threads_.push_back({std::thread([work = std::move(work), done] {
                               work();
                               done->store(true);
                             }),
                             done});
  return absl::OkStatus();
}

absl::Status NodeDaemon::DoAttach(const v1::AttachRequest& request, v1::AttachResponse* resp) {
  const v1::AttachRequest* req = &request;
  const absl::Time deadline =
      absl::Now() + absl::Milliseconds(req->timeout_ms() > 0 ? req->timeout_ms() : 60000);
  auto job = GetOrCreateJob(req->job_id(), req->rank(), deadline);
  if (!job.ok()) return job.status();
  const auto& local = (*job)->local_ranks();
  auto it = std::find(local.begin(), local.end(), req->rank());
  if (it == local.end()) {
    return absl::FailedPreconditionError(absl::StrCat("rank ", req->rank(), " of job '",
                                                      req->job_id(), "' is not on node '",
                                                      options_.node_id, "'"));
  }
  const int li = static_cast<int>(it - local.begin());
  (*job)->Rejoined(li);
  std::string id;
  {
    absl::MutexLock lock(&mu_);
    id = absl::StrCat("a", next_attachment_++, "-", req->job_id(), "-", req->rank());
    attachments_[id] = {req->job_id(), req->rank(), li};
  }
  resp->set_attachment_id(id);
  resp->set_arena_bytes(static_cast<int64_t>(pool_->arena().size()));
  *resp->mutable_plan() = (*job)->plan();
  (*job)->dp().Describe(li, (*job)->plan(), resp);
  return absl::OkStatus();
}

void NodeDaemon::ReleaseAttachment(const std::string& id) {
  std::shared_ptr<JobRuntime> job;
  Attachment a;
  {
    absl::MutexLock lock(&mu_);
    auto it = attachments_.find(id);
    if (it == attachments_.end()) return;
    LOG(INFO) << "attachment " << id << " released";
    a = it->second;
    attachments_.erase(it);
    auto j = jobs_.find(a.job_id);
    if (j != jobs_.end()) job = j->second;
  }
  if (poller_ != nullptr) poller_->Remove(id);
  if (job != nullptr) job->LocalRankLeft(a.local, a.rank);
}

grpc::ServerUnaryReactor* NodeDaemon::Detach(Ctx* ctx, const v1::DetachRequest* req,
                                             v1::DetachResponse*) {
  {
    absl::MutexLock lock(&mu_);
    if (attachments_.count(req->attachment_id()) == 0) {
      return ReplyUnary(ctx, absl::NotFoundError(
                                 absl::StrCat("unknown attachment '", req->attachment_id(), "'")));
    }
  }
  ReleaseAttachment(req->attachment_id());
  return ReplyUnary(ctx, absl::OkStatus());
}

absl::StatusOr<std::pair<std::shared_ptr<JobRuntime>, int>> NodeDaemon::FindAttachment(
    const std::string& id) const {
  absl::MutexLock lock(&mu_);
  auto it = attachments_.find(id);
  if (it == attachments_.end()) {
    return absl::NotFoundError(absl::StrCat("unknown attachment '", id, "'"));
  }
  auto j = jobs_.find(it->second.job_id);
  if (j == jobs_.end()) return absl::NotFoundError("the job was released");
  return std::make_pair(j->second, it->second.local);
}

}  // namespace ragshard::daemon
