#include "server/daemon/daemon.h"

#include <grp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "infra/ids.h"
#include "infra/rpc.h"
#include "protocol/fd_passing.h"
#include "protocol/unsharded_view.h"
#include "server/daemon/job_runtime.h"

namespace ragshard::daemon {
namespace {

absl::StatusOr<gid_t> GroupId(const std::string& name) {
  group entry{};
  group* found = nullptr;
  std::vector<char> buf(16384);
  const int err = ::getgrnam_r(name.c_str(), &entry, buf.data(), buf.size(), &found);
  if (err != 0 || found == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--socket-group '", name, "': ", err != 0 ? std::strerror(err) : "no such group"));
  }
  return found->gr_gid;
}

// Gives socket `path` to `group` (nothing to do for -1).
absl::Status GiveToGroup(const std::string& path, gid_t group) {
  if (group == static_cast<gid_t>(-1)) return absl::OkStatus();
  if (::chown(path.c_str(), static_cast<uid_t>(-1), group) != 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("--socket-group: chown '", path, "': ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<NodeDaemon>> NodeDaemon::Start(
    DaemonOptions options, std::shared_ptr<PlannerClient> planner) {
  if (auto s = ValidateId("--node-id", options.node_id); !s.ok()) return s;
  if (options.socket_path.empty()) return absl::InvalidArgumentError("--socket: required");
  if (!options.metrics_listen.empty()) {
    if (auto a = MetricsBindAddress(options.metrics_listen); !a.ok()) return a.status();
  }
  gid_t group = static_cast<gid_t>(-1);
  if (!options.socket_group.empty()) {
    auto gid = GroupId(options.socket_group);
    if (!gid.ok()) return gid.status();
    group = *gid;
    options.socket_mode = 0660;
  }
  auto requested = ParseBackendKind(options.backend);
  if (!requested.ok()) return requested.status();
  // Before anything is allocated or listens: --backend=cuda that cannot run is an error.
  auto backend = ResolveBackendKind(*requested);
  if (!backend.ok()) return backend.status();
  if (options.gpu_pool_bytes <= 0)
    return absl::InvalidArgumentError("--gpu-pool-bytes: must be positive");
  // Page-aligned leases let the host backend map shard blocks into unsharded views
  // (HostTransport::view_fd); 256-byte ones make it place them by copying.
  auto pool = Pool::Create(options.pool_bytes, options.unsharded_views ? kViewPageBytes : 256,
                           size_t{1} << 16, options.pool_commit);
  if (!pool.ok()) return pool.status();
  std::unique_ptr<NodeDaemon> d(
      new NodeDaemon(std::move(options), std::move(planner), std::move(*pool)));
  d->backend_ = *backend;
  d->socket_gid_ = group;
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
  if (absl::Status s = GiveToGroup(d->options_.socket_path, group); !s.ok()) return s;
  if (!d->options_.metrics_listen.empty()) {
    auto endpoint = MetricsEndpoint::Start(d->options_.metrics_listen);
    if (!endpoint.ok()) return endpoint.status();
    d->endpoint_ = std::move(*endpoint);
    NodeDaemon* daemon = d.get();
    d->scrape_ = std::make_shared<ScrapeCollectable>([daemon] { return daemon->ScrapeFigures(); });
    d->endpoint_->Register(d->metrics_->registry());
    d->endpoint_->Register(d->scrape_);
    LOG(INFO) << "ragshardd " << d->options_.node_id << " metrics on " << d->endpoint_->url();
  }
  // The side channel last: its socket appearing means the daemon is ready (given to the group
  // under a temporary name first, so that it appears ready only once the group may attach).
  const std::string side = d->options_.socket_path + ".fd";
  auto fds = ListenUnix(side + ".new", d->options_.socket_mode);
  if (!fds.ok()) return fds.status();
  if (absl::Status s = GiveToGroup(side + ".new", group); !s.ok()) return s;
  if (::rename((side + ".new").c_str(), side.c_str()) != 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("rename to '", side, "': ", std::strerror(errno)));
  }
  d->fd_listener_ = std::move(*fds);
  CommandPoller::Options po;
  po.spin = d->options_.queue_spin;
  auto poller = CommandPoller::Create(
      po, [metrics = d->metrics_](const absl::Status& s) { metrics->Error(s); });
  if (!poller.ok()) return poller.status();
  d->poller_ = std::move(*poller);
  auto registered = d->planner_->RegisterNode(d->Registration());
  if (!registered.ok()) LOG(WARNING) << "registering with the planner: " << registered.status();
  d->side_channel_ = std::thread([p = d.get()] { p->RunSideChannel(); });
  d->heartbeats_ = std::thread([p = d.get()] { p->RunHeartbeats(); });
  d->waiter_clock_ = std::thread([p = d.get()] { p->RunWaiterClock(); });
  LOG(INFO) << "ragshardd " << d->options_.node_id << " serving unix:" << d->options_.socket_path
            << ", pool " << d->options_.pool_bytes << " bytes";
  return d;
}

NodeDaemon::NodeDaemon(DaemonOptions options, std::shared_ptr<PlannerClient> planner,
                       std::unique_ptr<Pool> pool)
    : options_(std::move(options)), planner_(std::move(planner)), pool_(std::move(pool)) {
  std::random_device random;
  while (incarnation_ == 0) {
    incarnation_ = (static_cast<uint64_t>(random()) << 32) | static_cast<uint64_t>(random());
  }
}

v1::RegisterNodeRequest NodeDaemon::Registration() const {
  v1::RegisterNodeRequest reg;
  reg.set_node_id(options_.node_id);
  reg.set_data_address(options_.data_host);
  reg.set_capacity_bytes(options_.pool_bytes);
  reg.set_incarnation(incarnation_);
  return reg;
}

NodeDaemon::~NodeDaemon() { Shutdown(); }

void NodeDaemon::Shutdown() {
  std::list<AttachThread> attaching;
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    shut_down_ = true;
    attaching.swap(attach_threads_);
  }
  endpoint_.reset();  // no scrape reads the daemon from here on
  // Held registrations are answered (again after the server stops: one may come in between).
  auto answer_held = [this] {
    for (auto& done : registrations_.TakeAll()) {
      done(absl::UnavailableError(
          absl::StrCat("the daemon of node '", options_.node_id, "' is shutting down")));
    }
  };
  answer_held();
  for (auto& t : attaching) t.thread.join();
  stop_.Notify();
  if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  answer_held();
  if (side_channel_.joinable()) side_channel_.join();
  if (heartbeats_.joinable()) heartbeats_.join();
  if (waiter_clock_.joinable()) waiter_clock_.join();
  poller_.reset();
  absl::MutexLock lock(&mu_);
  attachments_.clear();
  jobs_.clear();
  ::unlink(options_.socket_path.c_str());
  ::unlink((options_.socket_path + ".fd").c_str());
}

void NodeDaemon::Wait() {
  if (server_) server_->Wait();
}

grpc::ServerUnaryReactor* NodeDaemon::Start(Ctx* ctx, const v1::StartRequest* req,
                                            v1::StartResponse* resp) {
  auto found = FindAttachment(req->attachment_id());
  if (!found.ok()) return ReplyUnary(ctx, found.status());
  auto op = MakeOpRequest(*req);
  if (!op.ok()) return ReplyUnary(ctx, op.status());
  auto seq = found->first->StartOp(found->second, *op);
  if (!seq.ok()) return ReplyUnary(ctx, seq.status());
  resp->set_handle(*seq);
  return ReplyUnary(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* NodeDaemon::Wait(Ctx* ctx, const v1::WaitRequest* req,
                                           v1::WaitResponse* resp) {
  auto found = FindAttachment(req->attachment_id());
  if (!found.ok()) return ReplyUnary(ctx, found.status());
  auto* reactor = ctx->DefaultReactor();
  found->first->AddWaiter(req->handle(), found->second,
                          absl::Now() + absl::Milliseconds(std::max<int64_t>(req->timeout_ms(), 0)),
                          [reactor, resp](bool done, const absl::Status& status,
                                          const v1::UnitBuffers* placement, OpTimes) {
                            resp->set_done(done);
                            if (placement != nullptr) *resp->mutable_placement() = *placement;
                            reactor->Finish(ToGrpcStatus(status));
                          });
  return reactor;
}

grpc::ServerUnaryReactor* NodeDaemon::NoOp(Ctx* ctx, const v1::NoOpRequest*, v1::NoOpResponse*) {
  return ReplyUnary(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* NodeDaemon::Stats(Ctx* ctx, const v1::StatsRequest*,
                                            v1::StatsResponse* resp) {
  const PoolStats ps = pool_->Stats();
  resp->set_pool_capacity(ps.capacity);
  resp->set_pool_used(ps.used);
  resp->set_pool_peak(ps.peak);
  resp->set_pool_fragmentation(ps.fragmentation);
  for (auto& [id, js] : JobsSnapshot()) *resp->add_jobs() = std::move(js);
  return ReplyUnary(ctx, absl::OkStatus());
}

}  // namespace ragshard::daemon
