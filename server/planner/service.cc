#include "server/planner/service.h"

#include <malloc.h>

#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/plan_codec.h"
#include "glog/logging.h"
#include "infra/metrics.h"
#include "infra/rpc.h"
#include "infra/secrets.h"
#include "server/planner/auth.h"

namespace ragshard::planner {

absl::StatusOr<std::unique_ptr<PlannerService>> PlannerService::Create(std::unique_ptr<Store> store,
                                                                       PlannerOptions options) {
  auto state = store->Load();
  if (!state.ok()) return state.status();
  std::unique_ptr<PlannerService> svc(new PlannerService(std::move(store), std::move(options)));
  // Nothing else runs yet: the entries are filled without their locks' contention.
  std::map<std::string, JobState> loaded;
  for (v1::Job& job : state->jobs) loaded[job.job_id()].job = std::move(job);
  for (auto& [id, rank] : state->ranks) {
    auto it = loaded.find(id);
    if (it == loaded.end() || rank.rank() < 0 || rank.rank() >= it->second.job.world_size())
      continue;
    it->second.ranks[rank.rank()] = std::move(rank);
  }
  for (auto& [id, js] : loaded) {
    js.job.set_registered_ranks(static_cast<int64_t>(js.ranks.size()));
    if (js.job.data_secret().empty()) {
      // A job stored by a planner before data-plane secrets: it gets one now.
      js.job.set_data_secret(RandomBytes(32));
      if (absl::Status s = svc->store_->PutJob(js.job); !s.ok()) return s;
    }
  }
  for (auto& [id, bytes] : state->inventories) {
    auto it = loaded.find(id);
    if (it == loaded.end()) continue;
    Inventory inv;
    if (!inv.ParseFromString(bytes))
      return absl::DataLossError("corrupt stored inventory of " + id);
    it->second.inventory = std::move(inv);
  }
  for (auto& [id, bytes] : state->plans) {
    auto it = loaded.find(id);
    if (it == loaded.end()) continue;
    auto decoded = DecodePlan(bytes, "stored plan of job '" + id + "'");
    if (!decoded.ok()) return decoded.status();
    v1::Plan& plan = *decoded;
    // A plan newer than its job's record was stored by an older planner killed between the
    // two writes (they are one transaction now): the job is planned again, to the same plan.
    if (plan.version() != it->second.job.plan_version()) continue;
    // Stores written before plans were compressed hold them plain.
    it->second.plan_zstd = IsZstdFrame(bytes) ? std::move(bytes) : CompressPlan(plan);
    it->second.plan = std::move(plan);
  }
  std::vector<StoredState::Kv> kv;
  for (auto& k : state->kv) {
    if (loaded.count(k.job_id)) kv.push_back(std::move(k));
  }
  svc->rendezvous_.Load(kv);
  // Nodes get a fresh heartbeat grace period after a restart.
  svc->nodes_.Load(std::move(state->nodes), NowMs());
  const size_t jobs = loaded.size();
  // A planner stopped between a shrink's store write and its successor's: the successor now.
  std::vector<v1::Job> successors;
  for (const auto& [id, js] : loaded) {
    const std::string& next = js.job.successor_job_id();
    if (js.job.status() == v1::JOB_SHRUNK && !next.empty() && loaded.count(next) == 0) {
      successors.push_back(svc->SuccessorOf(js));
    }
  }
  for (auto& [id, js] : loaded) {
    EntryPtr e = svc->Entry(id, /*create=*/true);
    absl::MutexLock lock(&e->mu);
    e->state = std::move(js);
    // A job whose ranks all registered but whose plan was not stored before a crash is planned
    // now; a stored plan is never recomputed.
    if (e->state.job.status() == v1::JOB_REGISTERING && !e->state.plan && e->state.inventory) {
      Deferred deferred;  // nobody watches yet
      (void)svc->MaybePlan(id, &e->state, &deferred);
      RunDeferred(&deferred);
    }
  }
  for (const v1::Job& next : successors) svc->CreateSuccessor(next);
  LOG(INFO) << "planner state loaded: " << jobs << " jobs, " << svc->nodes_.size() << " nodes";
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
  if (shutdown_.exchange(true)) return;
  Deferred deferred;
  const grpc::Status unavailable(grpc::StatusCode::UNAVAILABLE, "planner shutting down");
  for (auto& [id, e] : Entries()) {
    absl::MutexLock lock(&e->mu);
    for (PendingHash& p : e->state.pending_hash)
      FinishLater(&deferred, p.parked.reactor, unavailable);
    e->state.pending_hash.clear();
  }
  // Once closed, the registries refuse new watchers and waits (UNAVAILABLE), so a call that
  // found its job live before the flag was set leaves nothing open.
  watchers_.CloseAll(unavailable, &deferred);
  beat_streams_.CloseAll(unavailable);
  rendezvous_.AbortAll(unavailable, &deferred);
  RunDeferred(&deferred);
  stop_.Notify();
  if (ticker_.joinable()) ticker_.join();
}

int64_t PlannerService::NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now().time_since_epoch())
      .count();
}

