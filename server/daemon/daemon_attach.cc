// NodeDaemon's attachments: a training process attaches for one rank of a job, and detaches (or
// dies, which the side channel notices).
#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "infra/ids.h"
#include "infra/rpc.h"
#include "protocol/pool_contract.h"
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
  if (absl::Status fenced = lease_.AwaitUnfenced(deadline); !fenced.ok()) return fenced;
  absl::StatusOr<std::shared_ptr<JobRuntime>> job =
      req->salvage() ? SalvagedJob(*req, deadline)
                     : GetOrCreateJob(req->job_id(), req->rank(), deadline);
  if (!job.ok()) return job.status();
  const auto& local = (*job)->local_ranks();
  auto it = std::find(local.begin(), local.end(), req->rank());
  if (it == local.end()) {
    return absl::FailedPreconditionError(absl::StrCat("rank ", req->rank(), " of job '",
                                                      req->job_id(), "' is not on node '",
                                                      options_.node_id, "'"));
  }
  const int li = static_cast<int>(it - local.begin());
  // A salvage attach is no process of the rank: the job's recovery does not count it.
  const JobRuntime::Joined joined = req->salvage() ? JobRuntime::Joined{} : (*job)->Rejoined(li);
  std::string id;
  {
    absl::MutexLock lock(&mu_);
    // A job released meanwhile (a shrink's survivors took it over, or the planner let it go):
    // no attachment to buffers going back to the pool.
    auto held = jobs_.find(req->job_id());
    if (held == jobs_.end() || held->second != *job) {
      return absl::NotFoundError(absl::StrCat("job '", req->job_id(), "' was released on node '",
                                              options_.node_id, "' while rank ", req->rank(),
                                              " attached"));
    }
    id = absl::StrCat("a", next_attachment_++, "-", req->job_id(), "-", req->rank());
    attachments_[id] = {req->job_id(), req->rank(), li, joined.generation, req->salvage()};
  }
  // In a recovery, the rank runs once every rank of the job has attached again.
  if (!req->salvage()) {
    if (absl::Status s = (*job)->AwaitRunning(deadline); !s.ok()) {
      ReleaseAttachment(id, /*clean=*/false);
      return s;
    }
  }
  resp->set_recovery_epoch((*job)->epoch());
  resp->set_adopted(joined.adopted);
  resp->set_recoverable((*job)->recoverable());
  resp->set_redundancy((*job)->redundancy());
  resp->set_replacement((*job)->replacement());
  resp->set_attachment_id(id);
  resp->set_arena_bytes(static_cast<int64_t>(pool_->arena().size()));
  *resp->mutable_plan() = (*job)->plan();
  (*job)->dp().Describe(li, (*job)->plan(), resp);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<JobRuntime>> NodeDaemon::SalvagedJob(const v1::AttachRequest& req,
                                                                    absl::Time deadline) {
  // A shrunk job's survivor (docs/recovery.md, "Shrinking in place") reads the state this
  // daemon holds: never a job set up anew (its buffers would be zeros), and only once the
  // planner has stopped it (its heartbeat's failed_jobs), so that nothing runs on the state.
  std::shared_ptr<JobRuntime> job = FindJob(req.job_id());
  const std::string what = absl::StrCat("a salvage attach of rank ", req.rank(), " of job '",
                                        req.job_id(), "' on node '", options_.node_id, "'");
  if (job == nullptr) {
    return absl::NotFoundError(
        absl::StrCat(what,
                     ": this daemon holds no state of the job (it was released, or the "
                     "daemon restarted since)"));
  }
  // A job the planner stops is failed by the next heartbeat; until then, or while its recovery
  // goes on, it waits (AwaitRunning returns once the job runs again or fails).
  (void)job->AwaitRunning(deadline);
  const absl::Status stopped = job->Stopped();
  if (stopped.ok() || absl::IsAborted(stopped)) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, ": ",
        stopped.ok() ? "the job can still run (only a job that cannot go on, a shrunk one, is "
                       "salvaged)"
                     : "the job's buffers were released"));
  }
  LOG(INFO) << what << " (" << stopped.message() << ")";
  return job;
}

void NodeDaemon::ReleaseAttachment(const std::string& id, bool clean) {
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
  if (job != nullptr && !a.salvage) job->LocalRankLeft(a.local, a.rank, a.generation, clean);
}

std::shared_ptr<JobRuntime> NodeDaemon::FindJob(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  return it == jobs_.end() ? nullptr : it->second;
}

std::shared_ptr<JobRuntime> NodeDaemon::TakeJob(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  auto entry = jobs_.extract(job_id);
  if (entry.empty()) return nullptr;
  for (auto a = attachments_.begin(); a != attachments_.end();) {
    if (a->second.job_id != job_id) {
      ++a;
      continue;
    }
    if (poller_ != nullptr) poller_->Remove(a->first);  // its waiters hear "released"
    a = attachments_.erase(a);
  }
  return std::move(entry.mapped());
}

void NodeDaemon::DropJob(const std::string& job_id, std::string_view why) {
  std::shared_ptr<JobRuntime> gone = TakeJob(job_id);
  if (gone == nullptr) return;
  gone.reset();  // joins the job thread and returns its buffers to the pool
  LOG(INFO) << "job " << job_id << " " << why << ": buffers released";
}

