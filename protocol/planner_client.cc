#include "protocol/planner_client.h"

#include <algorithm>
#include <cstdlib>
#include <thread>

#include "absl/random/random.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "engine/plan_codec.h"
#include "glog/logging.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/health_check_service_interface.h"
#include "infra/status_macros.h"

namespace ragshard {

absl::StatusOr<v1::Plan> PlannerClient::WaitForPlan(const std::string& job_id,
                                                    std::chrono::milliseconds timeout) {
  absl::Mutex mu;
  absl::StatusOr<v1::Plan> result = absl::DeadlineExceededError(
      absl::StrCat("job '", job_id, "' has no plan after ", timeout.count(), " ms"));
  bool done = false;
  auto watch = WatchPlan(job_id, [&](const absl::Status& s, const v1::WatchPlanEvent* ev) {
    absl::MutexLock lock(&mu);
    if (done) return;
    if (!s.ok()) {
      result = s;
      done = true;
    } else if (ev->has_plan()) {
      result = ev->plan();
      done = true;
    } else if (ev->status() == v1::JOB_FAILED || ev->status() == v1::JOB_DELETED) {
      result = absl::FailedPreconditionError(absl::StrCat(
          "job '", job_id, "' is ", v1::JobStatus_Name(ev->status()), ": ", ev->error()));
      done = true;
    }
  });
  {
    absl::MutexLock lock(&mu);
    mu.AwaitWithTimeout(absl::Condition(&done), absl::FromChrono(timeout));
  }
  watch.reset();  // joins the watch thread before `mu` and `result` go away
  absl::MutexLock lock(&mu);
  return result;
}

namespace {

// Runs one watch: a stream, reopened with backoff after transient failures.
class GrpcPlanWatch final : public PlanWatch {
 public:
  GrpcPlanWatch(v1::Planner::Stub* stub, const ClientSecurity* security, std::string job_id,
                PlanWatchCallback callback, const PlannerClientOptions* options)
      : stub_(stub),
        security_(security),
        job_id_(std::move(job_id)),
        callback_(std::move(callback)),
        options_(options) {
    thread_ = std::thread([this] { Run(); });
  }

  ~GrpcPlanWatch() override {
    {
      absl::MutexLock lock(&mu_);
      stopped_ = true;
      if (ctx_) ctx_->TryCancel();
    }
    thread_.join();
  }

 private:
  bool Stopped() {
    absl::MutexLock lock(&mu_);
    return stopped_;
  }

  void Run() {
    uint64_t seen_version = 0;
    auto backoff = options_->watch_initial_backoff;
    while (!Stopped()) {
      grpc::ClientContext ctx;
      Authorize(&ctx, *security_);
      {
        absl::MutexLock lock(&mu_);
        if (stopped_) return;
        ctx_ = &ctx;
      }
      v1::WatchPlanRequest req;
      req.set_job_id(job_id_);
      req.set_after_plan_version(seen_version);
      req.set_accept_zstd(true);  // about 40x fewer bytes for a large plan
      auto reader = stub_->WatchPlan(&ctx, req);
      v1::WatchPlanEvent ev;
      bool got_any = false;
      absl::Status corrupt;
      while (reader->Read(&ev)) {
        got_any = true;
        if (!ev.plan_zstd().empty() && options_->decode_plans) {
          auto plan = DecodePlan(ev.plan_zstd(), "the planner's compressed plan");
          if (!plan.ok()) {
            corrupt = plan.status();
            break;
          }
          *ev.mutable_plan() = std::move(*plan);
          ev.clear_plan_zstd();
        }
        if (ev.has_plan() || !ev.plan_zstd().empty()) {
          seen_version = std::max(seen_version, ev.plan_version());
        }
        callback_(absl::OkStatus(), &ev);
        if (ev.status() == v1::JOB_DELETED) break;
      }
      if (!corrupt.ok()) {
        ctx.TryCancel();
        (void)reader->Finish();
        {
          absl::MutexLock lock(&mu_);
          ctx_ = nullptr;
          if (stopped_) return;
        }
        callback_(corrupt, nullptr);
        return;
      }
      grpc::Status st = reader->Finish();
      {
        absl::MutexLock lock(&mu_);
        ctx_ = nullptr;
        if (stopped_) return;
      }
      if (ev.status() == v1::JOB_DELETED) {
        callback_(absl::NotFoundError(absl::StrCat("job '", job_id_, "' deleted")), nullptr);
        return;
      }
      const auto code = st.error_code();
      if (code == grpc::StatusCode::NOT_FOUND || code == grpc::StatusCode::UNAUTHENTICATED ||
          code == grpc::StatusCode::PERMISSION_DENIED ||
          code == grpc::StatusCode::INVALID_ARGUMENT) {
        callback_(FromGrpcStatus(st), nullptr);
        return;
      }
      if (got_any) backoff = options_->watch_initial_backoff;
      VLOG(1) << "watch of " << job_id_ << " ended (" << st.error_message() << "), retrying in "
              << backoff.count() << " ms";
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&stopped_), absl::FromChrono(backoff));
      backoff = std::min(backoff * 2, options_->watch_max_backoff);
    }
  }

