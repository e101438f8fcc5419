#include "client/fake_planner_client.h"

#include "absl/strings/str_cat.h"
#include "common/planner.h"

namespace ragshard {

struct FakePlannerClient::Watcher {
  std::string job_id;
  PlanWatchCallback callback;
  absl::Mutex mu;  // held while the callback runs
  bool stopped ABSL_GUARDED_BY(mu) = false;
};

namespace {

class FakeWatch final : public PlanWatch {
 public:
  explicit FakeWatch(std::function<void()> stop) : stop_(std::move(stop)) {}
  ~FakeWatch() override { stop_(); }

 private:
  std::function<void()> stop_;
};

v1::WatchPlanEvent Event(const v1::Job& job, const v1::Plan* plan) {
  v1::WatchPlanEvent ev;
  ev.set_status(job.status());
  ev.set_error(job.error());
  ev.set_plan_version(job.plan_version());
  if (plan != nullptr) *ev.mutable_plan() = *plan;
  return ev;
}

}  // namespace

FakePlannerClient::FakePlannerClient() = default;
FakePlannerClient::~FakePlannerClient() = default;

void FakePlannerClient::SetUnavailable(bool unavailable) {
  absl::MutexLock lock(&mu_);
  unavailable_ = unavailable;
}

absl::Status FakePlannerClient::Check() const {
  return unavailable_ ? absl::UnavailableError("fake planner unavailable") : absl::OkStatus();
}

void FakePlannerClient::Notify(const std::string& job_id) {
  std::vector<std::shared_ptr<Watcher>> targets;
  v1::WatchPlanEvent ev;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) return;
    ev = Event(it->second.job, it->second.plan.get());
    for (const auto& w : watchers_) {
      if (w->job_id == job_id) targets.push_back(w);
    }
  }
  for (const auto& w : targets) {
    absl::MutexLock lock(&w->mu);
    if (!w->stopped) w->callback(absl::OkStatus(), &ev);
  }
}

absl::StatusOr<v1::Job> FakePlannerClient::CreateJob(const v1::CreateJobRequest& request) {
  absl::MutexLock lock(&mu_);
  if (auto s = Check(); !s.ok()) return s;
  if (jobs_.count(request.job_id())) {
    return absl::AlreadyExistsError(absl::StrCat("job '", request.job_id(), "' exists"));
  }
  const int64_t w = request.mesh().shard_size() * request.mesh().replicate_size();
  if (request.job_id().empty() || w < 1) return absl::InvalidArgumentError("job_id or mesh");
  JobState& js = jobs_[request.job_id()];
  js.job.set_job_id(request.job_id());
  *js.job.mutable_mesh() = request.mesh();
  *js.job.mutable_options() = request.options();
  if (js.job.options().policy().empty()) js.job.mutable_options()->set_policy("ragged");
  if (js.job.options().align_bytes() == 0) js.job.mutable_options()->set_align_bytes(16);
  js.job.set_world_size(w);
  js.job.set_status(v1::JOB_REGISTERING);
  for (int64_t r = 0; r < w; ++r) js.job.add_ranks()->set_rank(r);
  return js.job;
}

absl::StatusOr<v1::Job> FakePlannerClient::GetJob(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  if (auto s = Check(); !s.ok()) return s;
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("job '", job_id, "' not found"));
  return it->second.job;
}

absl::StatusOr<std::vector<v1::Job>> FakePlannerClient::ListJobs() {
  absl::MutexLock lock(&mu_);
  if (auto s = Check(); !s.ok()) return s;
  std::vector<v1::Job> out;
  for (const auto& [id, js] : jobs_) out.push_back(js.job);
  return out;
}

absl::Status FakePlannerClient::DeleteJob(const std::string& job_id) {
  {
    absl::MutexLock lock(&mu_);
    if (auto s = Check(); !s.ok()) return s;
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("job '", job_id, "' not found"));
    it->second.job.set_status(v1::JOB_DELETED);
  }
  Notify(job_id);
  absl::MutexLock lock(&mu_);
  jobs_.erase(job_id);
  return absl::OkStatus();
}

absl::StatusOr<v1::Job> FakePlannerClient::RegisterRank(const v1::RegisterRankRequest& request) {
  v1::Job out;
  {
    absl::MutexLock lock(&mu_);
    if (auto s = Check(); !s.ok()) return s;
    auto it = jobs_.find(request.job_id());
    if (it == jobs_.end()) {
      return absl::NotFoundError(absl::StrCat("job '", request.job_id(), "' not found"));
    }
    JobState& js = it->second;
    if (request.rank() < 0 || request.rank() >= js.job.world_size()) {
      return absl::InvalidArgumentError(absl::StrCat("rank: ", request.rank(), " out of range"));
    }
    std::string sha;
    if (request.has_inventory()) {
      if (auto s = ValidateInventory(request.inventory()); !s.ok()) return s;
      sha = InventorySha256(request.inventory());
      if (!js.inventory) {
        js.inventory = std::make_unique<Inventory>(request.inventory());
        js.job.set_inventory_sha256(sha);
      }
    } else {
      sha = request.inventory_sha256();
      if (!js.inventory) {
        return absl::FailedPreconditionError("fake planner: send the full inventory first");
      }
    }
    if (sha != js.job.inventory_sha256()) {
      return absl::FailedPreconditionError(
          absl::StrCat("rank ", request.rank(), ": inventory differs from the reference"));
    }
    auto* r = js.job.mutable_ranks(static_cast<int>(request.rank()));
    r->set_registered(true);
    r->set_node_id(request.node_id());
    r->set_inventory_sha256(sha);
    bool all = true;
    for (const auto& rs : js.job.ranks()) all &= rs.registered();
    if (all && !js.plan) {
      PlanOptions o;
      o.policy = *ParsePolicy(js.job.options().policy());
      o.world = js.job.mesh().shard_size();
      o.align_bytes = js.job.options().align_bytes();
      o.job_id = js.job.job_id();
      auto plan = BuildPlan(*js.inventory, o);
      if (!plan.ok()) {
        js.job.set_status(v1::JOB_FAILED);
        js.job.set_error(std::string(plan.status().message()));
      } else {
        js.plan = std::make_unique<v1::Plan>(std::move(*plan));
        js.job.set_status(v1::JOB_READY);
        js.job.set_plan_version(1);
      }
    }
    out = js.job;
  }
  Notify(request.job_id());
  return out;
}

