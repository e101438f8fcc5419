#include <algorithm>
#include <memory>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "infra/rpc.h"
#include "infra/secrets.h"
#include "infra/status_macros.h"
#include "server/planner/service.h"

namespace ragshard::planner {

v1::Job PlannerService::NewJob(const v1::CreateJobRequest& req) const {
  v1::Job job;
  job.set_job_id(req.job_id());
  *job.mutable_mesh() = req.mesh();
  job.set_world_size(req.mesh().shard_size() * req.mesh().replicate_size());
  *job.mutable_options() = req.options();
  if (job.options().policy().empty()) job.mutable_options()->set_policy("ragged");
  if (job.options().align_bytes() == 0) job.mutable_options()->set_align_bytes(16);
  job.set_data_secret(RandomBytes(32));
  if (job.options().registration_timeout_ms() == 0) {
    job.mutable_options()->set_registration_timeout_ms(
        options_.default_registration_timeout.count());
  }
  CHECK(JobStatusMachine::Move(&job, v1::JOB_REGISTERING).ok());  // a new job
  job.set_created_unix_ms(NowMs());
  job.set_registration_deadline_unix_ms(job.created_unix_ms() +
                                        job.options().registration_timeout_ms());
  return job;
}

grpc::ServerUnaryReactor* PlannerService::CreateJob(Ctx* ctx, const v1::CreateJobRequest* req,
                                                    v1::CreateJobResponse* resp) {
  return Unlocked(
      ctx, Access::kUser, [&] { return ValidateCreateJob(*req, options_.limits); },
      [&](Deferred*) {
        if (shutdown_.load()) return absl::UnavailableError("planner shutting down");
        if (req->options().policy() == "auto" && options_.cluster_profile == nullptr) {
          return absl::FailedPreconditionError(
              "policy auto needs the planner started with --cluster-profile FILE");
        }
        EntryPtr e = Entry(req->job_id(), /*create=*/true);
        absl::MutexLock lock(&e->mu);
        JobState& old = e->state;
        const bool existed = !old.job.job_id().empty();
        if (existed && old.job.status() != v1::JOB_DELETED) {
          return absl::AlreadyExistsError(absl::StrCat("job '", req->job_id(), "' exists"));
        }
        JobState js;
        js.job = NewJob(*req);
        // A job of a deleted one's id starts clean, in the same transaction as its row.
        BeforeJobWrite(req->job_id());
        absl::Status s = store_->Atomically([&] {
          if (existed) RAGSHARD_RETURN_IF_ERROR(store_->PurgeJobData(req->job_id()));
          return store_->PutJob(js.job);
        });
        if (!s.ok()) return s;
        *resp->mutable_job() = Summary(js.job);
        LOG(INFO) << "job " << req->job_id() << " created: world " << js.job.world_size()
                  << ", policy " << js.job.options().policy();
        e->state = std::move(js);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* PlannerService::GetJob(Ctx* ctx, const v1::GetJobRequest* req,
                                                 v1::GetJobResponse* resp) {
  return OnJob(ctx, Access::kUser, req->job_id(), nullptr, [&](JobState& js, Deferred*) {
    *resp->mutable_job() = req->include_data_secret() ? js.job : Summary(js.job);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* PlannerService::ListJobs(Ctx* ctx, const v1::ListJobsRequest* req,
                                                   v1::ListJobsResponse* resp) {
  return Unlocked(
      ctx, Access::kUser, [&] { return ValidateListJobs(*req, options_.limits); },
      [&](Deferred*) {
        const int size = req->page_size() > 0 ? req->page_size() : kDefaultJobsPage;
        // The token is the last job id of the previous page.
        for (const auto& [id, e] : Entries(req->page_token())) {
          absl::MutexLock lock(&e->mu);
          const v1::Job& job = e->state.job;
          if (job.job_id().empty() || job.status() == v1::JOB_DELETED) continue;
          if (resp->jobs_size() == size) {
            resp->set_next_page_token(resp->jobs(size - 1).job_id());
            break;
          }
          v1::Job* out = resp->add_jobs();
          *out = Summary(job);
          // O(1) per job in a list: the count of the nodes recovered, not their names.
          v1::JobRecovery* r = out->mutable_recovery();
          r->set_recovered_nodes(r->recovered_node_ids_size());
          r->clear_recovered_node_ids();
        }
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* PlannerService::ListRanks(Ctx* ctx, const v1::ListRanksRequest* req,
                                                    v1::ListRanksResponse* resp) {
  return OnJob(ctx, Access::kUser, *req, ValidateListRanks, [&](JobState& js, Deferred*) {
    const int64_t world = js.job.world_size();
    if (req->start_rank() > world) {
      return absl::InvalidArgumentError(absl::StrCat("start_rank: ", req->start_rank(),
                                                     " is past the world size ", world, " of job '",
                                                     req->job_id(), "'"));
    }
    const int64_t size = req->page_size() > 0 ? req->page_size() : kDefaultRanksPage;
    const int64_t end = std::min(world, req->start_rank() + size);
    auto known = js.ranks.lower_bound(req->start_rank());
    for (int64_t r = req->start_rank(); r < end; ++r) {
      if (known != js.ranks.end() && known->first == r) {
        *resp->add_ranks() = (known++)->second;
      } else {
        resp->add_ranks()->set_rank(r);
      }
    }
    resp->set_next_start_rank(end);
    return absl::OkStatus();
  });
}

const v1::ListJobNodesResponse& PlannerService::JobNodes(JobState* js) {
  // Built once per change of the ranks: every daemon of a job asks for the same answer.
  if (!js->nodes) {
    v1::ListJobNodesResponse& out = js->nodes.emplace();
    std::map<std::string, int32_t> index;
    for (const auto& [rank, state] : js->ranks) {
      auto [it, fresh] = index.emplace(state.node_id(), out.node_ids_size());
      if (fresh) out.add_node_ids(state.node_id());
      const int n = out.run_node_size();
      if (n > 0 && out.run_node(n - 1) == it->second &&
          out.run_first(n - 1) + out.run_count(n - 1) == rank) {
        out.set_run_count(n - 1, out.run_count(n - 1) + 1);
      } else {
        out.add_run_node(it->second);
        out.add_run_first(rank);
        out.add_run_count(1);
      }
    }
  }
  return *js->nodes;
}

grpc::ServerUnaryReactor* PlannerService::ListJobNodes(Ctx* ctx, const v1::ListJobNodesRequest* req,
                                                       v1::ListJobNodesResponse* resp) {
  return OnJob(ctx, Access::kUser, req->job_id(), nullptr, [&](JobState& js, Deferred*) {
    *resp = JobNodes(&js);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* PlannerService::DeleteJob(Ctx* ctx, const v1::DeleteJobRequest* req,
                                                    v1::DeleteJobResponse*) {
  return OnJob(ctx, Access::kAdmin, req->job_id(), nullptr, [&](JobState& js, Deferred* deferred) {
    RAGSHARD_RETURN_IF_ERROR(JobStatusMachine::Move(&js.job, v1::JOB_DELETED));
    js.job.set_error("deleted");
    const grpc::Status aborted(grpc::StatusCode::ABORTED, "job deleted");
    for (PendingHash& p : js.pending_hash) FinishLater(deferred, p.parked.reactor, aborted);
    js.pending_hash.clear();
    rendezvous_.DropJob(req->job_id(), aborted, deferred);
    absl::Status s = JobChanged(&js, deferred);
    watchers_.CloseJob(req->job_id(), grpc::Status::OK, deferred);
    js.inventory.reset();
    js.plan.reset();
    js.plan_zstd.clear();
    js.plan_events = {};
    js.ranks.clear();
    js.nodes.reset();
    absl::Status purge = store_->PurgeJobData(req->job_id());
    LOG(INFO) << "job " << req->job_id() << " deleted";
    return s.ok() ? purge : s;
  });
}

grpc::ServerUnaryReactor* PlannerService::GetPlan(Ctx* ctx, const v1::GetPlanRequest* req,
                                                  v1::GetPlanResponse* resp) {
  return OnJob(ctx, Access::kUser, req->job_id(), nullptr, [&](JobState& js, Deferred*) {
    if (!js.plan) {
      return absl::FailedPreconditionError(absl::StrCat("job '", req->job_id(),
                                                        "' has no plan yet (status ",
                                                        v1::JobStatus_Name(js.job.status()), ")"));
    }
    *resp->mutable_plan() = *js.plan;
    return absl::OkStatus();
  });
}

grpc::Status PlannerService::AddWatcher(const v1::WatchPlanRequest& req,
                                        const std::shared_ptr<WatchChannel>& channel,
                                        WatchChannel::Event* first) {
  EntryPtr e = Entry(req.job_id());
  if (e == nullptr) return ToGrpcStatus(LiveJob(req.job_id(), nullptr).status());
  absl::MutexLock lock(&e->mu);
  auto job = LiveJob(req.job_id(), &e->state);
  if (!job.ok()) return ToGrpcStatus(job.status());
  JobState& js = **job;
  channel->zstd = req.accept_zstd();
  channel->sent_version = std::max(req.after_plan_version(), js.job.plan_version());
  // Added under the job's lock: no change of the job falls between its first event and the next.
  if (grpc::Status s = watchers_.Add(req.job_id(), channel); !s.ok()) return s;
  *first = js.plan && js.job.plan_version() > req.after_plan_version()
               ? PlanEvent(&js, req.accept_zstd())
               : ToBuffer(StatusEvent(js));
  return grpc::Status::OK;
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* PlannerService::WatchPlan(
    Ctx* ctx, const grpc::ByteBuffer* request) {
  auto* reactor = new WatchReactor();
  std::shared_ptr<WatchChannel> channel = reactor->channel();
  v1::WatchPlanRequest parsed;
  std::vector<grpc::Slice> slices;
  std::string bytes;
  if (request->Dump(&slices).ok()) {
    for (const auto& sl : slices)
      bytes.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  }
  if (!parsed.ParseFromString(bytes)) {
    channel->Close(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "malformed WatchPlanRequest"));
    return reactor;
  }
  const v1::WatchPlanRequest* req = &parsed;
  absl::Status s =
      Admit(ctx, Access::kUser, [&] { return ValidateJobId(req->job_id(), options_.limits); });
  if (!s.ok()) {
    channel->Close(ToGrpcStatus(s));
    return reactor;
  }
  WatchChannel::Event first;
  const grpc::Status close = AddWatcher(*req, channel, &first);
  if (!close.ok()) {
    channel->Close(close);
  } else {
    channel->Push(std::move(first));
  }
  return reactor;
}

}  // namespace ragshard::planner
