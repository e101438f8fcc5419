#include "client/client.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "engine/dtype.h"
#include "infra/rpc.h"
#include "protocol/fd_passing.h"

namespace ragshard {

absl::StatusOr<ClientOptions> ClientOptions::FromEnvironment() {
  ClientOptions options;
  if (const char* s = std::getenv("RAGSHARD_PEER_TIMEOUT_S"); s != nullptr) {
    double seconds = 0;
    if (!absl::SimpleAtod(s, &seconds) || !(seconds > 0) || seconds > 86400) {
      return absl::InvalidArgumentError(
          absl::StrCat("RAGSHARD_PEER_TIMEOUT_S='", s, "': expected seconds in (0, 86400]"));
    }
    options.peer_timeout = std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  }
  if (const char* q = std::getenv("RAGSHARD_COMMAND_QUEUE"); q != nullptr) {
    if (std::string(q) != "0" && std::string(q) != "1") {
      return absl::InvalidArgumentError(
          absl::StrCat("RAGSHARD_COMMAND_QUEUE='", q, "': expected 0 (gRPC only) or 1"));
    }
    options.command_queue = std::string(q) == "1";
  }
  return options;
}

absl::StatusOr<std::unique_ptr<Client>> Client::Create(ClientOptions options) {
  if (options.daemon_socket.empty()) return absl::InvalidArgumentError("daemon socket: required");
  if (!options.planner) return absl::InvalidArgumentError("planner client: required");
  if (options.rank < 0) return absl::InvalidArgumentError("rank: must not be negative");
  if (options.peer_timeout <= std::chrono::milliseconds(0)) {
    return absl::InvalidArgumentError("peer_timeout: must be positive");
  }
  std::unique_ptr<Client> c(new Client(std::move(options)));
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  c->daemon_ = v1::Daemon::NewStub(grpc::CreateCustomChannel(
      "unix:" + c->options_.daemon_socket, grpc::InsecureChannelCredentials(), args));
  return c;
}

Client::~Client() {
  queue_.reset();
  views_.clear();
  if (arena_ != nullptr) ::munmap(arena_, arena_bytes_);
  if (!attachment_.empty()) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    v1::DetachRequest req;
    req.set_attachment_id(attachment_);
    v1::DetachResponse resp;
    (void)daemon_->Detach(&ctx, req, &resp);
  }
}

absl::Status Client::Register(const Inventory& inventory, bool send_full, int64_t local_ranks) {
  if (local_ranks < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("local_ranks: must not be negative (0: not known), got ", local_ranks));
  }
  v1::RegisterRequest req;
  req.set_job_id(options_.job_id);
  req.set_rank(options_.rank);
  req.set_node_id(options_.node_id);
  req.set_local_ranks(local_ranks);
  req.set_timeout_ms(options_.timeout.count());
  if (send_full) {
    *req.mutable_inventory() = inventory;
  } else {
    req.set_inventory_sha256(InventorySha256(inventory));
  }
  v1::RegisterResponse resp;
  grpc::ClientContext ctx;
  // The node's other ranks, then the planner's answer (which may wait for another node's
  // inventory, and retries a restarting planner for a minute).
  ctx.set_deadline(std::chrono::system_clock::now() + options_.timeout + std::chrono::seconds(90));
  const grpc::Status st = daemon_->Register(&ctx, req, &resp);
  if (st.error_code() == grpc::StatusCode::UNIMPLEMENTED) {
    v1::RegisterRankRequest direct;
    direct.set_job_id(options_.job_id);
    direct.set_rank(options_.rank);
    direct.set_node_id(options_.node_id);
    if (send_full) {
      *direct.mutable_inventory() = std::move(*req.mutable_inventory());
    } else {
      direct.set_inventory_sha256(req.inventory_sha256());
    }
    return options_.planner->RegisterRank(direct).status();
  }
  if (!st.ok()) {
    absl::Status s = FromGrpcStatus(st);
    return absl::Status(s.code(), absl::StrCat("register through the daemon at ",
                                               options_.daemon_socket, ": ", s.message()));
  }
  return absl::OkStatus();
}