absl::Status NodeDaemon::ReleaseSalvaged(const std::string& id) {
  Attachment a;
  {
    absl::MutexLock lock(&mu_);
    auto it = attachments_.find(id);
    if (it == attachments_.end()) {
      return absl::NotFoundError(absl::StrCat("unknown attachment '", id, "'"));
    }
    a = it->second;
  }
  if (!a.salvage) {
    return absl::FailedPreconditionError(absl::StrCat(
        "attachment '", id, "' of rank ", a.rank, " of job '", a.job_id,
        "' is no salvage attachment: only a stopped job that a shrink's survivors took over is "
        "released this way"));
  }
  // Only a shrunk job's: the state of a job stopped otherwise (FAILED, DEGRADED) stays for
  // whoever reads it, until the planner deletes the job.
  auto job = planner_->GetJob(a.job_id);
  if (!job.ok()) return job.status();
  if (job->status() != v1::JOB_SHRUNK) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", a.job_id, "' is ", v1::JobStatus_Name(job->status()),
        ", not JOB_SHRUNK: only a shrunk job's buffers are released by its survivors"));
  }
  ReleaseAttachment(id, /*clean=*/true);
  // Joins the job's thread and data plane, and returns its buffers to the pool (the caller
  // runs on a thread of its own: Detach).
  DropJob(a.job_id, absl::StrCat("taken over by its shrink's survivors (rank ", a.rank,
                                 " on node '", options_.node_id, "')"));
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* NodeDaemon::Detach(Ctx* ctx, const v1::DetachRequest* req,
                                             v1::DetachResponse*) {
  if (req->release_salvaged()) {
    // The release asks the planner (which may take its retry window) and joins the job: on a
    // thread of its own, as an attach, rather than one of gRPC's callback threads.
    auto* reactor = ctx->DefaultReactor();
    const absl::Status s = Spawn([this, id = req->attachment_id(), reactor] {
      const absl::Status s = ReleaseSalvaged(id);
      // NOT_FOUND: another local rank's release took the job first (no error of the daemon's).
      if (!s.ok() && !absl::IsNotFound(s)) metrics_->Error(s);
      reactor->Finish(ToGrpcStatus(s));
    });
    if (!s.ok()) reactor->Finish(ToGrpcStatus(s));
    return reactor;
  }
  {
    absl::MutexLock lock(&mu_);
    if (attachments_.count(req->attachment_id()) == 0) {
      return ReplyUnary(ctx, absl::NotFoundError(
                                 absl::StrCat("unknown attachment '", req->attachment_id(), "'")));
    }
  }
  ReleaseAttachment(req->attachment_id(), /*clean=*/true);
  return ReplyUnary(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* NodeDaemon::StateBuffer(Ctx* ctx, const v1::StateBufferRequest* req,
                                                  v1::StateBufferResponse* resp) {
  const std::string& name = req->name();
  const bool name_ok =
      !name.empty() && name.size() <= 256 && std::all_of(name.begin(), name.end(), [](char c) {
        return absl::ascii_isalnum(static_cast<unsigned char>(c)) ||
               std::strchr("._:/-", c) != nullptr;
      });
  if (!name_ok) {
    return ReplyUnary(
        ctx, absl::InvalidArgumentError("name: must be 1 to 256 characters of [A-Za-z0-9._:/-]"));
  }
  if (req->bytes() <= 0 || req->bytes() > static_cast<int64_t>(pool_->arena().size())) {
    return ReplyUnary(ctx, absl::InvalidArgumentError(
                               absl::StrCat("bytes: ", req->bytes(), " is not in [1, ",
                                            pool_->arena().size(), "] (the pool's size)")));
  }
  int64_t rank = 0;
  bool salvage = false;
  {
    absl::MutexLock lock(&mu_);
    auto it = attachments_.find(req->attachment_id());
    if (it != attachments_.end()) {
      rank = it->second.rank;
      salvage = it->second.salvage;
    }
  }
  auto found = FindAttachment(req->attachment_id());
  if (!found.ok()) return ReplyUnary(ctx, found.status());
  // A salvage attachment's "copy/<step>/...": the state of another node that this node holds
  // whole (a shrink's re-cut, JobRuntime::ExposeCopy), made on the first ask.
  constexpr size_t kAfter = sizeof(pool::kCopy) - 1;
  if (int64_t step = 0;
      salvage && absl::StartsWith(name, pool::kCopy) &&
      absl::SimpleAtoi(name.substr(kAfter, name.find('/', kAfter) - kAfter), &step)) {
    if (absl::Status s = found->first->ExposeCopy(found->second, step, name, pool_.get());
        !s.ok()) {
      return ReplyUnary(ctx, s);
    }
  }
  auto b = found->first->StateBuffer(rank, found->second, name, req->bytes(), pool_.get());
  if (!b.ok()) return ReplyUnary(ctx, b.status());
  resp->set_offset(b->lease->offset());
  resp->set_bytes(req->bytes());
  resp->set_existed(b->existed);
  resp->set_rank_memory(b->rank_memory);
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
