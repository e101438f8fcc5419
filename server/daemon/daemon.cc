#include "server/daemon/daemon.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <deque>
#include <functional>
#include <optional>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/fd_passing.h"
#include "common/ids.h"
#include "common/rpc.h"
#include "common/unsharded_view.h"
#include "glog/logging.h"
#include "server/daemon/data_backend.h"
#include "server/daemon/ucx_comm.h"

namespace ragshard::daemon {

// One job on this node: its data plane, its UCX worker, and the thread that runs its operations.
class JobRuntime {
 public:
  JobRuntime(std::string job_id, std::string node_id, v1::Plan plan,
             std::vector<int64_t> local_ranks, std::unique_ptr<UcxWorker> worker,
             std::unique_ptr<Comm> comm, std::unique_ptr<DataBackend> dp,
             std::shared_ptr<PlannerClient> planner)
      : job_id_(std::move(job_id)),
        node_id_(std::move(node_id)),
        plan_(std::move(plan)),
        local_ranks_(std::move(local_ranks)),
        worker_(std::move(worker)),
        comm_(std::move(comm)),
        dp_(std::move(dp)),
        planner_(std::move(planner)),
        next_seq_(local_ranks_.size(), 1) {
    thread_ = std::thread([this] { Run(); });
  }

  ~JobRuntime() {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    thread_.join();
    // The data plane's leases go back to the pool before the comm and worker close.
    dp_.reset();
    comm_.reset();
    worker_.reset();
  }

  const v1::Plan& plan() const { return plan_; }
  const std::vector<int64_t>& local_ranks() const { return local_ranks_; }
  const DataBackend& dp() const { return *dp_; }
  void FillStats(v1::JobStats* out) {
    absl::MutexLock lock(&mu_);
    out->set_job_id(job_id_);
    out->set_local_ranks(static_cast<int64_t>(local_ranks_.size()));
    out->set_replicas(dp_->replicas());
    out->set_staging_bytes(staging_bytes_);
    out->set_operations(operations_);
  }

  absl::StatusOr<uint64_t> StartOp(int local, const v1::StartRequest& req) {
    absl::MutexLock lock(&mu_);
    if (!failed_.ok()) return failed_;
    if (req.kind() == v1::OP_NOOP) return uint64_t{0};
    if (!departed_.empty()) {
      absl::Status error = absl::UnavailableError(absl::StrCat(
          "rank ", departed_.begin()->second, " of job '", job_id_, "' on node '", node_id_,
          "' detached (its process exited); collective operations cannot run until it attaches "
          "again"));
      // The job thread tells the planner (a gRPC handler must not block on it).
      if (!departure_reported_) {
        departure_reported_ = true;
        report_ = error;
      }
      return error;
    }
    if (req.unit_index() < 0 || req.unit_index() >= dp_->units()) {
      return absl::InvalidArgumentError(absl::StrCat("unit_index: ", req.unit_index(),
                                                     " is not a unit of job '", job_id_,
                                                     "' (it has ", dp_->units(), ")"));
    }
    const uint64_t seq = next_seq_[local]++;
    Op& op = ops_[seq];
    if (op.started == 0) {
      op.kind = req.kind();
      op.unit = req.unit_index();
      op.reduce = req.reduce();
      op.keep = req.keep_ranks();
      op.deadline =
          absl::Now() + absl::Milliseconds(req.timeout_ms() > 0 ? req.timeout_ms() : 60000);
    } else if (op.kind != req.kind() || op.unit != req.unit_index() || op.reduce != req.reduce() ||
               op.keep != req.keep_ranks()) {
      op.status = absl::FailedPreconditionError(absl::StrCat(
          "local ranks disagree on operation ", seq, ": ", v1::OpKind_Name(op.kind), " of unit ",
          op.unit, " against ", v1::OpKind_Name(req.kind()), " of unit ", req.unit_index()));
      op.done = true;
      // The job cannot go on: the job thread tells the other nodes and the planner.
      if (abort_.ok()) abort_ = op.status;
      return seq;
    }
    if (++op.started == static_cast<int>(local_ranks_.size()) && !op.done) queue_.push_back(seq);
    return seq;
  }