absl::Status Client::ReleaseSalvaged() {
  if (attachment_.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", options_.rank, " of job '", options_.job_id, "' is not attached"));
  }
  v1::DetachRequest req;
  req.set_attachment_id(attachment_);
  req.set_release_salvaged(true);
  v1::DetachResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + options_.timeout);
  const grpc::Status st = daemon_->Detach(&ctx, req, &resp);
  if (st.ok() || st.error_code() == grpc::StatusCode::NOT_FOUND) attachment_.clear();
  if (st.ok()) return absl::OkStatus();
  const absl::Status s = FromGrpcStatus(st);
  return absl::Status(s.code(),
                      absl::StrCat("release job '", options_.job_id, "' at the daemon at ",
                                   options_.daemon_socket, ": ", s.message()));
}

absl::Status Client::Attach(bool salvage) {
  v1::AttachRequest req;
  req.set_job_id(options_.job_id);
  req.set_rank(options_.rank);
  req.set_timeout_ms(options_.timeout.count());
  req.set_salvage(salvage);
  v1::AttachResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + options_.timeout + std::chrono::seconds(5));
  grpc::Status st = daemon_->Attach(&ctx, req, &resp);
  if (!st.ok()) {
    absl::Status s = FromGrpcStatus(st);
    return absl::Status(s.code(), absl::StrCat("attach to the daemon at ", options_.daemon_socket,
                                               ": ", s.message()));
  }
  attachment_ = resp.attachment_id();
  plan_ = resp.plan();
  buffers_.assign(resp.units().begin(), resp.units().end());
  replicas_ = std::max<int64_t>(resp.replicas(), 1);
  positions_ = resp.positions();
  backend_ = resp.backend().empty() ? "host" : resp.backend();
  cuda_device_ = resp.cuda_device();
  cuda_ipc_handle_ = resp.cuda_ipc_handle();
  recovery_epoch_ = resp.recovery_epoch();
  adopted_ = resp.adopted();
  redundancy_ = resp.redundancy();
  replacement_ = resp.replacement();
  recoverable_ = resp.recoverable();
  auto conn = ConnectUnix(options_.daemon_socket + ".fd");
  if (!conn.ok()) return conn.status();
  side_channel_ = std::move(*conn);
  absl::Status s = SendWithFds(
      side_channel_.get(),
      options_.command_queue && !salvage ? absl::StrCat(kQueueRequest, attachment_) : attachment_,
      {});
  if (!s.ok()) return s;
  // The arena's memfd; then, from a daemon that offers one, the command queue's memfd and the
  // daemon's doorbell.
  auto got = ReceiveWithFds(side_channel_.get(), 3);
  if (!got.ok()) return got.status();
  if (got->payload != "ok" || (got->fds.size() != 1 && got->fds.size() != 3)) {
    return absl::FailedPreconditionError(
        absl::StrCat("daemon refused the descriptor: ", got->payload));
  }
  if (got->fds.size() == 3) {
    RankQueueOptions q;
    q.daemon = absl::StrCat("the daemon of node '", options_.node_id,
                            "' (unix:", options_.daemon_socket, ")");
    q.peer_timeout = options_.peer_timeout;
    auto queue = RankQueue::Open(std::move(got->fds[1]), std::move(got->fds[2]),
                                 side_channel_.get(), std::move(q));
    if (!queue.ok()) return queue.status();
    queue_ = std::move(*queue);
  }
  arena_bytes_ = static_cast<size_t>(resp.arena_bytes());
  void* p = ::mmap(nullptr, arena_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, got->fds[0].get(), 0);
  if (p == MAP_FAILED)
    return absl::InternalError(absl::StrCat("mmap arena: ", std::strerror(errno)));
  arena_ = static_cast<char*>(p);
  arena_fd_ = std::move(got->fds[0]);  // unsharded views map parts of it
  for (int u = 0; u < units(); ++u) {
    if (absl::Status s = MapUnshardedView(u); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status Client::CheckHostBuffers() const {
  if (arena_ == nullptr) return absl::FailedPreconditionError("not attached");
  if (backend_ == "cuda") {
    return absl::FailedPreconditionError(
        absl::StrCat("the job's buffers are on CUDA device ", cuda_device_, " (backend '", backend_,
                     "'): open cuda_ipc_handle() with cudaIpcOpenMemHandle and add "
                     "the buffers' offsets; host views exist only for the host backend"));
  }
  return absl::OkStatus();
}

absl::Status Client::CheckView(int unit, size_t item, bool (*matches)(v1::DType)) const {
  if (absl::Status s = CheckHostBuffers(); !s.ok()) return s;
  if (unit < 0 || unit >= units()) {
    return absl::InvalidArgumentError(
        absl::StrCat("unit ", unit, " does not exist (", units(), " units)"));
  }
  const v1::DType d = buffers_[unit].dtype();
  if (!matches(d) || item != static_cast<size_t>(DTypeSize(d))) {
    return absl::InvalidArgumentError(absl::StrCat("unit '", buffers_[unit].unit(), "' holds ",
                                                   DTypeName(d),
                                                   "; the view's element type does not match"));
  }
  return absl::OkStatus();
}

absl::StatusOr<absl::Span<float>> Client::GradShard(int unit) {
  if (absl::Status s = CheckHostBuffers(); !s.ok()) return s;
  if (unit < 0 || unit >= units()) {
    return absl::InvalidArgumentError(
        absl::StrCat("unit ", unit, " does not exist (", units(), " units)"));
  }
  // The g layout's shard (a daemon that predates separate factors leaves it 0: p = g).
  const v1::UnitBuffers& b = buffers_[unit];
  const int64_t elems = b.grad_shard_elems() > 0 ? b.grad_shard_elems() : b.shard_elems();
  return absl::Span<float>(reinterpret_cast<float*>(arena_ + b.grad_shard_offset()),
                           static_cast<size_t>(elems));
}

absl::StatusOr<absl::Span<float>> Client::OwnerBuffer(int unit) {
  if (absl::Status s = CheckHostBuffers(); !s.ok()) return s;
  if (unit < 0 || unit >= units()) {
    return absl::InvalidArgumentError(
        absl::StrCat("unit ", unit, " does not exist (", units(), " units)"));
  }
  if (buffers_[unit].owner_elems() == 0) {
    return absl::NotFoundError(absl::StrCat(
        "rank ", options_.rank, " owns no matrix tensor of unit '", buffers_[unit].unit(), "'"));
  }
  if (absl::Status s = CheckAllocated(unit, buffers_[unit].owner_offset(), "owner buffer",
                                      "gather_to_owner to scatter_from_owner");
      !s.ok()) {
    return s;
  }
  return absl::Span<float>(reinterpret_cast<float*>(arena_ + buffers_[unit].owner_offset()),
                           static_cast<size_t>(buffers_[unit].owner_elems()));
}

absl::Status Client::CheckAllocated(int unit, int64_t offset, const char* what,
                                    const char* op) const {
  if (offset >= 0) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat("unit '", buffers_[unit].unit(), "' has no ",
                                                    what, " now: they exist from ", op,
                                                    " (transient buffers, docs/daemon.md)"));
}

absl::Status Client::Place(int unit, const v1::UnitBuffers& placement) {
  if (unit < 0 || unit >= units()) return absl::OkStatus();
  v1::UnitBuffers& b = buffers_[unit];
  b.set_unsharded_offset(placement.unsharded_offset());
  b.set_grad_offset(placement.grad_offset());
  b.set_owner_offset(placement.owner_offset());
  b.set_owner_elems(placement.owner_elems());
  if (placement.has_unsharded_view()) {
    *b.mutable_unsharded_view() = placement.unsharded_view();
  } else {
    b.clear_unsharded_view();
  }
  return MapUnshardedView(unit);
}

absl::Status Client::MapUnshardedView(int unit) {
  const v1::UnitBuffers& b = buffers_[unit];
  if (views_.size() != buffers_.size()) views_.resize(buffers_.size());
  std::unique_ptr<UnshardedView>& view = views_[unit];
  if (b.unsharded_offset() < 0 || !b.has_unsharded_view()) {
    // Resharded (or unsharded by copying): what this rank wrote over the shards is discarded,
    // as a separate all-gather buffer would be.
    if (view != nullptr && view->mapped()) return view->DropPrivateCopies();
    return absl::OkStatus();
  }
  const v1::UnshardedViewLayout& v = b.unsharded_view();
  ViewLayout l;
  l.bytes = plan_.world_size() * b.shard_elems() * DTypeSize(b.dtype());
  l.own_at = v.own_at();
  l.own_bytes = v.own_bytes();
  l.own_offset = v.own_offset();
  l.rest_offset = b.unsharded_offset();
  const auto in_arena = [&](int64_t offset, int64_t bytes) {
    return offset >= 0 && bytes >= 0 && offset <= static_cast<int64_t>(arena_bytes_) - bytes;
  };
  if (!in_arena(l.own_offset, l.own_bytes) || !in_arena(l.rest_offset, l.bytes - l.own_bytes)) {
    return absl::InternalError(absl::StrCat("the daemon's unsharded view of unit '", b.unit(),
                                            "' lies outside its ", arena_bytes_, "-byte arena"));
  }
  if (view == nullptr) view = std::make_unique<UnshardedView>();
  if (absl::Status s = view->Map(arena_fd_.get(), l, /*private_own=*/true); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("unit '", b.unit(), "': ", s.message()));
  }
  return absl::OkStatus();
}

