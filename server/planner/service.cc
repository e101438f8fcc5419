#include "server/planner/service.h"

#include <algorithm>
#include <deque>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/planner.h"
#include "common/proto_text.h"
#include "common/rpc.h"
#include "common/strategy.h"
#include "glog/logging.h"

namespace ragshard::planner {

// The state shared by a WatchPlan reactor and the service: a queue of events written one at a
// time. Push and Close are thread-safe; reactor calls are made outside the channel's mutex.
class WatchChannel {
 public:
  using Event = std::shared_ptr<const grpc::ByteBuffer>;

  explicit WatchChannel(grpc::ServerWriteReactor<grpc::ByteBuffer>* reactor) : reactor_(reactor) {}

  // The plan version this watcher was last sent; touched only under the service's mutex.
  uint64_t sent_version = 0;

  // Events are shared between watchers: a DeepSeek-V3 plan is several MB.
  void Push(Event event) {
    const grpc::ByteBuffer* start = nullptr;
    {
      absl::MutexLock lock(&mu_);
      if (closing_ || done_) return;
      queue_.push_back(std::move(event));
      if (!writing_) {
        writing_ = true;
        start = queue_.front().get();
      }
    }
    if (start != nullptr) reactor_->StartWrite(start);
  }

  // Finishes the stream with `status` once the queued events are written.
  void Close(const grpc::Status& status) {
    bool finish = false;
    {
      absl::MutexLock lock(&mu_);
      if (closing_ || done_) return;
      closing_ = true;
      status_ = status;
      finish = !writing_ && !finished_;
      if (finish) finished_ = true;
    }
    if (finish) reactor_->Finish(status);
  }

  void OnWriteDone(bool ok) {
    const grpc::ByteBuffer* next = nullptr;
    bool finish = false;
    grpc::Status status;
    {
      absl::MutexLock lock(&mu_);
      queue_.pop_front();
      if (!ok) {
        closing_ = true;
        abandoned_ = true;
        status_ = grpc::Status(grpc::StatusCode::UNAVAILABLE, "watch stream broken");
      }
      // A graceful Close still delivers what was queued before it (the final JOB_DELETED
      // event); a broken or cancelled stream drops it.
      if (!abandoned_ && !queue_.empty()) {
        next = queue_.front().get();
      } else {
        writing_ = false;
        if (closing_ && !finished_) {
          finished_ = true;
          finish = true;
          status = status_;
        }
      }
    }
    if (next != nullptr) reactor_->StartWrite(next);
    if (finish) reactor_->Finish(status);
  }

  void OnCancel() {
    {
      absl::MutexLock lock(&mu_);
      abandoned_ = true;
    }
    Close(grpc::Status(grpc::StatusCode::CANCELLED, "watch cancelled"));
  }

  void OnDone() {
    absl::MutexLock lock(&mu_);
    done_ = true;
  }

  bool done() const {
    absl::MutexLock lock(&mu_);
    return done_ || closing_;
  }

 private:
  grpc::ServerWriteReactor<grpc::ByteBuffer>* const reactor_;
  mutable absl::Mutex mu_;
  std::deque<Event> queue_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  bool abandoned_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status status_ ABSL_GUARDED_BY(mu_);
};

namespace {

class WatchReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  WatchReactor() : channel_(std::make_shared<WatchChannel>(this)) {}
  std::shared_ptr<WatchChannel> channel() const { return channel_; }
  void OnWriteDone(bool ok) override { channel_->OnWriteDone(ok); }
  void OnCancel() override { channel_->OnCancel(); }
  void OnDone() override {
    channel_->OnDone();
    delete this;
  }