  // A local rank detached (its process exited or called Detach): the operations that wait for
  // it to start can never run. They fail now, naming the rank, and the planner hears of it.
  void LocalRankLeft(int local, int64_t rank) {
    absl::Status error;
    {
      absl::MutexLock lock(&mu_);
      departed_[local] = rank;
      for (auto& [seq, op] : ops_) {
        if (op.done || op.started == 0 || seq < next_seq_[local]) continue;
        if (error.ok()) {
          departure_reported_ = true;
          error = absl::UnavailableError(
              absl::StrCat("rank ", rank, " of job '", job_id_, "' on node '", node_id_,
                           "' detached (its process exited) before starting operation ", seq));
        }
        op.done = true;
        op.status = error;
      }
    }
    if (error.ok()) return;
    LOG(ERROR) << error;
    Report(error);
    ServeWaiters();
  }

  // Tells the planner that the job cannot proceed (it turns the job DEGRADED).
  void Report(const absl::Status& error) {
    v1::ReportFailureRequest report;
    report.set_job_id(job_id_);
    report.set_reporter_node_id(node_id_);
    report.set_lost_peer(std::string(error.message()).substr(0, 256));
    report.set_message(std::string(error.message()).substr(0, 1024));
    if (absl::Status r = planner_->ReportFailure(report); !r.ok()) {
      LOG(WARNING) << "reporting the failure to the planner: " << r;
    }
  }

  // A new process attached for local rank `local`.
  void Rejoined(int local) {
    absl::MutexLock lock(&mu_);
    departed_.erase(local);
    if (departed_.empty()) departure_reported_ = false;
  }

  // Calls `done(true, status, placement)` once the operation completes (placement: where local
  // rank `local`'s buffers of the operation's unit are then, or nullptr), or `done(false, OK,
  // nullptr)` at `deadline`. Never blocks; `done` runs on the job's thread or the caller's,
  // never under the job's mutex.
  using WaitCallback = std::function<void(bool, absl::Status, const v1::UnitBuffers*)>;
  void AddWaiter(uint64_t seq, int local, absl::Time deadline, WaitCallback done) {
    bool finished = true;
    absl::Status status;
    v1::UnitBuffers placement;
    bool placed = false;
    if (seq != 0) {  // 0 is a no-op, done at once
      absl::MutexLock lock(&mu_);
      auto it = ops_.find(seq);
      if (it == ops_.end()) {
        status = absl::NotFoundError(absl::StrCat("no operation ", seq, " in job '", job_id_, "'"));
      } else if (it->second.done) {
        status = it->second.status;
        if (static_cast<size_t>(local) < it->second.placements.size()) {
          placement = it->second.placements[local];
          placed = true;
        }
        Waited(it);
      } else if (deadline > absl::Now()) {
        it->second.waiters.push_back({deadline, local, std::move(done)});
        return;
      } else {
        finished = false;  // a poll of an operation still running
      }
    }
    done(finished, status, placed ? &placement : nullptr);
  }

 private:
  struct Op {
    v1::OpKind kind = v1::OP_KIND_UNSPECIFIED;
    int unit = 0;
    v1::ReduceKind reduce = v1::REDUCE_SUM;
    int64_t keep = 0;
    absl::Time deadline;
    int started = 0;
    int waited = 0;
    bool done = false;
    absl::Status status;
    std::vector<v1::UnitBuffers> placements;  // by local rank, once done without error
    struct Waiter {
      absl::Time deadline;
      int local;
      WaitCallback done;
    };
    std::vector<Waiter> waiters;
  };

  static ReduceOp ToReduceOp(v1::ReduceKind k) {
    return k == v1::REDUCE_AVG ? ReduceOp::kAvg : ReduceOp::kSum;
  }

  // Operations queued behind a failure fail the same way.
  void FailQueued() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (uint64_t q : queue_) {
      ops_[q].done = true;
      ops_[q].status = failed_;
    }
    queue_.clear();
  }

  void Waited(std::map<uint64_t, Op>::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (++it->second.waited >= static_cast<int>(local_ranks_.size())) ops_.erase(it);
  }