const char* Client::UnshardedData(int unit) const {
  const int u = Check(unit);
  if (buffers_[u].unsharded_offset() < 0) return nullptr;
  if (buffers_[u].has_unsharded_view() && u < static_cast<int>(views_.size()) && views_[u] &&
      views_[u]->mapped()) {
    return views_[u]->data();
  }
  return arena_ + buffers_[u].unsharded_offset();
}

absl::StatusOr<OpHandle> Client::StartOp(v1::OpKind kind, int unit, v1::ReduceKind op,
                                         int keep_ranks, bool accumulate) {
  if (attachment_.empty()) return absl::FailedPreconditionError("not attached");
  if (!v1::OpKind_IsValid(kind) || kind == v1::OP_KIND_UNSPECIFIED || kind == v1::OP_NOOP) {
    return absl::InvalidArgumentError(absl::StrCat("kind: ", static_cast<int>(kind),
                                                   " is not an operation (ragshard.v1.OpKind)"));
  }
  if (!v1::ReduceKind_IsValid(op)) {
    return absl::InvalidArgumentError(
        absl::StrCat("reduce: ", static_cast<int>(op), " is not a ragshard.v1.ReduceKind"));
  }
  if (queue_ != nullptr) {
    QueueCommand c;
    c.kind = kind;
    c.unit = unit;
    c.reduce = op;
    c.keep_ranks = keep_ranks;
    c.accumulate = accumulate ? 1 : 0;
    c.timeout_ms = options_.timeout.count();
    auto t = queue_->Start(c);
    if (!t.ok()) return t.status();
    return OpHandle(this, t->seq, unit, *t);
  }
  v1::StartRequest req;
  req.set_attachment_id(attachment_);
  req.set_kind(kind);
  req.set_unit_index(unit);
  req.set_reduce(op);
  req.set_keep_ranks(keep_ranks);
  req.set_accumulate(accumulate);
  req.set_timeout_ms(options_.timeout.count());
  v1::StartResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + options_.peer_timeout);
  grpc::Status st = daemon_->Start(&ctx, req, &resp);
  if (!st.ok()) return DaemonCallError(ctx, st, "the start of an operation");
  return OpHandle(this, resp.handle(), unit);
}