 private:
  std::shared_ptr<WatchChannel> channel_;
};

bool ConstantTimeEqual(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

// Serializes once; copies of the buffer share its slices.
std::shared_ptr<const grpc::ByteBuffer> ToBuffer(const v1::WatchPlanEvent& event) {
  std::string bytes;
  event.SerializeToString(&bytes);
  grpc::Slice slice(std::move(bytes));
  return std::make_shared<const grpc::ByteBuffer>(&slice, 1);
}

bool Terminal(v1::JobStatus s) { return s == v1::JOB_FAILED || s == v1::JOB_DELETED; }

grpc::ServerUnaryReactor* Reply(grpc::CallbackServerContext* ctx, const absl::Status& s) {
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(s));
  return reactor;
}

absl::Status JobNotFound(const std::string& id) {
  return absl::NotFoundError(absl::StrCat("job '", id, "' not found"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<PlannerService>> PlannerService::Create(std::unique_ptr<Store> store,
                                                                       PlannerOptions options) {
  auto state = store->Load();
  if (!state.ok()) return state.status();
  std::unique_ptr<PlannerService> svc(new PlannerService(std::move(store), std::move(options)));
  {
    absl::MutexLock lock(&svc->mu_);
    for (v1::Job& job : state->jobs) {
      JobState& js = svc->jobs_[job.job_id()];
      js.job = std::move(job);
    }
    for (auto& [id, bytes] : state->inventories) {
      auto it = svc->jobs_.find(id);
      if (it == svc->jobs_.end()) continue;
      Inventory inv;
      if (!inv.ParseFromString(bytes))
        return absl::DataLossError("corrupt stored inventory of " + id);
      it->second.inventory = std::move(inv);
    }
    for (auto& [id, bytes] : state->plans) {
      auto it = svc->jobs_.find(id);
      if (it == svc->jobs_.end()) continue;
      v1::Plan plan;
      if (!plan.ParseFromString(bytes)) return absl::DataLossError("corrupt stored plan of " + id);
      it->second.plan = std::move(plan);
    }
    for (auto& kv : state->kv) {
      auto it = svc->jobs_.find(kv.job_id);
      if (it != svc->jobs_.end()) it->second.kv[kv.key] = kv.value;
    }
    // Nodes get a fresh heartbeat grace period after a restart.
    const int64_t now = NowMs();
    for (v1::Node& node : state->nodes) {
      node.set_last_heartbeat_unix_ms(now);
      svc->nodes_[node.node_id()] = std::move(node);
    }
    // A job whose ranks all registered but whose plan was not stored before a crash is planned
    // now; a stored plan is never recomputed.
    std::vector<std::string> replan;
    for (auto& [id, js] : svc->jobs_) {
      if (js.job.status() == v1::JOB_REGISTERING && !js.plan && js.inventory) replan.push_back(id);
    }
    Deferred deferred;
    for (const std::string& id : replan) svc->MaybePlan(id, &svc->jobs_[id], &deferred);
    LOG(INFO) << "planner state loaded: " << svc->jobs_.size() << " jobs, " << svc->nodes_.size()
              << " nodes";
  }
  svc->ticker_ = std::thread([s = svc.get()] { s->RunTicker(); });
  return svc;
}

PlannerService::PlannerService(std::unique_ptr<Store> store, PlannerOptions options)
    : options_(std::move(options)), store_(std::move(store)) {}

PlannerService::~PlannerService() {
  Shutdown();
  executor_.Stop();  // queued plans are dropped: their jobs are planned again at the next start
}

void PlannerService::Shutdown() {
  Deferred deferred;
  {
    absl::MutexLock lock(&mu_);
    if (shutdown_) return;
    shutdown_ = true;
    const grpc::Status unavailable(grpc::StatusCode::UNAVAILABLE, "planner shutting down");
    for (auto& [id, js] : jobs_) {
      for (PendingHash& p : js.pending_hash) Finish(&deferred, p.parked.reactor, unavailable);
      js.pending_hash.clear();
      for (auto& w : js.watchers) deferred.push_back([w, unavailable] { w->Close(unavailable); });
      js.watchers.clear();
    }
    for (PendingGet& g : pending_gets_) Finish(&deferred, g.parked.reactor, unavailable);
    pending_gets_.clear();
  }
  for (auto& f : deferred) f();
  stop_.Notify();
  if (ticker_.joinable()) ticker_.join();
}

int64_t PlannerService::NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now().time_since_epoch())
      .count();
}

void PlannerService::Finish(Deferred* deferred, grpc::ServerUnaryReactor* reactor,
                            grpc::Status status) {
  deferred->push_back([reactor, status] { reactor->Finish(status); });
}

absl::Status PlannerService::Authenticate(grpc::CallbackServerContext* ctx, bool admin) const {
  const std::string& need =
      admin && !options_.admin_token.empty() ? options_.admin_token : options_.token;
  if (need.empty()) return absl::OkStatus();
  const auto& md = ctx->client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) return absl::UnauthenticatedError("missing bearer token");
  const std::string got(it->second.data(), it->second.size());
  if (ConstantTimeEqual(got, "Bearer " + need)) return absl::OkStatus();
  if (admin && !options_.token.empty() && ConstantTimeEqual(got, "Bearer " + options_.token)) {
    return absl::PermissionDeniedError("this call needs the admin token");
  }
  return absl::UnauthenticatedError("invalid bearer token");
}

v1::WatchPlanEvent PlannerService::EventFor(const JobState& js, uint64_t after_version) const {
  v1::WatchPlanEvent ev;
  ev.set_status(js.job.status());
  ev.set_error(js.job.error());
  ev.set_plan_version(js.job.plan_version());
  if (js.plan && js.job.plan_version() > after_version) *ev.mutable_plan() = *js.plan;
  return ev;
}

absl::Status PlannerService::JobChanged(JobState* js, Deferred* deferred) {
  absl::Status s = store_->PutJob(js->job);
  if (!s.ok()) LOG(ERROR) << "store job " << js->job.job_id() << ": " << s;
  // Every watcher gets the new status; the plan itself only with a version it has not seen.
  std::vector<std::shared_ptr<WatchChannel>> live;
  for (auto& w : js->watchers) {
    if (!w->done()) live.push_back(w);
  }
  js->watchers = live;
  if (live.empty()) return s;
  if (js->notified_status == js->job.status() && js->notified_error == js->job.error() &&
      js->notified_version == js->job.plan_version()) {
    return s;  // nothing a watcher sees changed (e.g. one more rank registered)
  }
  js->notified_status = js->job.status();
  js->notified_error = js->job.error();
  js->notified_version = js->job.plan_version();
  WatchChannel::Event with_plan;
  const WatchChannel::Event without_plan = ToBuffer(EventFor(*js, ~uint64_t{0}));
  for (auto& w : live) {
    WatchChannel::Event ev = without_plan;
    if (w->sent_version < js->job.plan_version() && js->plan) {
      if (!with_plan) with_plan = ToBuffer(EventFor(*js, 0));
      ev = with_plan;
      w->sent_version = js->job.plan_version();
    }
    deferred->push_back([w, ev] { w->Push(ev); });
  }
  return s;
}

grpc::ServerUnaryReactor* PlannerService::CreateJob(grpc::CallbackServerContext* ctx,
                                                    const v1::CreateJobRequest* req,
                                                    v1::CreateJobResponse* resp) {
  absl::Status s = Authenticate(ctx, false);
  if (s.ok()) s = ValidateCreateJob(*req, options_.limits);
  if (!s.ok()) return Reply(ctx, s);
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(req->job_id());
  if (it != jobs_.end() && it->second.job.status() != v1::JOB_DELETED) {
    return Reply(ctx, absl::AlreadyExistsError(absl::StrCat("job '", req->job_id(), "' exists")));
  }
  if (req->options().policy() == "auto" && options_.cluster_profile == nullptr) {
    return Reply(ctx, absl::FailedPreconditionError(
                          "policy auto needs the planner started with --cluster-profile FILE"));
  }
  JobState js;
  v1::Job& job = js.job;
  job.set_job_id(req->job_id());
  *job.mutable_mesh() = req->mesh();
  job.set_world_size(req->mesh().shard_size() * req->mesh().replicate_size());
  *job.mutable_options() = req->options();
  if (job.options().policy().empty()) job.mutable_options()->set_policy("ragged");
  if (job.options().align_bytes() == 0) job.mutable_options()->set_align_bytes(16);
  if (job.options().registration_timeout_ms() == 0) {
    job.mutable_options()->set_registration_timeout_ms(
        options_.default_registration_timeout.count());
  }
  job.set_status(v1::JOB_REGISTERING);
  job.set_created_unix_ms(NowMs());
  job.set_registration_deadline_unix_ms(job.created_unix_ms() +
                                        job.options().registration_timeout_ms());
  for (int64_t r = 0; r < job.world_size(); ++r) job.add_ranks()->set_rank(r);
  s = store_->PutJob(job);
  if (!s.ok()) return Reply(ctx, s);
  if (it != jobs_.end()) (void)store_->PurgeJobData(req->job_id());
  *resp->mutable_job() = job;
  LOG(INFO) << "job " << req->job_id() << " created: world " << job.world_size() << ", policy "
            << job.options().policy();
  jobs_[req->job_id()] = std::move(js);
  return Reply(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* PlannerService::GetJob(grpc::CallbackServerContext* ctx,
                                                 const v1::GetJobRequest* req,
                                                 v1::GetJobResponse* resp) {
  absl::Status s = Authenticate(ctx, false);
  if (s.ok()) s = ValidateJobId(req->job_id(), options_.limits);
  if (!s.ok()) return Reply(ctx, s);
  absl::MutexLock lock(&mu_);
  JobState* job = LiveJob(req->job_id());
  if (job == nullptr) return Reply(ctx, JobNotFound(req->job_id()));
  *resp->mutable_job() = job->job;
  return Reply(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* PlannerService::ListJobs(grpc::CallbackServerContext* ctx,
                                                   const v1::ListJobsRequest*,
                                                   v1::ListJobsResponse* resp) {
  absl::Status s = Authenticate(ctx, false);
  if (!s.ok()) return Reply(ctx, s);
  absl::MutexLock lock(&mu_);
  for (const auto& [id, js] : jobs_) {
    if (js.job.status() != v1::JOB_DELETED) *resp->add_jobs() = js.job;
  }
  return Reply(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* PlannerService::DeleteJob(grpc::CallbackServerContext* ctx,
                                                    const v1::DeleteJobRequest* req,
                                                    v1::DeleteJobResponse*) {
  absl::Status s = Authenticate(ctx, /*admin=*/true);
  if (s.ok()) s = ValidateJobId(req->job_id(), options_.limits);
  if (!s.ok()) return Reply(ctx, s);
  Deferred deferred;
  {
    absl::MutexLock lock(&mu_);
    JobState* job = LiveJob(req->job_id());
    if (job == nullptr) return Reply(ctx, JobNotFound(req->job_id()));
    JobState& js = *job;
    js.job.set_status(v1::JOB_DELETED);
    js.job.set_error("deleted");
    const grpc::Status aborted(grpc::StatusCode::ABORTED, "job deleted");
    for (PendingHash& p : js.pending_hash) Finish(&deferred, p.parked.reactor, aborted);
    js.pending_hash.clear();
    for (auto g = pending_gets_.begin(); g != pending_gets_.end();) {
      if (g->job_id == req->job_id()) {
        Finish(&deferred, g->parked.reactor, aborted);
        g = pending_gets_.erase(g);
      } else {
        ++g;
      }
    }
    s = JobChanged(&js, &deferred);
    for (auto& w : js.watchers) deferred.push_back([w] { w->Close(grpc::Status::OK); });
    js.watchers.clear();
    js.inventory.reset();
    js.plan.reset();
    js.kv.clear();
    absl::Status purge = store_->PurgeJobData(req->job_id());
    if (s.ok()) s = purge;
    LOG(INFO) << "job " << req->job_id() << " deleted";
  }
  for (auto& f : deferred) f();
  return Reply(ctx, s);
}

void PlannerService::RegisterRankLocked(JobState* js, int64_t rank, const std::string& node,
                                        const std::string& sha) {
  v1::RankState* r = js->job.mutable_ranks(static_cast<int>(rank));
  r->set_registered(true);
  r->set_node_id(node);
  r->set_inventory_sha256(sha);
}

void PlannerService::FailJob(JobState* js, const std::string& error, Deferred* deferred) {
  js->job.set_status(v1::JOB_FAILED);
  js->job.set_error(error);
  LOG(WARNING) << "job " << js->job.job_id() << " failed: " << error;
  const grpc::Status failed(grpc::StatusCode::FAILED_PRECONDITION, error);
  for (PendingHash& p : js->pending_hash) Finish(deferred, p.parked.reactor, failed);
  js->pending_hash.clear();
  (void)JobChanged(js, deferred);
}

void PlannerService::ResolvePendingHashes(JobState* js, Deferred* deferred) {
  for (PendingHash& p : js->pending_hash) {
    grpc::Status status;
    if (p.sha256 == js->job.inventory_sha256()) {
      RegisterRankLocked(js, p.rank, p.node_id, p.sha256);
      status = grpc::Status::OK;
    } else {
      std::string error =
          absl::StrCat("rank ", p.rank, ": inventory hash ", HexString(p.sha256),
                       " differs from the reference ", HexString(js->job.inventory_sha256()));
      js->job.set_error(error);
      status = grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, error);
    }
    *p.job_out = js->job;
    Finish(deferred, p.parked.reactor, status);
  }
  js->pending_hash.clear();
}

void PlannerService::MaybePlan(const std::string& job_id, JobState* js, Deferred* deferred) {
  if (js->planning || js->plan || js->job.status() != v1::JOB_REGISTERING || !js->inventory) return;
  for (const auto& r : js->job.ranks()) {
    if (!r.registered()) return;
  }
  js->planning = true;
  executor_.Submit([this, job_id] { ComputePlan(job_id); });
}

void PlannerService::ComputePlan(std::string job_id) {
  Inventory inventory;
  PlanOptions options;
  v1::JobOptions job_options;
  std::vector<std::string> rank_nodes;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job_id);
    if (it == jobs_.end() || !it->second.inventory) return;
    const v1::Job& job = it->second.job;
    inventory = *it->second.inventory;
    job_options = job.options();
    for (const auto& r : job.ranks()) rank_nodes.push_back(r.node_id());
    if (job.options().policy() != "auto") options.policy = *ParsePolicy(job.options().policy());
    options.world = job.mesh().shard_size();
    options.align_bytes = job.options().align_bytes();
    options.job_id = job_id;
    options.version = job.plan_version() + 1;
    if (!job.options().default_granule().empty()) {
      auto g = *ParseGranule(job.options().default_granule());
      for (UnitSpec& unit : *inventory.mutable_units()) {
        for (TensorSpec& t : *unit.mutable_tensors()) {
          if (t.shape_size() >= 2 && t.granule_kind() == v1::GRANULE_ELEMENT) {
            t.set_granule_kind(g.kind);
            t.set_granule_rows(g.rows);
          }
        }
      }
    }
  }
  absl::StatusOr<v1::Plan> plan;
  int64_t shard = 0, replicate = 0;
  if (job_options.policy() == "auto") {
    auto a = PlanAutoForJob(inventory, job_options, rank_nodes, options);
    if (a.ok()) {
      shard = a->shard;
      replicate = a->replicate;
      plan = std::move(a->plan);
    } else {
      plan = a.status();
    }
  } else {
    plan = BuildPlan(inventory, options);
  }
  Deferred deferred;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) return;
    JobState& js = it->second;
    js.planning = false;
    if (js.job.status() != v1::JOB_REGISTERING) {
      // Deleted or failed while planning.
    } else if (!plan.ok()) {
      FailJob(&js, absl::StrCat("planning failed: ", plan.status().message()), &deferred);
    } else {
      const std::string bytes = DeterministicBytes(*plan);
      absl::Status s = store_->PutPlan(job_id, options.version, bytes);
      if (!s.ok()) {
        FailJob(&js, absl::StrCat("storing the plan failed: ", s.message()), &deferred);
      } else {
        js.plan = std::move(*plan);
        if (shard > 0) {
          // Policy auto chose the shard group: the mesh becomes replicate x shard.
          js.job.mutable_mesh()->set_shard_size(shard);
          js.job.mutable_mesh()->set_replicate_size(replicate);
          LOG(INFO) << "job " << job_id << " strategy " << js.plan->strategy().executed()
                    << " (recommended " << js.plan->strategy().recommended() << ", predicted "
                    << js.plan->strategy().predicted_step_seconds() << " s/step)";
        }
        js.job.set_plan_version(options.version);
        js.job.set_status(v1::JOB_READY);
        js.job.clear_error();
        (void)JobChanged(&js, &deferred);
        LOG(INFO) << "job " << job_id << " READY: plan v" << options.version << ", "
                  << js.plan->units_size() << " unit plans, padding "
                  << js.plan->metrics().padding_pct() << " %";
      }
    }
  }
  for (auto& f : deferred) f();
}

absl::StatusOr<AutoPlan> PlannerService::PlanAutoForJob(const Inventory& inventory,
                                                        const v1::JobOptions& o,
                                                        const std::vector<std::string>& rank_nodes,
                                                        const PlanOptions& options) const {
  // The data plane's shard groups are whole nodes of consecutive ranks: ranks must be numbered
  // node by node, the same number on every node.
  std::vector<std::string> nodes;
  for (const std::string& n : rank_nodes) {
    if (nodes.empty() || nodes.back() != n) nodes.push_back(n);
  }
  const int64_t world = static_cast<int64_t>(rank_nodes.size());
  const int64_t count = static_cast<int64_t>(nodes.size());
  std::set<std::string> distinct(nodes.begin(), nodes.end());
  if (static_cast<int64_t>(distinct.size()) != count || world % count != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "policy auto needs the same number of ranks on every node, numbered node by node; the "
        "ranks' nodes are ",
        absl::StrJoin(rank_nodes, ",")));
  }
  const int64_t per_node = world / count;
  for (int64_t r = 0; r < world; ++r) {
    if (rank_nodes[r] != nodes[r / per_node]) {
      return absl::FailedPreconditionError(
          absl::StrCat("policy auto needs ranks numbered node by node: rank ", r, " is on node '",
                       rank_nodes[r], "', expected '", nodes[r / per_node], "'"));
    }
  }
  CostOptions cost;
  if (!o.optimizer().empty()) cost.optimizer = *ParseOptimizerKind(o.optimizer());
  cost.memory_budget_bytes = o.memory_budget_bytes();
  if (o.tokens_per_step() > 0) cost.tokens_per_step = o.tokens_per_step();
  cost.align_bytes = options.align_bytes;
  return PlanAuto(inventory, "", *options_.cluster_profile, count, per_node, cost, o.strategy(),
                  options);
}

