#include "server/daemon/ucx_comm.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>

#include <cstring>
#include <deque>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace ragshard::daemon {

absl::Status UcsStatus(ucs_status_t status, absl::string_view what) {
  if (status == UCS_OK) return absl::OkStatus();
  const std::string msg = absl::StrCat(what, ": ", ucs_status_string(status));
  switch (status) {
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_EXCEEDS_LIMIT:
      return absl::ResourceExhaustedError(msg);
    case UCS_ERR_TIMED_OUT:
      return absl::DeadlineExceededError(msg);
    case UCS_ERR_CANCELED:
      return absl::CancelledError(msg);
    case UCS_ERR_INVALID_PARAM:
      return absl::InvalidArgumentError(msg);
    default:
      return absl::UnavailableError(msg);
  }
}

namespace {

constexpr int kRankBits = 16;
constexpr uint64_t kTagMask = (uint64_t{1} << (64 - kRankBits)) - 1;
constexpr uint64_t kHelloTag = kTagMask;  // reserved

uint64_t Tag(int src, uint64_t tag) {
  return (static_cast<uint64_t>(src) << (64 - kRankBits)) | (tag & kTagMask);
}

absl::StatusOr<sockaddr_in> ParseAddress(const std::string& address) {
  const size_t colon = address.rfind(':');
  int port = 0;
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port) ||
      port < 0 || port > 65535 ||
      inet_pton(AF_INET, address.substr(0, colon).c_str(), &sa.sin_addr) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad data-plane address '", address, "' (expected IPv4:port)"));
  }
  sa.sin_port = htons(static_cast<uint16_t>(port));
  return sa;
}

}  // namespace

// Request state, owned by the comm; UCX callbacks write into it.
struct Pending {
  bool done = false;
  ucs_status_t status = UCS_OK;
  void* request = nullptr;  // the UCX request while in flight
  int peer = -1;
  bool recv = false;
};

struct UcxWorker::Impl {
  UcxWorker* owner = nullptr;
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  ucp_listener_h listener = nullptr;
  int efd = -1;
  std::vector<ucp_ep_h> accepted;  // server-side endpoints
  // Peers whose endpoint reported an error, by rank of the current comm.
  std::set<int> failed;
  std::vector<ucp_ep_h> eps;  // client endpoints of the current comm, by rank

  static void OnConnRequest(ucp_conn_request_h req, void* arg) {
    auto* self = static_cast<Impl*>(arg);
    ucp_conn_request_attr_t attr{};
    attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
    std::string host;
    if (ucp_conn_request_query(req, &attr) == UCS_OK && attr.client_address.ss_family == AF_INET) {
      char buf[INET_ADDRSTRLEN] = {0};
      const auto* sin = reinterpret_cast<const sockaddr_in*>(&attr.client_address);
      inet_ntop(AF_INET, &sin->sin_addr, buf, sizeof(buf));
      host = buf;
    }
    UcxWorker* w = self->owner;
    if (!w->allow_any_ && w->allowed_hosts_.count(host) == 0) {
      ++w->rejected_;
      LOG(WARNING) << "data port: rejected a connection from '" << host << "' (not a peer)";
      ucp_listener_reject(self->listener, req);
      return;
    }
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                        UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.conn_request = req;
    params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    params.err_handler.cb = [](void*, ucp_ep_h, ucs_status_t) {};  // the client ep reports
    params.err_handler.arg = nullptr;
    ucp_ep_h ep = nullptr;
    if (ucp_ep_create(self->worker, &params, &ep) == UCS_OK) self->accepted.push_back(ep);
  }

  static void OnEpError(void* arg, ucp_ep_h ep, ucs_status_t status) {
    auto* self = static_cast<Impl*>(arg);
    for (size_t r = 0; r < self->eps.size(); ++r) {
      if (self->eps[r] == ep) {
        if (self->failed.insert(static_cast<int>(r)).second) {
          LOG(WARNING) << "data plane: peer " << r << " lost: " << ucs_status_string(status);
        }
      }
    }
  }

  // Progress, then wait up to `max_wait` for events when idle.
  void Progress(absl::Duration max_wait) {
    if (ucp_worker_progress(worker) != 0) return;
    if (ucp_worker_arm(worker) == UCS_OK) {
      pollfd p{efd, POLLIN, 0};
      int ms = static_cast<int>(absl::ToInt64Milliseconds(max_wait));
      poll(&p, 1, std::max(ms, 0));
    }
  }

  void CloseEp(ucp_ep_h ep) {
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_EP_CLOSE_FLAG_FORCE;
    void* req = ucp_ep_close_nbx(ep, &param);
    if (UCS_PTR_IS_PTR(req)) {
      const absl::Time until = absl::Now() + absl::Seconds(1);
      while (ucp_request_check_status(req) == UCS_INPROGRESS && absl::Now() < until) {
        ucp_worker_progress(worker);
      }
      ucp_request_free(req);
    }
  }
};