  // Resolves the waiters of finished operations and expires the others; the callbacks run after
  // the mutex is released.
  void ServeWaiters() {
    std::vector<std::function<void()>> calls;
    {
      absl::MutexLock lock(&mu_);
      const absl::Time now = absl::Now();
      for (auto it = ops_.begin(); it != ops_.end();) {
        auto next = std::next(it);
        Op& op = it->second;
        std::vector<Op::Waiter> keep;
        int resolved = 0;
        for (Op::Waiter& w : op.waiters) {
          if (op.done) {
            std::optional<v1::UnitBuffers> placement;
            if (static_cast<size_t>(w.local) < op.placements.size()) {
              placement = op.placements[w.local];
            }
            calls.push_back([cb = std::move(w.done), st = op.status, placement] {
              cb(true, st, placement ? &*placement : nullptr);
            });
            ++resolved;
          } else if (w.deadline <= now) {
            calls.push_back([cb = std::move(w.done)] { cb(false, absl::OkStatus(), nullptr); });
          } else {
            keep.push_back(std::move(w));
          }
        }
        op.waiters = std::move(keep);
        if (resolved > 0) {
          op.waited += resolved - 1;
          Waited(it);
        }
        it = next;
      }
    }
    for (auto& c : calls) c();
  }

  void Run() {
    while (true) {
      uint64_t seq = 0;
      Op op;
      {
        absl::MutexLock lock(&mu_);
        auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return stopping_ || !queue_.empty() || (!abort_.ok() && failed_.ok());
        };
        mu_.AwaitWithTimeout(absl::Condition(&ready), absl::Milliseconds(50));
        if (stopping_) return;
        if (!report_.ok()) {
          absl::Status r = std::exchange(report_, absl::OkStatus());
          mu_.Unlock();
          Report(r);
          mu_.Lock();
        }
        if (!abort_.ok() && failed_.ok()) {
          failed_ = abort_;
          FailQueued();
          const absl::Status a = abort_;
          mu_.Unlock();
          LOG(ERROR) << "job " << job_id_ << ": " << a;
          if (comm_ != nullptr) comm_->Abort(std::string(a.message()));
          Report(a);
          ServeWaiters();
          mu_.Lock();
        }
        if (queue_.empty()) continue;
        seq = queue_.front();
        queue_.pop_front();
        op = ops_[seq];
      }
      absl::Status s;
      switch (op.kind) {
        case v1::OP_UNSHARD:
          s = dp_->Unshard(op.unit, op.deadline);
          break;
        case v1::OP_ALLOCATE_UNSHARDED:
          s = dp_->AllocateUnsharded(op.unit);
          break;
        case v1::OP_RESHARD:
          s = dp_->Reshard(op.unit, op.keep);
          break;
        case v1::OP_ALLOCATE_GRAD:
          s = dp_->AllocateGrad(op.unit);
          break;
        case v1::OP_REDUCE_SCATTER:
          s = dp_->ReduceScatter(op.unit, ToReduceOp(op.reduce), op.deadline);
          break;
        case v1::OP_ALL_REDUCE:
          s = dp_->AllReduce(op.unit, ToReduceOp(op.reduce), op.deadline);
          break;
        case v1::OP_GATHER_TO_OWNER:
          s = dp_->GatherToOwner(op.unit, op.deadline);
          break;
        case v1::OP_SCATTER_FROM_OWNER:
          s = dp_->ScatterFromOwner(op.unit, op.deadline);
          break;
        default:
          s = absl::InvalidArgumentError("unknown operation kind");
      }
      std::vector<v1::UnitBuffers> placements;
      if (s.ok()) {
        placements.resize(local_ranks_.size());
        for (size_t i = 0; i < placements.size(); ++i) {
          dp_->Placement(op.unit, static_cast<int>(i), &placements[i]);
        }
      }
      // A lost peer, the deadline, or ranks that disagree (ABORTED) end the job.
      const bool fatal =
          !s.ok() && (absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s) || absl::IsAborted(s));
      if (fatal) {
        LOG(ERROR) << "job " << job_id_ << ": " << s;
        v1::ReportFailureRequest report;
        report.set_job_id(job_id_);
        report.set_reporter_node_id(node_id_);
        report.set_lost_peer(std::string(s.message()).substr(0, 256));
        report.set_message(std::string(s.message()).substr(0, 1024));
        absl::Status r = planner_->ReportFailure(report);
        if (!r.ok()) LOG(WARNING) << "reporting the failure to the planner: " << r;
      }
      {
        absl::MutexLock lock(&mu_);
        ++operations_;
        staging_bytes_ = dp_->staging_bytes();
        if (fatal) failed_ = s;
        Op& o = ops_[seq];
        o.done = true;
        o.status = s;
        o.placements = std::move(placements);
        if (!failed_.ok()) FailQueued();
      }
      ServeWaiters();
    }
    // Stopping: nobody will complete the remaining operations; answer their waiters.
    std::vector<WaitCallback> pending;
    {
      absl::MutexLock lock(&mu_);
      for (auto& [seq, op] : ops_) {
        for (auto& w : op.waiters) pending.push_back(std::move(w.done));
        op.waiters.clear();
      }
    }
    for (auto& cb : pending) cb(true, absl::AbortedError("the job was released"), nullptr);
  }

  const std::string job_id_, node_id_;
  const v1::Plan plan_;
  const std::vector<int64_t> local_ranks_;
  std::unique_ptr<UcxWorker> worker_;
  std::unique_ptr<Comm> comm_;
  std::unique_ptr<DataBackend> dp_;
  std::shared_ptr<PlannerClient> planner_;
  absl::Mutex mu_;
  std::vector<uint64_t> next_seq_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, Op> ops_ ABSL_GUARDED_BY(mu_);
  std::deque<uint64_t> queue_ ABSL_GUARDED_BY(mu_);
  absl::Status failed_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int64_t operations_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<int, int64_t> departed_ ABSL_GUARDED_BY(mu_);  // local index -> rank
  bool departure_reported_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status report_ ABSL_GUARDED_BY(mu_);  // for the job thread to send to the planner
  absl::Status abort_ ABSL_GUARDED_BY(mu_);   // for the job thread to tell the other nodes
  int64_t staging_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