absl::StatusOr<v1::Plan> FakePlannerClient::GetPlan(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  if (auto s = Check(); !s.ok()) return s;
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("job '", job_id, "' not found"));
  if (!it->second.plan) return absl::FailedPreconditionError("no plan yet");
  return *it->second.plan;
}

std::unique_ptr<PlanWatch> FakePlannerClient::WatchPlan(const std::string& job_id,
                                                        PlanWatchCallback callback) {
  auto w = std::make_shared<Watcher>();
  w->job_id = job_id;
  w->callback = std::move(callback);
  bool found = false;
  {
    absl::MutexLock lock(&mu_);
    found = jobs_.count(job_id) > 0;
    if (found) watchers_.insert(w);
  }
  if (!found) {
    absl::MutexLock lock(&w->mu);
    w->callback(absl::NotFoundError(absl::StrCat("job '", job_id, "' not found")), nullptr);
  } else {
    Notify(job_id);
  }
  return std::make_unique<FakeWatch>([this, w] {
    {
      absl::MutexLock lock(&mu_);
      watchers_.erase(w);
    }
    absl::MutexLock lock(&w->mu);
    w->stopped = true;
  });
}

absl::StatusOr<v1::RegisterNodeResponse> FakePlannerClient::RegisterNode(
    const v1::RegisterNodeRequest& request) {
  absl::MutexLock lock(&mu_);
  if (auto s = Check(); !s.ok()) return s;
  v1::Node& n = nodes_[request.node_id()];
  n.set_node_id(request.node_id());
  n.set_data_address(request.data_address());
  n.set_capacity_bytes(request.capacity_bytes());
  n.set_status(v1::NODE_UP);
  v1::RegisterNodeResponse resp;
  resp.set_heartbeat_interval_ms(100);
  return resp;
}

absl::StatusOr<v1::HeartbeatResponse> FakePlannerClient::Heartbeat(
    const v1::HeartbeatRequest& request) {
  absl::MutexLock lock(&mu_);
  if (auto s = Check(); !s.ok()) return s;
  auto it = nodes_.find(request.node_id());
  if (it == nodes_.end()) return absl::NotFoundError("node not registered");
  *it->second.mutable_figures() = request.figures();
  v1::HeartbeatResponse resp;
  for (const auto& j : request.jobs()) {
    auto job = jobs_.find(j);
    if (job == jobs_.end() || job->second.job.status() == v1::JOB_DELETED) resp.add_release_jobs(j);
  }
  return resp;
}

absl::StatusOr<std::vector<v1::Node>> FakePlannerClient::ListNodes() {
  absl::MutexLock lock(&mu_);
  if (auto s = Check(); !s.ok()) return s;
  std::vector<v1::Node> out;
  for (const auto& [id, n] : nodes_) out.push_back(n);
  return out;
}

absl::Status FakePlannerClient::Put(const std::string& job_id, const std::string& key,
                                    const std::string& value) {
  absl::MutexLock lock(&mu_);
  if (auto s = Check(); !s.ok()) return s;
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("job '", job_id, "' not found"));
  it->second.kv[key] = value;
  return absl::OkStatus();
}

absl::StatusOr<std::string> FakePlannerClient::Get(const std::string& job_id,
                                                   const std::string& key,
                                                   std::chrono::milliseconds wait) {
  absl::MutexLock lock(&mu_);
  if (auto s = Check(); !s.ok()) return s;
  auto found = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = jobs_.find(job_id);
    return it == jobs_.end() || it->second.kv.count(key) > 0;
  };
  mu_.AwaitWithTimeout(absl::Condition(&found), absl::FromChrono(wait));
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("job '", job_id, "' not found"));
  auto kv = it->second.kv.find(key);
  if (kv == it->second.kv.end()) {
    return absl::DeadlineExceededError(absl::StrCat("key '", key, "' was not put"));
  }
  return kv->second;
}

absl::Status FakePlannerClient::ReportFailure(const v1::ReportFailureRequest& request) {
  {
    absl::MutexLock lock(&mu_);
    if (auto s = Check(); !s.ok()) return s;
    auto it = jobs_.find(request.job_id());
    if (it == jobs_.end()) return absl::NotFoundError("job not found");
    it->second.job.set_status(v1::JOB_DEGRADED);
    it->second.job.set_error(request.message());
  }
  Notify(request.job_id());
  return absl::OkStatus();
}

absl::Status FakePlannerClient::Health() {
  absl::MutexLock lock(&mu_);
  return Check();
}

}  // namespace ragshard