absl::StatusOr<OpHandle> Client::Unshard(int unit) {
  return StartOp(v1::OP_UNSHARD, unit, v1::REDUCE_SUM);
}
absl::StatusOr<OpHandle> Client::Reshard(int unit, int keep_ranks) {
  return StartOp(v1::OP_RESHARD, unit, v1::REDUCE_SUM, keep_ranks);
}
absl::StatusOr<OpHandle> Client::AllocateUnsharded(int unit) {
  return StartOp(v1::OP_ALLOCATE_UNSHARDED, unit, v1::REDUCE_SUM);
}
absl::StatusOr<OpHandle> Client::AllocateGrad(int unit) {
  return StartOp(v1::OP_ALLOCATE_GRAD, unit, v1::REDUCE_SUM);
}
absl::StatusOr<OpHandle> Client::ReduceScatter(int unit, v1::ReduceKind op, bool accumulate) {
  return StartOp(v1::OP_REDUCE_SCATTER, unit, op, /*keep_ranks=*/0, accumulate);
}

absl::StatusOr<OpHandle> Client::AllReduce(int unit, v1::ReduceKind op) {
  return StartOp(v1::OP_ALL_REDUCE, unit, op);
}
absl::StatusOr<OpHandle> Client::GatherToOwner(int unit) {
  return StartOp(v1::OP_GATHER_TO_OWNER, unit, v1::REDUCE_SUM);
}
absl::StatusOr<OpHandle> Client::UpdateGather(int unit) {
  return StartOp(v1::OP_UPDATE_GATHER, unit, v1::REDUCE_SUM);
}
absl::StatusOr<OpHandle> Client::ScatterFromOwner(int unit) {
  return StartOp(v1::OP_SCATTER_FROM_OWNER, unit, v1::REDUCE_SUM);
}