  v1::Planner::Stub* const stub_;
  const ClientSecurity* const security_;
  const std::string job_id_;
  const PlanWatchCallback callback_;
  const PlannerClientOptions* const options_;
  absl::Mutex mu_;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ClientContext* ctx_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::thread thread_;
};

// A request that names only its job.
template <typename Request>
Request ForJob(const std::string& job_id) {
  Request request;
  request.set_job_id(job_id);
  return request;
}

}  // namespace

absl::StatusOr<std::unique_ptr<GrpcPlannerClient>> GrpcPlannerClient::Create(
    PlannerClientOptions options) {
  if (options.address.empty()) return absl::InvalidArgumentError("--planner: address required");
  auto security = LoadClientSecurity(options.security);
  if (!security.ok()) return security.status();
  return std::unique_ptr<GrpcPlannerClient>(
      new GrpcPlannerClient(std::move(options), std::move(*security)));
}

GrpcPlannerClient::GrpcPlannerClient(PlannerClientOptions options, ClientSecurity security)
    : options_(std::move(options)), security_(std::move(security)) {
  channel_ = MakeChannel(options_.address, security_);
  stub_ = v1::Planner::NewStub(channel_);
  beats_ = std::make_unique<HeartbeatStream>(stub_.get(), &security_);
}

void GrpcPlannerClient::Prepare(grpc::ClientContext* ctx, std::chrono::milliseconds extra) const {
  Authorize(ctx, security_);
  ctx->set_deadline(std::chrono::system_clock::now() + options_.rpc_timeout + extra);
}

absl::Status GrpcPlannerClient::Wrap(const grpc::Status& status) const {
  if (status.ok()) return absl::OkStatus();
  if (status.error_code() == grpc::StatusCode::UNAVAILABLE) {
    // A refused TLS handshake looks like a planner that is down: say how this client connected.
    const std::string& ca = options_.security.tls_ca_file;
    const std::string how =
        ca.empty() ? " (this client connects without TLS: a planner that serves TLS needs its CA, "
                     "--tls-ca or RAGSHARD_TLS_CA)"
                   : absl::StrCat(" (over TLS, the planner's certificate checked against ", ca,
                                  options_.security.tls_cert_file.empty()
                                      ? ""
                                      : absl::StrCat(", client certificate ",
                                                     options_.security.tls_cert_file),
                                  ")");
    return absl::UnavailableError(absl::StrCat("planner at ", options_.address,
                                               " unreachable: ", status.error_message(), how));
  }
  return FromGrpcStatus(status);
}

ClientSecurityOptions ClientSecurityFromEnv() {
  auto env = [](const char* name) {
    const char* v = std::getenv(name);
    return std::string(v == nullptr ? "" : v);
  };
  ClientSecurityOptions o;
  o.token_file = env("RAGSHARD_TOKEN_FILE");
  o.tls_ca_file = env("RAGSHARD_TLS_CA");
  o.tls_cert_file = env("RAGSHARD_TLS_CERT");
  o.tls_key_file = env("RAGSHARD_TLS_KEY");
  o.tls_server_name = env("RAGSHARD_TLS_SERVER_NAME");
  return o;
}