grpc::ServerUnaryReactor* PlannerService::RegisterRank(grpc::CallbackServerContext* ctx,
                                                       const v1::RegisterRankRequest* req,
                                                       v1::RegisterRankResponse* resp) {
  absl::Status s = Authenticate(ctx, false);
  if (s.ok()) s = ValidateRegisterRank(*req, options_.limits);
  if (!s.ok()) return Reply(ctx, s);
  // Hash outside the lock: a DeepSeek-V3 inventory is several MB.
  const bool full = req->has_inventory();
  const std::string sha = full ? InventorySha256(req->inventory()) : req->inventory_sha256();
  Deferred deferred;
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  grpc::Status result = grpc::Status::OK;
  bool parked = false;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(req->job_id());
    if (shutdown_) {
      result = grpc::Status(grpc::StatusCode::UNAVAILABLE, "planner shutting down");
    } else if (it == jobs_.end() || it->second.job.status() == v1::JOB_DELETED) {
      result = ToGrpcStatus(JobNotFound(req->job_id()));
    } else {
      JobState& js = it->second;
      v1::Job& job = js.job;
      if (req->rank() >= job.world_size()) {
        result = ToGrpcStatus(absl::InvalidArgumentError(
            absl::StrCat("rank: ", req->rank(), " is outside [0, ", job.world_size(), ") of job '",
                         job.job_id(), "'")));
      } else if (job.status() != v1::JOB_REGISTERING || js.planning) {
        // Registration is closed; an identical re-registration (a restarted rank) is fine.
        const v1::RankState& r = job.ranks(static_cast<int>(req->rank()));
        if (r.registered() && r.inventory_sha256() == sha && !Terminal(job.status())) {
          result = grpc::Status::OK;
        } else {
          result = grpc::Status(
              grpc::StatusCode::FAILED_PRECONDITION,
              absl::StrCat("job '", job.job_id(), "' is ", v1::JobStatus_Name(job.status()),
                           job.error().empty() ? "" : absl::StrCat(" (", job.error(), ")"),
                           "; registration is closed"));
        }
      } else if (!job.inventory_sha256().empty() && sha != job.inventory_sha256()) {
        std::string error;
        if (full && js.inventory) {
          error = absl::StrCat("rank ", req->rank(), ": inventory differs from the reference: ",
                               FirstInventoryDifference(*js.inventory, req->inventory()));
        } else {
          error = absl::StrCat("rank ", req->rank(), ": inventory hash ", HexString(sha),
                               " differs from the reference ", HexString(job.inventory_sha256()));
        }
        job.set_error(error);
        (void)JobChanged(&js, &deferred);
        result = grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, error);
      } else if (job.inventory_sha256().empty() && !full) {
        // Wait for the first full inventory (or the registration deadline).
        PendingHash p;
        p.rank = req->rank();
        p.node_id = req->node_id();
        p.sha256 = sha;
        p.job_out = resp->mutable_job();
        p.parked.reactor = reactor;
        js.pending_hash.push_back(std::move(p));
        parked = true;
      } else {
        if (job.inventory_sha256().empty()) {
          // The first full inventory becomes the reference.
          js.inventory = req->inventory();
          job.set_inventory_sha256(sha);
          s = store_->PutInventory(job.job_id(), DeterministicBytes(req->inventory()));
          if (!s.ok()) LOG(ERROR) << "store inventory: " << s;
          ResolvePendingHashes(&js, &deferred);
        }
        RegisterRankLocked(&js, req->rank(), req->node_id(), sha);
        (void)JobChanged(&js, &deferred);
        MaybePlan(job.job_id(), &js, &deferred);
      }
      *resp->mutable_job() = job;
    }
  }
  for (auto& f : deferred) f();
  if (!parked) reactor->Finish(result);
  return reactor;
}