PlannerService::EntryPtr PlannerService::Entry(const std::string& id, bool create) {
  absl::MutexLock lock(&jobs_mu_);
  auto it = jobs_.find(id);
  if (it != jobs_.end()) return it->second;
  if (!create) return nullptr;
  return jobs_.emplace(id, std::make_shared<JobEntry>()).first->second;
}

std::vector<std::pair<std::string, PlannerService::EntryPtr>> PlannerService::Entries(
    const std::string& after) const {
  absl::MutexLock lock(&jobs_mu_);
  auto it = after.empty() ? jobs_.begin() : jobs_.upper_bound(after);
  return {it, jobs_.end()};
}

absl::Status PlannerService::Admit(grpc::CallbackServerContext* ctx, Access access,
                                   const std::function<absl::Status()>& validate) const {
  absl::Status s =
      CheckBearerToken(*ctx, options_.token, options_.admin_token, access == Access::kAdmin);
  if (s.ok() && validate) s = validate();
  // A refused request may have been large (a 300 MiB value, a million tensors): its memory goes
  // back to the system at the next tick, not only to the allocator.
  if (!s.ok()) trim_memory_.store(true, std::memory_order_relaxed);
  return s;
}

absl::StatusOr<PlannerService::JobState*> PlannerService::LiveJob(const std::string& id,
                                                                  JobState* state) const {
  if (shutdown_.load()) return absl::UnavailableError("planner shutting down");
  if (state == nullptr || state->job.job_id().empty() || state->job.status() == v1::JOB_DELETED) {
    return absl::NotFoundError(absl::StrCat("job '", id, "' not found"));
  }
  return state;
}

grpc::ServerUnaryReactor* PlannerService::Unlocked(
    Ctx* ctx, Access access, const std::function<absl::Status()>& validate,
    const std::function<absl::Status(Deferred*)>& body) {
  absl::Status s = Admit(ctx, access, validate);
  if (!s.ok()) return ReplyUnary(ctx, s);
  Deferred deferred;
  s = body(&deferred);
  RunDeferred(&deferred);
  return ReplyUnary(ctx, s);
}

grpc::ServerUnaryReactor* PlannerService::OnJob(
    Ctx* ctx, Access access, const std::string& job_id,
    const std::function<absl::Status()>& validate,
    const std::function<absl::Status(JobState&, Deferred*)>& body) {
  auto check = [&] { return validate ? validate() : ValidateJobId(job_id, options_.limits); };
  return Unlocked(ctx, access, check, [&](Deferred* deferred) {
    EntryPtr e = Entry(job_id);
    if (e == nullptr) return LiveJob(job_id, nullptr).status();
    absl::MutexLock lock(&e->mu);
    auto job = LiveJob(job_id, &e->state);
    return job.ok() ? body(**job, deferred) : job.status();
  });
}

v1::WatchPlanEvent PlannerService::StatusEvent(const JobState& js) {
  v1::WatchPlanEvent ev;
  ev.set_status(js.job.status());
  ev.set_error(js.job.error());
  ev.set_plan_version(js.job.plan_version());
  return ev;
}

WatchChannel::Event PlannerService::PlanEvent(JobState* js, bool zstd) {
  JobState::PlanEvents& c = js->plan_events;
  if (c.status != js->job.status() || c.error != js->job.error() ||
      c.version != js->job.plan_version()) {
    c = JobState::PlanEvents{js->job.status(), js->job.error(), js->job.plan_version(), {}, {}};
  }
  WatchChannel::Event& ev = zstd ? c.zstd : c.plain;
  if (!ev) {
    v1::WatchPlanEvent e = StatusEvent(*js);
    if (zstd) {
      e.set_plan_zstd(js->plan_zstd);
    } else {
      *e.mutable_plan() = *js->plan;
    }
    ev = ToBuffer(e);
  }
  metrics_.PlanSent(ev->Length());
  return ev;
}

void PlannerService::BeforeJobWrite(const std::string& job_id) const {
  if (options_.before_job_write) options_.before_job_write(job_id);
}

absl::Status PlannerService::JobChanged(JobState* js, Deferred* deferred) {
  BeforeJobWrite(js->job.job_id());
  absl::Status s = store_->PutJob(js->job);
  if (!s.ok()) LOG(ERROR) << "store job " << js->job.job_id() << ": " << s;
  NotifyWatchers(js, deferred);
  return s;
}

v1::Job PlannerService::Summary(const v1::Job& job) {
  v1::Job out = job;
  out.clear_data_secret();
  return out;
}