absl::StatusOr<std::chrono::milliseconds> RetryWindowFromEnv(std::chrono::milliseconds fallback) {
  const char* v = std::getenv("RAGSHARD_PLANNER_RETRY_S");
  if (v == nullptr || *v == '\0') return fallback;
  double seconds = 0;
  if (!absl::SimpleAtod(v, &seconds) || !(seconds >= 0) || seconds > 86400) {
    return absl::InvalidArgumentError(absl::StrCat("RAGSHARD_PLANNER_RETRY_S='", v,
                                                   "' is not a number of seconds in [0, 86400]"));
  }
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

grpc::Status GrpcPlannerClient::Retry(const std::function<grpc::Status(grpc::ClientContext*)>& call,
                                      int* attempts, std::chrono::milliseconds extra) const {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  std::chrono::milliseconds backoff{100};
  thread_local absl::BitGen jitter;
  for (*attempts = 1;; ++*attempts) {
    grpc::ClientContext ctx;
    Prepare(&ctx, extra);
    grpc::Status st = call(&ctx);
    if (st.error_code() != grpc::StatusCode::UNAVAILABLE) return st;
    const auto sleep = std::chrono::milliseconds(
        static_cast<int64_t>(backoff.count() * absl::Uniform(jitter, 0.5, 1.5)));
    const auto spent = Clock::now() - start;
    const bool stopping = options_.stop_retrying != nullptr && options_.stop_retrying->load();
    if (stopping || spent + sleep > options_.retry_window) {
      if (*attempts == 1) return st;
      const double s = std::chrono::duration<double>(spent).count();
      return grpc::Status(
          grpc::StatusCode::UNAVAILABLE,
          absl::StrCat(st.error_message(), " (tried for ", absl::StrFormat("%.1f", s), " s, ",
                       *attempts, " attempts)"));
    }
    std::this_thread::sleep_for(sleep);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(2000));
  }
}

template <typename Request, typename Response>
absl::StatusOr<Response> GrpcPlannerClient::Call(UnaryMethod<Request, Response> method,
                                                 const Request& request,
                                                 std::chrono::milliseconds extra) const {
  Response response;
  int attempts = 0;
  const grpc::Status st = Retry(
      [&](grpc::ClientContext* ctx) { return (stub_.get()->*method)(ctx, request, &response); },
      &attempts, extra);
  if (!st.ok()) return Wrap(st);
  return response;
}

template <typename Request, typename Response>
absl::StatusOr<Response> GrpcPlannerClient::CallOnce(UnaryMethod<Request, Response> method,
                                                     const Request& request) const {
  Response response;
  grpc::ClientContext ctx;
  Prepare(&ctx);
  const grpc::Status st = (stub_.get()->*method)(&ctx, request, &response);
  if (!st.ok()) return Wrap(st);
  return response;
}

absl::StatusOr<v1::Job> GrpcPlannerClient::CreateJob(const v1::CreateJobRequest& request) {
  v1::CreateJobResponse resp;
  int attempts = 0;
  grpc::Status st = Retry(
      [&](grpc::ClientContext* ctx) { return stub_->CreateJob(ctx, request, &resp); }, &attempts);
  if (st.error_code() == grpc::StatusCode::ALREADY_EXISTS && attempts > 1) {
    // An earlier attempt may have been committed before the planner went away: that job, if it
    // is the one asked for (the same mesh and options, still registering), is the answer.
    auto job = GetJob(request.job_id());
    const auto& o = request.options();
    if (job.ok() && job->status() == v1::JOB_REGISTERING &&
        job->mesh().shard_size() == request.mesh().shard_size() &&
        job->mesh().replicate_size() == request.mesh().replicate_size() &&
        (o.policy().empty() || o.policy() == job->options().policy()) &&
        o.strategy() == job->options().strategy() && o.optimizer() == job->options().optimizer() &&
        o.memory_budget_bytes() == job->options().memory_budget_bytes() &&
        o.default_granule() == job->options().default_granule()) {
      return job;
    }
  }
  if (!st.ok()) return Wrap(st);
  return resp.job();
}

absl::StatusOr<v1::Job> GrpcPlannerClient::GetJob(const std::string& job_id) {
  RAGSHARD_ASSIGN_OR_RETURN(v1::GetJobResponse resp,
                            Call(&Stub::GetJob, ForJob<v1::GetJobRequest>(job_id)));
  return resp.job();
}

absl::StatusOr<std::string> GrpcPlannerClient::GetDataSecret(const std::string& job_id) {
  v1::GetJobRequest req;
  req.set_job_id(job_id);
  req.set_include_data_secret(true);
  RAGSHARD_ASSIGN_OR_RETURN(v1::GetJobResponse resp, Call(&Stub::GetJob, req));
  if (resp.job().data_secret().empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the planner gave job '", job_id, "' no data-plane secret"));
  }
  return resp.job().data_secret();
}