grpc::ServerUnaryReactor* PlannerService::GetPlan(grpc::CallbackServerContext* ctx,
                                                  const v1::GetPlanRequest* req,
                                                  v1::GetPlanResponse* resp) {
  absl::Status s = Authenticate(ctx, false);
  if (s.ok()) s = ValidateJobId(req->job_id(), options_.limits);
  if (!s.ok()) return Reply(ctx, s);
  absl::MutexLock lock(&mu_);
  JobState* job = LiveJob(req->job_id());
  if (job == nullptr) return Reply(ctx, JobNotFound(req->job_id()));
  if (!job->plan) {
    return Reply(ctx, absl::FailedPreconditionError(
                          absl::StrCat("job '", req->job_id(), "' has no plan yet (status ",
                                       v1::JobStatus_Name(job->job.status()), ")")));
  }
  *resp->mutable_plan() = *job->plan;
  return Reply(ctx, absl::OkStatus());
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* PlannerService::WatchPlan(
    grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request) {
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
  absl::Status s = Authenticate(ctx, false);
  if (s.ok()) s = ValidateJobId(req->job_id(), options_.limits);
  if (!s.ok()) {
    channel->Close(ToGrpcStatus(s));
    return reactor;
  }
  WatchChannel::Event first;
  grpc::Status close = grpc::Status::OK;
  bool closing = false;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(req->job_id());
    if (shutdown_) {
      close = grpc::Status(grpc::StatusCode::UNAVAILABLE, "planner shutting down");
      closing = true;
    } else if (it == jobs_.end() || it->second.job.status() == v1::JOB_DELETED) {
      close = ToGrpcStatus(JobNotFound(req->job_id()));
      closing = true;
    } else {
      JobState& js = it->second;
      auto& w = js.watchers;
      w.erase(std::remove_if(w.begin(), w.end(), [](const auto& c) { return c->done(); }), w.end());
      watchers_ = 0;
      for (const auto& [id, other] : jobs_)
        watchers_ += static_cast<int64_t>(other.watchers.size());
      if (watchers_ >= options_.max_watchers) {
        close = grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "too many watchers");
        closing = true;
      } else {
        first = ToBuffer(EventFor(js, req->after_plan_version()));
        channel->sent_version = std::max(req->after_plan_version(), js.job.plan_version());
        w.push_back(channel);
      }
    }
  }
  if (closing) {
    channel->Close(close);
  } else {
    channel->Push(std::move(first));
  }
  return reactor;
}