namespace {

grpc::ServerUnaryReactor* Reply(grpc::CallbackServerContext* ctx, const absl::Status& s) {
  auto* r = ctx->DefaultReactor();
  r->Finish(ToGrpcStatus(s));
  return r;
}

std::string HostOf(const std::string& address) { return address.substr(0, address.rfind(':')); }

}  // namespace

absl::StatusOr<std::unique_ptr<NodeDaemon>> NodeDaemon::Start(
    DaemonOptions options, std::shared_ptr<PlannerClient> planner) {
  if (auto s = ValidateId("--node-id", options.node_id); !s.ok()) return s;
  if (options.socket_path.empty()) return absl::InvalidArgumentError("--socket: required");
  auto backend = ParseBackendKind(options.backend);
  if (!backend.ok()) return backend.status();
  if (options.gpu_pool_bytes <= 0)
    return absl::InvalidArgumentError("--gpu-pool-bytes: must be positive");
  // Page-aligned leases let the host backend map shard blocks into unsharded views
  // (HostTransport::view_fd); 256-byte ones make it place them by copying.
  auto pool = Pool::Create(options.pool_bytes, options.unsharded_views ? kViewPageBytes : 256);
  if (!pool.ok()) return pool.status();
  std::unique_ptr<NodeDaemon> d(
      new NodeDaemon(std::move(options), std::move(planner), std::move(*pool)));
  d->backend_ = ResolveBackendKind(*backend);
  ::unlink(d->options_.socket_path.c_str());
  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix:" + d->options_.socket_path, grpc::InsecureServerCredentials());
  builder.RegisterService(d.get());
  d->server_ = builder.BuildAndStart();
  if (!d->server_)
    return absl::UnavailableError("cannot listen on unix:" + d->options_.socket_path);
  if (::chmod(d->options_.socket_path.c_str(), static_cast<mode_t>(d->options_.socket_mode)) != 0) {
    return absl::PermissionDeniedError("chmod " + d->options_.socket_path);
  }
  // The side channel last: its socket appearing means the daemon is ready.
  auto fds = ListenUnix(d->options_.socket_path + ".fd", d->options_.socket_mode);
  if (!fds.ok()) return fds.status();
  d->fd_listener_ = std::move(*fds);
  v1::RegisterNodeRequest reg;
  reg.set_node_id(d->options_.node_id);
  reg.set_data_address(d->options_.data_host);
  reg.set_capacity_bytes(d->options_.pool_bytes);
  auto registered = d->planner_->RegisterNode(reg);
  if (!registered.ok()) LOG(WARNING) << "registering with the planner: " << registered.status();
  d->side_channel_ = std::thread([p = d.get()] { p->RunSideChannel(); });
  d->heartbeats_ = std::thread([p = d.get()] { p->RunHeartbeats(); });
  LOG(INFO) << "ragshardd " << d->options_.node_id << " serving unix:" << d->options_.socket_path
            << ", pool " << d->options_.pool_bytes << " bytes";
  return d;
}