absl::StatusOr<std::vector<v1::Job>> PlannerClient::ListJobs() {
  std::vector<v1::Job> jobs;
  v1::ListJobsRequest req;
  do {
    auto page = ListJobsPage(req);
    if (!page.ok()) return page.status();
    jobs.insert(jobs.end(), page->jobs().begin(), page->jobs().end());
    req.set_page_token(page->next_page_token());
  } while (!req.page_token().empty());
  return jobs;
}

absl::StatusOr<v1::ListJobsResponse> GrpcPlannerClient::ListJobsPage(
    const v1::ListJobsRequest& request) {
  return Call(&Stub::ListJobs, request);
}

absl::StatusOr<std::vector<v1::RankState>> PlannerClient::ListRanks(const std::string& job_id) {
  std::vector<v1::RankState> ranks;
  v1::ListRanksRequest req;
  req.set_job_id(job_id);
  while (true) {
    auto page = ListRanksPage(req);
    if (!page.ok()) return page.status();
    ranks.insert(ranks.end(), page->ranks().begin(), page->ranks().end());
    // A page that adds nothing ends the walk, so a misbehaving server cannot loop it.
    if (page->ranks().empty() || page->next_start_rank() <= req.start_rank()) return ranks;
    req.set_start_rank(page->next_start_rank());
  }
}

absl::StatusOr<v1::ListRanksResponse> GrpcPlannerClient::ListRanksPage(
    const v1::ListRanksRequest& request) {
  return Call(&Stub::ListRanks, request);
}

absl::Status GrpcPlannerClient::DeleteJob(const std::string& job_id) {
  return Call(&Stub::DeleteJob, ForJob<v1::DeleteJobRequest>(job_id)).status();
}

absl::StatusOr<v1::Job> GrpcPlannerClient::RegisterRank(const v1::RegisterRankRequest& request) {
  RAGSHARD_ASSIGN_OR_RETURN(v1::RegisterRankResponse resp, Call(&Stub::RegisterRank, request));
  return resp.job();
}

absl::StatusOr<v1::ListJobNodesResponse> GrpcPlannerClient::ListJobNodes(
    const std::string& job_id) {
  RAGSHARD_ASSIGN_OR_RETURN(v1::ListJobNodesResponse resp,
                            Call(&Stub::ListJobNodes, ForJob<v1::ListJobNodesRequest>(job_id)));
  if (resp.run_node_size() != resp.run_first_size() ||
      resp.run_node_size() != resp.run_count_size()) {
    return absl::InternalError("ListJobNodes: the planner's runs are not of one length");
  }
  for (int32_t n : resp.run_node()) {
    if (n < 0 || n >= resp.node_ids_size()) {
      return absl::InternalError(
          absl::StrCat("ListJobNodes: run of node ", n, " of ", resp.node_ids_size()));
    }
  }
  return resp;
}

absl::StatusOr<v1::Job> GrpcPlannerClient::RegisterNodeRanks(
    const v1::RegisterNodeRanksRequest& request) {
  RAGSHARD_ASSIGN_OR_RETURN(v1::RegisterNodeRanksResponse resp,
                            Call(&Stub::RegisterNodeRanks, request));
  return resp.job();
}

absl::StatusOr<v1::Plan> GrpcPlannerClient::GetPlan(const std::string& job_id) {
  RAGSHARD_ASSIGN_OR_RETURN(v1::GetPlanResponse resp,
                            Call(&Stub::GetPlan, ForJob<v1::GetPlanRequest>(job_id)));
  return std::move(*resp.mutable_plan());
}

std::unique_ptr<PlanWatch> GrpcPlannerClient::WatchPlan(const std::string& job_id,
                                                        PlanWatchCallback callback) {
  return std::make_unique<GrpcPlanWatch>(stub_.get(), &security_, job_id, std::move(callback),
                                         &options_);
}

absl::StatusOr<v1::RegisterNodeResponse> GrpcPlannerClient::RegisterNode(
    const v1::RegisterNodeRequest& request) {
  return CallOnce(&Stub::RegisterNode, request);
}