class UcxComm final : public Comm {
 public:
  UcxComm(UcxWorker::Impl* w, int rank, int size) : w_(w), rank_(rank), size_(size) {}
  ~UcxComm() override {
    CancelAll();
    for (ucp_ep_h ep : w_->eps) {
      if (ep != nullptr) w_->CloseEp(ep);
    }
    w_->eps.clear();
    w_->failed.clear();
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  absl::StatusOr<uint64_t> PostSend(int peer, uint64_t tag, const void* data,
                                    size_t bytes) override {
    if (peer < 0 || peer >= size_ || peer == rank_) return absl::InvalidArgumentError("bad peer");
    if (w_->failed.count(peer)) return Lost(peer);
    const uint64_t id = NewPending(peer, false);
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.send = [](void* req, ucs_status_t st, void* user) {
      auto* p = static_cast<Pending*>(user);
      p->done = true;
      p->status = st;
    };
    param.user_data = &pending_[id];
    void* req = ucp_tag_send_nbx(w_->eps[peer], data, bytes, Tag(rank_, tag), &param);
    return Track(id, req);
  }

  absl::StatusOr<uint64_t> PostRecv(int peer, uint64_t tag, void* data, size_t bytes) override {
    if (peer < 0 || peer >= size_ || peer == rank_) return absl::InvalidArgumentError("bad peer");
    if (w_->failed.count(peer)) return Lost(peer);
    const uint64_t id = NewPending(peer, true);
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.recv = [](void* req, ucs_status_t st, const ucp_tag_recv_info_t*, void* user) {
      auto* p = static_cast<Pending*>(user);
      p->done = true;
      p->status = st;
    };
    param.user_data = &pending_[id];
    void* req = ucp_tag_recv_nbx(w_->worker, data, bytes, Tag(peer, tag), ~uint64_t{0}, &param);
    return Track(id, req);
  }

  absl::Status WaitAll(const std::vector<uint64_t>& ids, absl::Time deadline) override {
    absl::Status result;
    while (true) {
      bool all = true;
      for (uint64_t id : ids) {
        Pending& p = pending_[id];
        if (!p.done) {
          all = false;
          if (w_->failed.count(p.peer)) {
            result = Lost(p.peer);
            break;
          }
        } else if (p.status != UCS_OK) {
          result = w_->failed.count(p.peer)
                       ? Lost(p.peer)
                       : UcsStatus(p.status, absl::StrCat("transfer with peer ", p.peer));
          break;
        }
      }
      if (!result.ok() || all) break;
      if (absl::Now() >= deadline) {
        int peer = -1;
        for (uint64_t id : ids) {
          if (!pending_[id].done) peer = pending_[id].peer;
        }
        result = absl::DeadlineExceededError(
            absl::StrCat("transfer with peer ", peer, " did not complete before the deadline"));
        break;
      }
      w_->Progress(std::min(absl::Milliseconds(1), deadline - absl::Now()));
    }
    if (!result.ok()) CancelAll();
    Reap();
    return result;
  }

 private:
  absl::Status Lost(int peer) const {
    return absl::UnavailableError(absl::StrCat("peer ", peer, " lost (connection closed)"));
  }

  uint64_t NewPending(int peer, bool recv) {
    pending_.emplace_back();
    pending_.back().peer = peer;
    pending_.back().recv = recv;
    return pending_.size() - 1 + base_;
  }

  absl::StatusOr<uint64_t> Track(uint64_t id, void* req) {
    Pending& p = pending_[id - base_];
    if (req == nullptr) {
      p.done = true;
    } else if (UCS_PTR_IS_ERR(req)) {
      p.done = true;
      p.status = UCS_PTR_STATUS(req);
    } else {
      p.request = req;
    }
    return id - base_;
  }

  void CancelAll() {
    for (Pending& p : pending_) {
      if (!p.done && p.request != nullptr) ucp_request_cancel(w_->worker, p.request);
    }
    const absl::Time until = absl::Now() + absl::Seconds(2);
    for (Pending& p : pending_) {
      while (!p.done && p.request != nullptr && absl::Now() < until)
        ucp_worker_progress(w_->worker);
    }
  }

  // Frees completed requests and forgets the bookkeeping once nothing is in flight.
  void Reap() {
    bool busy = false;
    for (Pending& p : pending_) {
      if (p.done && p.request != nullptr) {
        ucp_request_free(p.request);
        p.request = nullptr;
      }
      busy |= !p.done;
    }
    if (!busy) pending_.clear();
  }

  UcxWorker::Impl* const w_;
  const int rank_;
  const int size_;
  uint64_t base_ = 0;
  std::deque<Pending> pending_;  // stable addresses for the callbacks
};

absl::StatusOr<std::unique_ptr<UcxWorker>> UcxWorker::Create(const std::string& ip, int port) {
  std::unique_ptr<UcxWorker> w(new UcxWorker());
  w->impl_ = std::make_unique<Impl>();
  Impl& impl = *w->impl_;
  impl.owner = w.get();
  ucp_config_t* config = nullptr;
  absl::Status s = UcsStatus(ucp_config_read(nullptr, nullptr, &config), "ucp_config_read");
  if (!s.ok()) return s;
  // Peer error handling allows only network transports; name tcp explicitly (RDMA devices, where
  // present, can be added through UCX_TLS in the environment).
  if (std::getenv("UCX_TLS") == nullptr) ucp_config_modify(config, "TLS", "tcp");
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
  s = UcsStatus(ucp_init(&params, config, &impl.context), "ucp_init");
  ucp_config_release(config);
  if (!s.ok()) return s;
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  s = UcsStatus(ucp_worker_create(impl.context, &wp, &impl.worker), "ucp_worker_create");
  if (!s.ok()) return s;
  s = UcsStatus(ucp_worker_get_efd(impl.worker, &impl.efd), "ucp_worker_get_efd");
  if (!s.ok()) return s;
  auto sa = ParseAddress(absl::StrCat(ip, ":", port));
  if (!sa.ok()) return sa.status();
  ucp_listener_params_t lp{};
  lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&*sa);
  lp.sockaddr.addrlen = sizeof(*sa);
  lp.conn_handler.cb = &Impl::OnConnRequest;
  lp.conn_handler.arg = &impl;
  s = UcsStatus(ucp_listener_create(impl.worker, &lp, &impl.listener),
                absl::StrCat("listen on ", ip, ":", port));
  if (!s.ok()) return s;
  ucp_listener_attr_t la{};
  la.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
  s = UcsStatus(ucp_listener_query(impl.listener, &la), "ucp_listener_query");
  if (!s.ok()) return s;
  const auto* bound = reinterpret_cast<const sockaddr_in*>(&la.sockaddr);
  w->address_ = absl::StrCat(ip, ":", ntohs(bound->sin_port));
  return w;
}