NodeDaemon::NodeDaemon(DaemonOptions options, std::shared_ptr<PlannerClient> planner,
                       std::unique_ptr<Pool> pool)
    : options_(std::move(options)), planner_(std::move(planner)), pool_(std::move(pool)) {}

NodeDaemon::~NodeDaemon() { Shutdown(); }

void NodeDaemon::Shutdown() {
  std::list<AttachThread> attaching;
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    shut_down_ = true;
    attaching.swap(attach_threads_);
  }
  for (auto& t : attaching) t.thread.join();
  stop_.Notify();
  if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  if (side_channel_.joinable()) side_channel_.join();
  if (heartbeats_.joinable()) heartbeats_.join();
  absl::MutexLock lock(&mu_);
  attachments_.clear();
  jobs_.clear();
  ::unlink(options_.socket_path.c_str());
  ::unlink((options_.socket_path + ".fd").c_str());
}

void NodeDaemon::Wait() {
  if (server_) server_->Wait();
}

absl::StatusOr<std::shared_ptr<JobRuntime>> NodeDaemon::GetOrCreateJob(const std::string& job_id,
                                                                       int64_t rank,
                                                                       absl::Time deadline) {
  absl::MutexLock setup(&setup_mu_);
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job_id);
    if (it != jobs_.end()) return it->second;
  }
  auto plan = planner_->WaitForPlan(job_id, absl::ToChronoMilliseconds(deadline - absl::Now()));
  if (!plan.ok()) return plan.status();
  auto job = planner_->GetJob(job_id);
  if (!job.ok()) return job.status();
  if (rank >= job->world_size() ||
      job->ranks(static_cast<int>(rank)).node_id() != options_.node_id) {
    return absl::FailedPreconditionError(absl::StrCat("rank ", rank, " of job '", job_id,
                                                      "' is not on node '", options_.node_id, "'"));
  }
  std::vector<int64_t> local;
  std::vector<std::string> nodes;
  for (const auto& r : job->ranks()) {
    if (r.node_id() == options_.node_id) local.push_back(r.rank());
    if (std::find(nodes.begin(), nodes.end(), r.node_id()) == nodes.end())
      nodes.push_back(r.node_id());
  }
  if (local.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("job '", job_id, "' has no ranks on node '", options_.node_id, "'"));
  }
  std::unique_ptr<UcxWorker> worker;
  std::unique_ptr<Comm> comm;
  if (nodes.size() > 1) {
    auto w = UcxWorker::Create(options_.data_host, 0);
    if (!w.ok()) return w.status();
    worker = std::move(*w);
    absl::Status s = planner_->Put(job_id, "data/" + options_.node_id, worker->address());
    if (!s.ok()) return s;
    std::vector<std::string> addresses;
    std::set<std::string> hosts;
    int me = 0;
    for (size_t i = 0; i < nodes.size(); ++i) {
      if (nodes[i] == options_.node_id) me = static_cast<int>(i);
      auto a = planner_->Get(
          job_id, "data/" + nodes[i],
          absl::ToChronoMilliseconds(std::max(deadline - absl::Now(), absl::Milliseconds(1))));
      if (!a.ok()) {
        return absl::Status(a.status().code(),
                            absl::StrCat("waiting for node '", nodes[i],
                                         "' to publish its data address: ", a.status().message()));
      }
      addresses.push_back(*a);
      hosts.insert(HostOf(*a));
    }
    worker->AllowPeerHosts(hosts);  // only the job's peers may connect
    auto c = worker->Connect(me, addresses, deadline, job_id);
    if (!c.ok()) return c.status();
    comm = std::move(*c);
  }
  BackendContext context;
  context.plan = &*plan;
  context.local_ranks = local;
  context.replicas = std::max<int64_t>(job->mesh().replicate_size(), 1);
  context.host_pool = pool_.get();
  context.nodes = comm.get();
  context.node_count = static_cast<int>(nodes.size());
  context.put = [this, &job_id](const std::string& key, const std::string& value) {
    return planner_->Put(job_id, key, value);
  };
  context.get = [this, &job_id, deadline](const std::string& key) {
    return planner_->Get(
        job_id, key,
        absl::ToChronoMilliseconds(std::max(deadline - absl::Now(), absl::Milliseconds(1))));
  };
  context.deadline = deadline;
  context.gpu_pool_bytes = options_.gpu_pool_bytes;
  auto dp = CreateDataBackend(backend_, context);
  if (!dp.ok()) return dp.status();
  auto runtime =
      std::make_shared<JobRuntime>(job_id, options_.node_id, std::move(*plan), local,
                                   std::move(worker), std::move(comm), std::move(*dp), planner_);
  absl::MutexLock lock(&mu_);
  jobs_[job_id] = runtime;
  LOG(INFO) << "job " << job_id << ": " << local.size() << " local rank(s), " << nodes.size()
            << " node(s), " << runtime->dp().name() << " backend, buffers allocated";
  return runtime;
}