void PlannerService::NotifyWatchers(JobState* js, Deferred* deferred) {
  // Every watcher gets the new status; the plan itself only with a version it has not seen.
  const std::vector<WatchRegistry::Channel> live = watchers_.Live(js->job.job_id());
  if (live.empty()) return;
  if (js->notified_status == js->job.status() && js->notified_error == js->job.error() &&
      js->notified_version == js->job.plan_version()) {
    return;  // nothing a watcher sees changed (e.g. one more rank registered)
  }
  js->notified_status = js->job.status();
  js->notified_error = js->job.error();
  js->notified_version = js->job.plan_version();
  const WatchChannel::Event without_plan = ToBuffer(StatusEvent(*js));
  for (const auto& w : live) {
    WatchChannel::Event ev = without_plan;
    if (w->sent_version < js->job.plan_version() && js->plan) {
      ev = PlanEvent(js, w->zstd);
      w->sent_version = js->job.plan_version();
    }
    deferred->push_back([w, ev] { w->Push(ev); });
  }
}

void PlannerService::FailJob(JobState* js, const std::string& error, Deferred* deferred) {
  if (absl::Status s = JobStatusMachine::Move(&js->job, v1::JOB_FAILED); !s.ok()) {
    LOG(ERROR) << s;
    return;
  }
  js->job.set_error(error);
  LOG(WARNING) << "job " << js->job.job_id() << " failed: " << error;
  const grpc::Status failed(grpc::StatusCode::FAILED_PRECONDITION, error);
  for (PendingHash& p : js->pending_hash) FinishLater(deferred, p.parked.reactor, failed);
  js->pending_hash.clear();
  (void)JobChanged(js, deferred);
}

void PlannerService::Tick() {
  if (shutdown_.load()) return;
  Deferred deferred;
  rendezvous_.ExpireWaits(Clock::now(), &deferred);
  const int64_t now_ms = NowMs();
  // Silent nodes first: a recovery that ends in this tick knows every node lost by now (a
  // shrink goes on without them).
  DegradeJobsOn(nodes_.ExpireSilent(now_ms, options_.node_timeout), &deferred);
  for (auto& [id, e] : Entries()) {
    absl::MutexLock lock(&e->mu);
    ExpireRegistration(&e->state, now_ms, &deferred);
    ExpireRecovery(&e->state, now_ms, &deferred);
  }
  RunDeferred(&deferred);
}

void PlannerService::RunTicker() {
  // Freed memory returns to the system after a refused request, and every 10 s in any case
  // (a request gRPC refuses by its size never reaches a handler). gRPC frees a refused request
  // after its answer is sent, which may be after the next tick: for a second after a refusal
  // the ticker trims every 200 ms.
  using std::chrono::steady_clock;
  auto last_trim = steady_clock::now();
  auto trim_until = last_trim;
  while (!stop_.WaitForNotificationWithTimeout(absl::FromChrono(options_.tick))) {
    Tick();
    const auto now = steady_clock::now();
    const bool refused = trim_memory_.exchange(false, std::memory_order_relaxed);
    if (refused) trim_until = now + std::chrono::seconds(1);
    if (refused || now - last_trim > std::chrono::seconds(10) ||
        (now < trim_until && now - last_trim >= std::chrono::milliseconds(200))) {
      malloc_trim(0);
      last_trim = now;
    }
  }
}

std::vector<prometheus::MetricFamily> PlannerService::ScrapeFigures() const {
  // Every state appears, 0 when no job or node is in it, so that a dashboard's series exist.
  std::map<std::string, double> jobs, nodes;
  auto state = [](const std::string& name, const char* prefix) {
    return absl::AsciiStrToLower(name.substr(std::string(prefix).size()));
  };
  for (int s = v1::JOB_REGISTERING; s <= v1::JobStatus_MAX; ++s) {
    jobs[state(v1::JobStatus_Name(s), "JOB_")] = 0;
  }
  for (int s = v1::NODE_UP; s <= v1::NODE_LOST; ++s) {
    nodes[state(v1::NodeStatus_Name(s), "NODE_")] = 0;
  }
  double registrations = 0;
  for (const auto& [id, e] : Entries()) {
    absl::MutexLock lock(&e->mu);
    if (e->state.job.job_id().empty()) continue;  // never stored
    jobs[state(v1::JobStatus_Name(e->state.job.status()), "JOB_")] += 1;
    registrations += static_cast<double>(e->state.pending_hash.size());
  }
  for (const auto& [status, count] : nodes_.CountByStatus()) {
    nodes[state(v1::NodeStatus_Name(status), "NODE_")] += static_cast<double>(count);
  }
  const double watch_streams = static_cast<double>(watchers_.size());
  const std::map<std::string, double> parked = {{"get", static_cast<double>(rendezvous_.waiting())},
                                                {"registration", registrations}};
  return {GaugeFamily("ragshard_planner_jobs", "Jobs by state", "state", jobs),
          GaugeFamily("ragshard_planner_nodes", "Nodes by state", "state", nodes),
          GaugeFamily("ragshard_planner_watch_streams", "Open WatchPlan streams", "",
                      {{"", watch_streams}}),
          GaugeFamily("ragshard_planner_heartbeat_streams", "Open HeartbeatStream streams", "",
                      {{"", static_cast<double>(beat_streams_.open())}}),
          GaugeFamily("ragshard_planner_parked_calls",
                      "Calls waiting: rendezvous gets for their keys, hash-only registrations for "
                      "a full inventory",
                      "call", parked)};
}

}  // namespace ragshard::planner