UcxWorker::~UcxWorker() {
  if (!impl_) return;
  for (ucp_ep_h ep : impl_->accepted) impl_->CloseEp(ep);
  if (impl_->listener) ucp_listener_destroy(impl_->listener);
  if (impl_->worker) ucp_worker_destroy(impl_->worker);
  if (impl_->context) ucp_cleanup(impl_->context);
}

void UcxWorker::Progress(absl::Duration max_wait) { impl_->Progress(max_wait); }

void UcxWorker::AllowPeerHosts(std::set<std::string> hosts) { allowed_hosts_ = std::move(hosts); }

absl::StatusOr<std::unique_ptr<Comm>> UcxWorker::Connect(int rank,
                                                         const std::vector<std::string>& addresses,
                                                         absl::Time deadline) {
  const int n = static_cast<int>(addresses.size());
  if (rank < 0 || rank >= n) return absl::InvalidArgumentError("rank outside the group");
  if (n > (1 << kRankBits)) return absl::InvalidArgumentError("group too large");
  if (!impl_->eps.empty()) return absl::FailedPreconditionError("worker already has a comm");
  impl_->eps.assign(n, nullptr);
  impl_->failed.clear();
  auto comm = std::make_unique<UcxComm>(impl_.get(), rank, n);
  for (int p = 0; p < n; ++p) {
    if (p == rank) continue;
    auto sa = ParseAddress(addresses[p]);
    if (!sa.ok()) return sa.status();
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    params.sockaddr.addr = reinterpret_cast<const sockaddr*>(&*sa);
    params.sockaddr.addrlen = sizeof(*sa);
    params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    params.err_handler.cb = &Impl::OnEpError;
    params.err_handler.arg = impl_.get();
    absl::Status s = UcsStatus(ucp_ep_create(impl_->worker, &params, &impl_->eps[p]),
                               absl::StrCat("connect to peer ", p, " at ", addresses[p]));
    if (!s.ok()) return s;
  }
  // Hello round: proves every connection works in both directions.
  std::vector<uint64_t> reqs;
  std::vector<int32_t> in(n, -1);
  int32_t me = rank;
  for (int p = 0; p < n; ++p) {
    if (p == rank) continue;
    auto r = comm->PostRecv(p, kHelloTag, &in[p], sizeof(int32_t));
    if (!r.ok()) return r.status();
    reqs.push_back(*r);
    auto s = comm->PostSend(p, kHelloTag, &me, sizeof(int32_t));
    if (!s.ok()) return s.status();
    reqs.push_back(*s);
  }
  absl::Status st = comm->WaitAll(reqs, deadline);
  if (!st.ok()) return st;
  for (int p = 0; p < n; ++p) {
    if (p != rank && in[p] != p)
      return absl::DataLossError(absl::StrCat("bad hello from peer ", p));
  }
  return std::unique_ptr<Comm>(std::move(comm));
}

}  // namespace ragshard::daemon