grpc::ServerUnaryReactor* NodeDaemon::Attach(grpc::CallbackServerContext* ctx,
                                             const v1::AttachRequest* req,
                                             v1::AttachResponse* resp) {
  if (auto s = ValidateId("job_id", req->job_id()); !s.ok()) return Reply(ctx, s);
  if (req->rank() < 0) return Reply(ctx, absl::InvalidArgumentError("rank: must not be negative"));
  // Setting a job up waits for the plan and for the peers, so it runs on a thread of its own
  // rather than blocking one of gRPC's callback threads.
  auto* reactor = ctx->DefaultReactor();
  absl::MutexLock lock(&mu_);
  if (shut_down_) {
    reactor->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "daemon shutting down"));
    return reactor;
  }
  // Join the setups that have finished (their threads only return after setting `done`).
  for (auto it = attach_threads_.begin(); it != attach_threads_.end();) {
    if (it->done->load()) {
      it->thread.join();
      it = attach_threads_.erase(it);
    } else {
      ++it;
    }
  }
  if (attach_threads_.size() >= kMaxAttaching) {
    reactor->Finish(
        grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                     absl::StrCat(attach_threads_.size(), " attaches are in progress on node '",
                                  options_.node_id, "', the most it sets up at once; retry")));
    return reactor;
  }
  auto done = std::make_shared<std::atomic<bool>>(false);
  attach_threads_.push_back({std::thread([this, req, resp, reactor, done] {
                               reactor->Finish(ToGrpcStatus(DoAttach(*req, resp)));
                               done->store(true);
                             }),
                             done});
  return reactor;
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
  if (job != nullptr) job->LocalRankLeft(a.local, a.rank);
}