absl::StatusOr<v1::StatsResponse> Client::DaemonStats() {
  if (daemon_ == nullptr) return absl::FailedPreconditionError("not connected");
  v1::StatsRequest req;
  v1::StatsResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + options_.peer_timeout);
  grpc::Status st = daemon_->Stats(&ctx, req, &resp);
  if (!st.ok()) return DaemonCallError(ctx, st, "a stats request");
  return resp;
}

absl::StatusOr<Client::StateBuffer> Client::GetStateBuffer(const std::string& name, int64_t bytes) {
  if (arena_ == nullptr) return absl::FailedPreconditionError("not attached");
  v1::StateBufferRequest req;
  req.set_attachment_id(attachment_);
  req.set_name(name);
  req.set_bytes(bytes);
  v1::StateBufferResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + options_.peer_timeout);
  grpc::Status st = daemon_->StateBuffer(&ctx, req, &resp);
  if (!st.ok()) return DaemonCallError(ctx, st, "a state buffer request");
  const bool on_device = resp.rank_memory() && backend_ == "cuda";
  if (resp.offset() < 0 || resp.bytes() != bytes ||
      (!on_device && static_cast<uint64_t>(resp.offset() + resp.bytes()) > arena_bytes_)) {
    return absl::InternalError(absl::StrCat("the daemon answered state buffer '", name, "' at [",
                                            resp.offset(), ", +", resp.bytes(), ") of an arena of ",
                                            arena_bytes_, " bytes"));
  }
  return StateBuffer{on_device ? nullptr : arena_ + resp.offset(), resp.offset(), resp.bytes(),
                     resp.existed(), resp.rank_memory()};
}

absl::Status Client::NoOp() {
  if (queue_ == nullptr) return NoOpRpc();
  QueueCommand c;
  c.kind = v1::OP_NOOP;
  auto t = queue_->Start(c);
  if (!t.ok()) return t.status();
  QueueResult r;
  auto done = queue_->Wait(*t, options_.peer_timeout, &r);
  if (!done.ok()) return done.status();
  if (*done) return r.status;
  return absl::UnavailableError(
      absl::StrCat("the daemon of node '", options_.node_id, "' (unix:", options_.daemon_socket,
                   ") did not answer a no-op within ", options_.peer_timeout.count(), " ms"));
}

absl::Status Client::NoOpRpc() {
  v1::NoOpRequest req;
  v1::NoOpResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + options_.peer_timeout);
  grpc::Status st = daemon_->NoOp(&ctx, req, &resp);
  return st.ok() ? absl::OkStatus() : DaemonCallError(ctx, st, "a no-op");
}