absl::StatusOr<v1::HeartbeatResponse> GrpcPlannerClient::Heartbeat(
    const v1::HeartbeatRequest& request) {
  const int64_t now_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                             std::chrono::steady_clock::now().time_since_epoch())
                             .count();
  if (options_.heartbeat_stream && now_ms >= unary_beats_until_ms_.load()) {
    v1::HeartbeatResponse response;
    const grpc::Status st = beats_->Beat(request, options_.rpc_timeout, &response);
    if (st.ok()) return response;
    if (st.error_code() != grpc::StatusCode::UNIMPLEMENTED) return Wrap(st);
    // A planner of an earlier version: unary calls, and the stream tried again in a while (the
    // planner may be upgraded meanwhile).
    unary_beats_until_ms_.store(now_ms + kUnaryBeatsFor.count());
  }
  return CallOnce(&Stub::Heartbeat, request);
}

absl::StatusOr<std::vector<v1::Node>> GrpcPlannerClient::ListNodes() {
  RAGSHARD_ASSIGN_OR_RETURN(v1::ListNodesResponse resp,
                            Call(&Stub::ListNodes, v1::ListNodesRequest()));
  return std::vector<v1::Node>(resp.nodes().begin(), resp.nodes().end());
}

absl::Status GrpcPlannerClient::Put(const std::string& job_id, const std::string& key,
                                    const std::string& value) {
  v1::PutRequest req;
  req.set_job_id(job_id);
  req.set_key(key);
  req.set_value(value);
  return Call(&Stub::Put, req).status();
}

absl::StatusOr<std::string> GrpcPlannerClient::Get(const std::string& job_id,
                                                   const std::string& key,
                                                   std::chrono::milliseconds wait) {
  v1::GetRequest req;
  req.set_job_id(job_id);
  req.set_key(key);
  req.set_wait_ms(wait.count());
  RAGSHARD_ASSIGN_OR_RETURN(v1::GetResponse resp, Call(&Stub::Get, req, wait));
  return resp.value();
}

absl::StatusOr<std::vector<std::string>> GrpcPlannerClient::GetKeys(
    const std::string& job_id, const std::vector<std::string>& keys,
    std::chrono::milliseconds wait) {
  v1::GetKeysRequest req;
  req.set_job_id(job_id);
  for (const std::string& key : keys) req.add_keys(key);
  req.set_wait_ms(wait.count());
  RAGSHARD_ASSIGN_OR_RETURN(v1::GetKeysResponse resp, Call(&Stub::GetKeys, req, wait));
  if (resp.values_size() != req.keys_size()) {
    return absl::InternalError(absl::StrCat("the planner answered ", resp.values_size(),
                                            " values for ", req.keys_size(), " keys"));
  }
  return std::vector<std::string>(resp.values().begin(), resp.values().end());
}

absl::StatusOr<v1::ReportFailureResponse> GrpcPlannerClient::ReportFailure(
    const v1::ReportFailureRequest& request) {
  return CallOnce(&Stub::ReportFailure, request);
}

absl::StatusOr<v1::ReportRecoveredResponse> GrpcPlannerClient::ReportRecovered(
    const v1::ReportRecoveredRequest& request) {
  return Call(&Stub::ReportRecovered, request);
}

absl::Status GrpcPlannerClient::Health() {
  auto stub = grpc::health::v1::Health::NewStub(channel_);
  grpc::health::v1::HealthCheckRequest req;
  grpc::health::v1::HealthCheckResponse resp;
  grpc::ClientContext ctx;
  Prepare(&ctx);
  grpc::Status st = stub->Check(&ctx, req, &resp);
  if (!st.ok()) return Wrap(st);
  if (resp.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
    return absl::UnavailableError(absl::StrCat("planner at ", options_.address, " not serving"));
  }
  return absl::OkStatus();
}

v1::CreateJobRequest MakeCreateJobRequest(const JobSpec& spec) {
  v1::CreateJobRequest req;
  req.set_job_id(spec.job_id);
  req.mutable_mesh()->set_shard_size(spec.shard_size);
  req.mutable_mesh()->set_replicate_size(spec.replicate_size);
  v1::JobOptions* o = req.mutable_options();
  o->set_policy(spec.policy);
  o->set_default_granule(spec.default_granule);
  o->set_align_bytes(spec.align_bytes);
  o->set_registration_timeout_ms(spec.registration_timeout_ms);
  o->set_strategy(spec.strategy);
  o->set_optimizer(spec.optimizer);
  o->set_memory_budget_bytes(spec.memory_budget_bytes);
  o->set_tokens_per_step(spec.tokens_per_step);
  o->set_recovery_deadline_ms(spec.recovery_deadline_ms);
  o->set_redundancy(spec.redundancy);
  o->set_on_node_loss(spec.on_node_loss);
  return req;
}

}  // namespace ragshard