grpc::ServerUnaryReactor* PlannerService::RegisterNode(grpc::CallbackServerContext* ctx,
                                                       const v1::RegisterNodeRequest* req,
                                                       v1::RegisterNodeResponse* resp) {
  absl::Status s = Authenticate(ctx, false);
  if (s.ok()) s = ValidateRegisterNode(*req, options_.limits);
  if (!s.ok()) return Reply(ctx, s);
  absl::MutexLock lock(&mu_);
  v1::Node& node = nodes_[req->node_id()];
  node.set_node_id(req->node_id());
  node.set_data_address(req->data_address());
  node.set_capacity_bytes(req->capacity_bytes());
  node.set_status(v1::NODE_UP);
  node.set_last_heartbeat_unix_ms(NowMs());
  s = store_->PutNode(node);
  resp->set_heartbeat_interval_ms(options_.heartbeat_interval.count());
  LOG(INFO) << "node " << req->node_id() << " registered at '" << req->data_address() << "'";
  return Reply(ctx, s);
}

grpc::ServerUnaryReactor* PlannerService::Heartbeat(grpc::CallbackServerContext* ctx,
                                                    const v1::HeartbeatRequest* req,
                                                    v1::HeartbeatResponse* resp) {
  absl::Status s = Authenticate(ctx, false);
  if (s.ok()) s = ValidateHeartbeat(*req, options_.limits);
  if (!s.ok()) return Reply(ctx, s);
  absl::MutexLock lock(&mu_);
  auto it = nodes_.find(req->node_id());
  if (it == nodes_.end()) {
    return Reply(ctx, absl::NotFoundError(absl::StrCat("node '", req->node_id(),
                                                       "' is not registered; call RegisterNode")));
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
    if (j == jobs_.end() || j->second.job.status() == v1::JOB_DELETED) resp->add_release_jobs(job);
  }
  return Reply(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* PlannerService::ListNodes(grpc::CallbackServerContext* ctx,
                                                    const v1::ListNodesRequest*,
                                                    v1::ListNodesResponse* resp) {
  absl::Status s = Authenticate(ctx, false);
  if (!s.ok()) return Reply(ctx, s);
  absl::MutexLock lock(&mu_);
  for (const auto& [id, node] : nodes_) *resp->add_nodes() = node;
  return Reply(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* PlannerService::Put(grpc::CallbackServerContext* ctx,
                                              const v1::PutRequest* req, v1::PutResponse*) {
  absl::Status s = Authenticate(ctx, false);
  if (s.ok()) s = ValidatePut(*req, options_.limits);
  if (!s.ok()) return Reply(ctx, s);
  Deferred deferred;
  {
    absl::MutexLock lock(&mu_);
    JobState* job = LiveJob(req->job_id());
    if (job == nullptr) return Reply(ctx, JobNotFound(req->job_id()));
    s = store_->PutKv(req->job_id(), req->key(), req->value());
    if (!s.ok()) return Reply(ctx, s);
    job->kv[req->key()] = req->value();
    for (auto g = pending_gets_.begin(); g != pending_gets_.end();) {
      if (g->job_id == req->job_id() && g->key == req->key()) {
        g->resp->set_value(req->value());
        Finish(&deferred, g->parked.reactor, grpc::Status::OK);
        g = pending_gets_.erase(g);
      } else {
        ++g;
      }
    }
  }
  for (auto& f : deferred) f();
  return Reply(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* PlannerService::Get(grpc::CallbackServerContext* ctx,
                                              const v1::GetRequest* req, v1::GetResponse* resp) {
  absl::Status s = Authenticate(ctx, false);
  if (s.ok()) s = ValidateGet(*req, options_.limits);
  if (!s.ok()) return Reply(ctx, s);
  absl::MutexLock lock(&mu_);
  JobState* job = LiveJob(req->job_id());
  if (job == nullptr) return Reply(ctx, JobNotFound(req->job_id()));
  auto kv = job->kv.find(req->key());
  if (kv != job->kv.end()) {
    resp->set_value(kv->second);
    return Reply(ctx, absl::OkStatus());
  }
  if (req->wait_ms() == 0) {
    return Reply(ctx, absl::NotFoundError(absl::StrCat("key '", req->key(), "' of job '",
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

grpc::ServerUnaryReactor* PlannerService::ReportFailure(grpc::CallbackServerContext* ctx,
                                                        const v1::ReportFailureRequest* req,
                                                        v1::ReportFailureResponse*) {
  absl::Status s = Authenticate(ctx, false);
  if (s.ok()) s = ValidateReportFailure(*req, options_.limits);
  if (!s.ok()) return Reply(ctx, s);
  Deferred deferred;
  {
    absl::MutexLock lock(&mu_);
    JobState* job = LiveJob(req->job_id());
    if (job == nullptr) return Reply(ctx, JobNotFound(req->job_id()));
    JobState& js = *job;
    if (!Terminal(js.job.status())) {
      js.job.set_status(v1::JOB_DEGRADED);
      js.job.set_error(absl::StrCat("node '", req->reporter_node_id(), "' reports peer '",
                                    req->lost_peer(), "' lost: ", req->message()));
      LOG(WARNING) << "job " << req->job_id() << " DEGRADED: " << js.job.error();
      (void)JobChanged(&js, &deferred);
    }
  }
  for (auto& f : deferred) f();
  return Reply(ctx, absl::OkStatus());
}

void PlannerService::Tick() {
  Deferred deferred;
  {
    absl::MutexLock lock(&mu_);
    if (shutdown_) return;
    const auto now = Clock::now();
    const int64_t now_ms = NowMs();
    // Rendezvous waits.
    for (auto g = pending_gets_.begin(); g != pending_gets_.end();) {
      if (g->parked.deadline <= now) {
        Finish(&deferred, g->parked.reactor,
               grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                            absl::StrCat("key '", g->key, "' of job '", g->job_id,
                                         "' was not put before the wait ended")));
        g = pending_gets_.erase(g);
      } else {
        ++g;
      }
    }
    // Registration deadlines.
    for (auto& [id, js] : jobs_) {
      if (js.job.status() != v1::JOB_REGISTERING || js.planning ||
          js.job.registration_deadline_unix_ms() > now_ms) {
        continue;
      }
      if (js.job.inventory_sha256().empty()) {
        FailJob(&js,
                absl::StrCat("no rank sent a full inventory within the registration deadline (",
                             js.job.options().registration_timeout_ms(), " ms)"),
                &deferred);
      } else {
        std::vector<int64_t> missing;
        for (const auto& r : js.job.ranks()) {
          if (!r.registered()) missing.push_back(r.rank());
        }
        if (missing.size() > 8) missing.resize(8);
        FailJob(&js,
                absl::StrCat("ranks [", absl::StrJoin(missing, ", "),
                             missing.size() == 8 ? ", ..." : "",
                             "] did not register within the registration deadline (",
                             js.job.options().registration_timeout_ms(), " ms)"),
                &deferred);
      }
    }
    // Node liveness.
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
        for (const auto& r : js.job.ranks()) has_rank |= r.node_id() == node_id;
        if (!has_rank) continue;
        js.job.set_status(v1::JOB_DEGRADED);
        js.job.set_error(absl::StrCat("node '", node_id, "' lost (no heartbeat for ",
                                      options_.node_timeout.count(), " ms)"));
        (void)JobChanged(&js, &deferred);
      }
    }
  }
  for (auto& f : deferred) f();
}

void PlannerService::RunTicker() {
  while (!stop_.WaitForNotificationWithTimeout(absl::FromChrono(options_.tick))) Tick();
}

}  // namespace ragshard::planner