absl::Status Client::DaemonCallError(const grpc::ClientContext& ctx, const grpc::Status& st,
                                     const char* call) const {
  // gRPC's own failures (no answer by the deadline, no connection) name the daemon; the daemon's
  // answers (an operation's error, which names the peer or the rank) pass as they are.
  if (st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED &&
      std::chrono::system_clock::now() >= ctx.deadline()) {
    return absl::UnavailableError(
        absl::StrCat("the daemon of node '", options_.node_id, "' (unix:", options_.daemon_socket,
                     ") did not answer ", call, " within ", options_.peer_timeout.count(),
                     " ms: it is hung or stopped"));
  }
  if (st.error_code() == grpc::StatusCode::UNAVAILABLE) {
    for (const char* transport : {"failed to connect", "Socket closed", "Connection reset",
                                  "Connection refused", "Broken pipe", "GOAWAY"}) {
      if (absl::StrContains(st.error_message(), transport)) {
        return absl::UnavailableError(absl::StrCat("the daemon of node '", options_.node_id,
                                                   "' (unix:", options_.daemon_socket,
                                                   ") is unreachable: ", st.error_message()));
      }
    }
  }
  return FromGrpcStatus(st);
}

absl::Status OpHandle::Finish(absl::Status result) {
  finished_ = true;
  result_ = std::move(result);
  return result_;
}

absl::StatusOr<bool> OpHandle::WaitQueued(std::chrono::microseconds timeout) {
  QueueResult r;
  auto done = client_->queue_->Wait(ticket_, timeout, &r);
  if (!done.ok() || !*done) return done;
  started_ns_ = r.started_ns;
  finished_ns_ = r.finished_ns;
  if (r.status.ok() && !r.placement.empty()) {
    v1::UnitBuffers placement;
    if (!placement.ParseFromString(r.placement)) {
      r.status = absl::InternalError(
          absl::StrCat("operation ", handle_, ": the daemon's placement does not parse"));
    } else {
      r.status = client_->Place(unit_, placement);
    }
  }
  (void)Finish(r.status);
  return true;
}

absl::Status OpHandle::Wait(std::chrono::milliseconds timeout) {
  if (finished_) return result_;
  if (ticket_.slot >= 0) {
    auto done = WaitQueued(timeout);
    if (!done.ok()) return done.status();
    if (!*done) {
      return absl::DeadlineExceededError(
          absl::StrCat("operation ", handle_, " not done after ", timeout.count(), " ms"));
    }
    return result_;
  }
  // In slices: a live daemon answers each at its end (done or not), so a daemon that answers
  // nothing for peer_timeout is hung, and the rank says so instead of waiting out `timeout`.
  const auto until = std::chrono::steady_clock::now() + timeout;
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        until - std::chrono::steady_clock::now());
    const std::chrono::milliseconds slice =
        std::max(std::chrono::milliseconds(0), std::min(left, Client::kWaitSlice));
    v1::WaitRequest req;
    req.set_attachment_id(client_->attachment_);
    req.set_handle(handle_);
    req.set_timeout_ms(slice.count());
    v1::WaitResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + slice + client_->options_.peer_timeout);
    grpc::Status st = client_->daemon_->Wait(&ctx, req, &resp);
    if (!st.ok()) return client_->DaemonCallError(ctx, st, "a wait");
    if (resp.done()) {
      return Finish(resp.has_placement() ? client_->Place(unit_, resp.placement())
                                         : absl::OkStatus());
    }
    if (slice >= left) {
      return absl::DeadlineExceededError(
          absl::StrCat("operation ", handle_, " not done after ", timeout.count(), " ms"));
    }
  }
}

absl::StatusOr<bool> OpHandle::Poll() {
  if (finished_) {
    if (!result_.ok()) return result_;
    return true;
  }
  if (ticket_.slot >= 0) {
    auto done = WaitQueued(std::chrono::microseconds(0));
    if (!done.ok()) return done.status();
    if (*done && !result_.ok()) return result_;
    return *done;
  }
  v1::WaitRequest req;
  req.set_attachment_id(client_->attachment_);
  req.set_handle(handle_);
  v1::WaitResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + client_->options_.peer_timeout);
  grpc::Status st = client_->daemon_->Wait(&ctx, req, &resp);
  if (!st.ok()) return client_->DaemonCallError(ctx, st, "a poll");
  if (resp.done()) {
    absl::Status s =
        Finish(resp.has_placement() ? client_->Place(unit_, resp.placement()) : absl::OkStatus());
    if (!s.ok()) return s;
  }
  return resp.done();
}

}  // namespace ragshard