grpc::ServerUnaryReactor* NodeDaemon::Detach(grpc::CallbackServerContext* ctx,
                                             const v1::DetachRequest* req, v1::DetachResponse*) {
  {
    absl::MutexLock lock(&mu_);
    if (attachments_.count(req->attachment_id()) == 0) {
      return Reply(ctx, absl::NotFoundError(
                            absl::StrCat("unknown attachment '", req->attachment_id(), "'")));
    }
  }
  ReleaseAttachment(req->attachment_id());
  return Reply(ctx, absl::OkStatus());
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

grpc::ServerUnaryReactor* NodeDaemon::Start(grpc::CallbackServerContext* ctx,
                                            const v1::StartRequest* req, v1::StartResponse* resp) {
  auto found = FindAttachment(req->attachment_id());
  if (!found.ok()) return Reply(ctx, found.status());
  auto seq = found->first->StartOp(found->second, *req);
  if (!seq.ok()) return Reply(ctx, seq.status());
  resp->set_handle(*seq);
  return Reply(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* NodeDaemon::Wait(grpc::CallbackServerContext* ctx,
                                           const v1::WaitRequest* req, v1::WaitResponse* resp) {
  auto found = FindAttachment(req->attachment_id());
  if (!found.ok()) return Reply(ctx, found.status());
  auto* reactor = ctx->DefaultReactor();
  found->first->AddWaiter(
      req->handle(), found->second,
      absl::Now() + absl::Milliseconds(std::max<int64_t>(req->timeout_ms(), 0)),
      [reactor, resp](bool done, absl::Status status, const v1::UnitBuffers* placement) {
        resp->set_done(done);
        if (placement != nullptr) *resp->mutable_placement() = *placement;
        reactor->Finish(ToGrpcStatus(status));
      });
  return reactor;
}

grpc::ServerUnaryReactor* NodeDaemon::NoOp(grpc::CallbackServerContext* ctx, const v1::NoOpRequest*,
                                           v1::NoOpResponse*) {
  return Reply(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* NodeDaemon::Stats(grpc::CallbackServerContext* ctx,
                                            const v1::StatsRequest*, v1::StatsResponse* resp) {
  const PoolStats ps = pool_->Stats();
  resp->set_pool_capacity(ps.capacity);
  resp->set_pool_used(ps.used);
  resp->set_pool_peak(ps.peak);
  resp->set_pool_fragmentation(ps.fragmentation);
  std::vector<std::shared_ptr<JobRuntime>> jobs;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, job] : jobs_) jobs.push_back(job);
  }
  for (auto& job : jobs) job->FillStats(resp->add_jobs());
  return Reply(ctx, absl::OkStatus());
}

void NodeDaemon::RunSideChannel() {
  // Clients connect, send their attachment id and receive the arena's memfd. The connection
  // stays open while the client lives; its end releases the attachment.
  std::map<int, std::pair<ScopedFd, std::string>> clients;
  while (!stop_.HasBeenNotified()) {
    std::vector<pollfd> fds = {{fd_listener_.get(), POLLIN, 0}};
    for (auto& [fd, c] : clients) fds.push_back({fd, POLLIN, 0});
    if (::poll(fds.data(), fds.size(), 100) <= 0) continue;
    if (fds[0].revents & POLLIN) {
      ScopedFd conn(::accept4(fd_listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
      if (conn.valid()) {
        timeval tv{2, 0};
        ::setsockopt(conn.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
        auto msg = ReceiveWithFds(conn.get(), 0);
        bool known = false;
        if (msg.ok()) {
          absl::MutexLock lock(&mu_);
          known = attachments_.count(msg->payload) > 0;
        }
        if (known && SendWithFds(conn.get(), "ok", {pool_->arena().fd()}).ok()) {
          const int fd = conn.get();
          clients[fd] = {std::move(conn), msg->payload};
        } else {
          (void)SendWithFds(conn.get(), "error: unknown attachment", {});
        }
      }
    }
    for (size_t i = 1; i < fds.size(); ++i) {
      if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) {
        char buf[64];
        if (::recv(fds[i].fd, buf, sizeof(buf), MSG_DONTWAIT) <= 0) {
          auto it = clients.find(fds[i].fd);
          ReleaseAttachment(it->second.second);
          clients.erase(it);
        }
      }
    }
  }
}

void NodeDaemon::RunHeartbeats() {
  while (!stop_.WaitForNotificationWithTimeout(absl::FromChrono(options_.heartbeat_interval))) {
    v1::HeartbeatRequest hb;
    hb.set_node_id(options_.node_id);
    PoolStats s = pool_->Stats();
    auto* f = hb.mutable_figures();
    f->set_pool_capacity_bytes(s.capacity);
    f->set_pool_used_bytes(s.used);
    f->set_pool_peak_bytes(s.peak);
    f->set_pool_fragmentation(s.fragmentation);
    f->set_buffers(s.leases);
    {
      absl::MutexLock lock(&mu_);
      for (const auto& [id, job] : jobs_) hb.add_jobs(id);
      f->set_attachments(static_cast<int64_t>(attachments_.size()));
    }
    auto resp = planner_->Heartbeat(hb);
    if (!resp.ok()) {
      if (absl::IsNotFound(resp.status())) {
        v1::RegisterNodeRequest reg;
        reg.set_node_id(options_.node_id);
        reg.set_data_address(options_.data_host);
        reg.set_capacity_bytes(options_.pool_bytes);
        (void)planner_->RegisterNode(reg);
      } else {
        LOG_EVERY_N(WARNING, 10) << "heartbeat: " << resp.status();
      }
      continue;
    }
    for (const std::string& job : resp->release_jobs()) {
      std::shared_ptr<JobRuntime> gone;
      {
        absl::MutexLock lock(&mu_);
        auto it = jobs_.find(job);
        if (it == jobs_.end()) continue;
        gone = std::move(it->second);
        jobs_.erase(it);
        for (auto a = attachments_.begin(); a != attachments_.end();) {
          a = a->second.job_id == job ? attachments_.erase(a) : std::next(a);
        }
      }
      gone.reset();  // joins the job thread and returns its buffers to the pool
      LOG(INFO) << "job " << job << " deleted by the planner: buffers released";
    }
  }
}

}  // namespace ragshard::daemon
