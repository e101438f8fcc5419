#include "server/daemon/ucx_comm.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>

#include <atomic>
#include <cstring>
#include <deque>
#include <set>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
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
constexpr uint64_t kRankMask = ~kTagMask;
// A data receive matches its peer and the message's index; the rest of the stamp is checked.
constexpr uint64_t kDataMask = kRankMask | MessageStamp::kIndexMask;
// The transport's own messages.
const uint64_t kHelloTag =
    MessageStamp{0, 0, MessageStamp::kControl, MessageStamp::kIndexMask - 1}.Tag();
const uint64_t kNoticeTag =
    MessageStamp{0, 0, MessageStamp::kControl, MessageStamp::kIndexMask}.Tag();
// A notice receive takes any peer's abort notice.
constexpr uint64_t kNoticeMask =
    MessageStamp::kIndexMask |
    (((uint64_t{1} << MessageStamp::kKindBits) - 1) << MessageStamp::kIndexBits);
constexpr size_t kNoticeBytes = 1024;

uint64_t Tag(int src, uint64_t tag) {
  return (static_cast<uint64_t>(src) << (64 - kRankBits)) | (tag & kTagMask);
}
int SourceOf(uint64_t tag) { return static_cast<int>(tag >> (64 - kRankBits)); }

// FNV-1a: the same job id gives the same key in every daemon.
uint64_t JobKey(absl::string_view job) {
  uint64_t h = 1469598103934665603ull;
  for (char c : job) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ull;
  }
  return h;
}

struct Hello {
  int32_t rank = -1;
  int32_t reserved = 0;
  uint64_t job = 0;
};

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

absl::Duration SpinFromEnvironment() {
  int64_t us = 50;
  if (const char* s = std::getenv("RAGSHARD_UCX_SPIN_US"); s != nullptr) {
    if (!absl::SimpleAtoi(s, &us) || us < 0 || us > 1'000'000) {
      LOG(WARNING) << "RAGSHARD_UCX_SPIN_US='" << s << "' is not microseconds in [0, 1e6]; 50";
      us = 50;
    }
  }
  return absl::Microseconds(us);
}

}  // namespace

// Request state, owned by the comm; UCX callbacks write into it.
struct Pending {
  bool done = false;
  ucs_status_t status = UCS_OK;
  void* request = nullptr;  // the UCX request while in flight
  int peer = -1;
  bool recv = false;
  // Receives: what this side expects and what arrived.
  uint64_t want_tag = 0;
  size_t want_bytes = 0;
  bool checked = true;      // compare the sender's stamp and size with these
  bool waited = false;      // a WaitAll has seen it complete
  uint64_t sender_tag = 0;  // as UCX reports it: the source bits and the stamp
  size_t sent_bytes = 0;
  uint64_t stamp() const { return sender_tag & kTagMask; }
};

struct UcxWorker::Impl {
  UcxWorker* owner = nullptr;
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  ucp_listener_h listener = nullptr;
  int efd = -1;
  // How long Progress polls before it sleeps (env RAGSHARD_UCX_SPIN_US, for measuring).
  absl::Duration spin = SpinFromEnvironment();
  std::vector<ucp_ep_h> accepted;  // server-side endpoints
  // Peers whose endpoint reported an error, by rank of the current comm.
  std::set<int> failed;
  std::vector<ucp_ep_h> eps;  // client endpoints of the current comm, by rank

  static void OnConnRequest(ucp_conn_request_h req, void* arg) {
    auto* self = static_cast<Impl*>(arg);
    ucp_conn_request_attr_t attr{};
    attr.field_mask =
        UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR | UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ID;
    std::string host;
    uint64_t client_id = 0;
    if (ucp_conn_request_query(req, &attr) == UCS_OK) {
      client_id = attr.client_id;
      if (attr.client_address.ss_family == AF_INET) {
        char buf[INET_ADDRSTRLEN] = {0};
        const auto* sin = reinterpret_cast<const sockaddr_in*>(&attr.client_address);
        inet_ntop(AF_INET, &sin->sin_addr, buf, sizeof(buf));
        host = buf;
      }
    }
    UcxWorker* w = self->owner;
    absl::Status refused;
    if (!w->allow_any_ && w->allowed_hosts_.count(host) == 0) {
      refused = absl::PermissionDeniedError(
          absl::StrCat("data port: rejected a connection from '", host, "' (not a peer)"));
    } else if (w->credential_ != 0 && client_id != w->credential_) {
      refused = absl::UnauthenticatedError(
          absl::StrCat("data port: rejected a connection from '", host,
                       "' that did not present the job's credential (not a daemon of the job)"));
    }
    if (!refused.ok()) {
      ++w->rejected_;
      LOG(WARNING) << refused.message();
      ucp_listener_reject(self->listener, req);
      if (w->on_reject_) w->on_reject_(refused);
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

  // Progress, then wait up to `max_wait` for events when idle: first polling for up to
  // spin (yielding the core between polls), then asleep on the worker's event fd. A transfer's
  // next event usually comes within microseconds, and a thread woken from poll costs tens.
  void Progress(absl::Duration max_wait) {
    if (ucp_worker_progress(worker) != 0) return;
    for (const absl::Time until = absl::Now() + std::min(spin, max_wait); absl::Now() < until;) {
      std::this_thread::yield();
      if (ucp_worker_progress(worker) != 0) return;
    }
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
    // Sends that completed locally reach their peers before the endpoints close.
    Flush(absl::Now() + absl::Seconds(2));
    if (notice_.request != nullptr) {
      if (!notice_.done) ucp_request_cancel(w_->worker, notice_.request);
      const absl::Time until = absl::Now() + absl::Seconds(1);
      while (!notice_.done && absl::Now() < until) ucp_worker_progress(w_->worker);
      ucp_request_free(notice_.request);
    }
    for (ucp_ep_h ep : w_->eps) {
      if (ep != nullptr) w_->CloseEp(ep);
    }
    w_->eps.clear();
    w_->failed.clear();
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void set_names(std::vector<std::string> names) { names_ = std::move(names); }
  int64_t sent_bytes() const override { return sent_bytes_.load(std::memory_order_relaxed); }

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
    param.user_data = At(id);
    void* req = ucp_tag_send_nbx(w_->eps[peer], data, bytes, Tag(rank_, tag), &param);
    sent_bytes_.fetch_add(static_cast<int64_t>(bytes), std::memory_order_relaxed);
    return Track(id, req);
  }

  absl::StatusOr<uint64_t> PostRecv(int peer, uint64_t tag, void* data, size_t bytes) override {
    if (peer < 0 || peer >= size_ || peer == rank_) return absl::InvalidArgumentError("bad peer");
    if (w_->failed.count(peer)) return Lost(peer);
    const uint64_t id = NewPending(peer, true);
    Pending& p = *At(id);
    p.want_tag = tag & kTagMask;
    p.want_bytes = bytes;
    p.checked = w_->owner->message_checks() || tag == kHelloTag;
    // The hello and unchecked receives match the whole tag.
    void* req = PostTagRecv(&p, data, bytes, Tag(peer, tag),
                            p.checked && tag != kHelloTag ? kDataMask : ~uint64_t{0});
    return Track(id, req);
  }

  // The standing receive of peers' abort notices, posted once connected.
  absl::Status ListenForNotices() {
    notice_.recv = true;
    void* req = PostTagRecv(&notice_, notice_text_, kNoticeBytes, kNoticeTag, kNoticeMask);
    if (UCS_PTR_IS_ERR(req)) return UcsStatus(UCS_PTR_STATUS(req), "posting the notice receive");
    notice_.request = req;
    notice_.done = req == nullptr;
    return absl::OkStatus();
  }

  void Abort(const std::string& why) override {
    if (aborted_) return;
    aborted_ = true;
    Abandon();  // nothing of the failed operation stays queued ahead of the notices
    const std::string text = why.substr(0, kNoticeBytes);
    std::vector<uint64_t> sends;
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == rank_ || w_->failed.count(peer)) continue;
      auto id = PostSend(peer, kNoticeTag, text.data(), text.size());
      if (id.ok()) sends.push_back(*id);
    }
    // Until the notices have reached the peers (a flush completes remotely), within a bound; a
    // peer that is gone is not waited for.
    const absl::Time until = absl::Now() + absl::Milliseconds(500);
    while (absl::Now() < until) {
      bool all = true;
      for (uint64_t id : sends) all &= At(id)->done || w_->failed.count(At(id)->peer);
      if (all) break;
      w_->Progress(absl::Milliseconds(1));
    }
    Flush(until);
    Abandon();
  }

  void SetDescriber(TagDescriber describe) override { describe_ = std::move(describe); }

  using Comm::WaitAll;
  absl::Status WaitAll(const std::vector<uint64_t>& ids, absl::Time deadline,
                       const IdleWork& idle) override {
    absl::Status result;
    bool mismatch = false;
    bool idle_left = static_cast<bool>(idle);
    absl::Time publish = absl::Now() + absl::Milliseconds(100);
    while (true) {
      bool all = true;
      if (absl::Now() >= publish) {
        PublishWaiting(ids);
        publish = absl::Now() + absl::Milliseconds(100);
      }
      if (notice_.done) {
        result = Notice();
        break;
      }
      for (uint64_t id : ids) {
        if (id < base_) continue;  // waited for by an earlier WaitAll
        Pending& p = *At(id);
        if (!p.done) {
          all = false;
          if (w_->failed.count(p.peer)) {
            // A peer that stopped the job leaves after its notice: prefer the notice.
            const absl::Time grace = absl::Now() + absl::Milliseconds(200);
            while (!notice_.done && absl::Now() < grace) w_->Progress(absl::Milliseconds(1));
            result = notice_.done ? Notice() : Lost(p.peer);
            break;
          }
        } else if (p.recv && p.checked &&
                   (p.status == UCS_OK || p.status == UCS_ERR_MESSAGE_TRUNCATED) &&
                   (p.stamp() != p.want_tag || p.sent_bytes != p.want_bytes)) {
          result = MismatchError(rank_, p.peer, p.stamp(), p.sent_bytes, p.want_tag, p.want_bytes,
                                 describe_);
          mismatch = true;
          break;
        } else if (p.status != UCS_OK) {
          result = w_->failed.count(p.peer)
                       ? Lost(p.peer)
                       : UcsStatus(p.status, absl::StrCat("transfer with ", Peer(p.peer)));
          break;
        }
      }
      if (mismatch) {
        // Every peer stops too, with this error, instead of waiting for its deadline.
        Abort(std::string(result.message()));
        return result;
      }
      if (!result.ok() || all) break;
      if (absl::Now() >= deadline) {
        int peer = -1;
        for (uint64_t id : ids) {
          if (id >= base_ && !At(id)->done) peer = At(id)->peer;
        }
        result = absl::DeadlineExceededError(
            absl::StrCat("transfer with ", Peer(peer), " did not complete before the deadline"));
        break;
      }
      // Where the transfers have nothing for this thread to do, a step of the idle work takes
      // the place of the sleep.
      if (!idle_left) {
        w_->Progress(std::min(absl::Milliseconds(1), deadline - absl::Now()));
      } else if (ucp_worker_progress(w_->worker) == 0) {
        idle_left = idle();
      }
    }
    if (result.ok()) {
      for (uint64_t id : ids) {
        if (id >= base_) At(id)->waited = true;
      }
      Reap();
    } else {
      Abandon();
    }
    {
      absl::MutexLock lock(&waiting_mu_);
      waiting_.clear();
    }
    return result;
  }

  std::string waiting_for() const override {
    absl::MutexLock lock(&waiting_mu_);
    return waiting_;
  }

 private:
  // "peer 1 (node 'node-1')", or "peer 1" without names.
  std::string Peer(int peer) const {
    if (peer < 0 || static_cast<size_t>(peer) >= names_.size()) return absl::StrCat("peer ", peer);
    return absl::StrCat("peer ", peer, " (node '", names_[peer], "')");
  }
  // Names the peers whose transfers of `ids` are still pending, for waiting_for().
  void PublishWaiting(const std::vector<uint64_t>& ids) {
    std::set<int> peers;
    for (uint64_t id : ids) {
      if (id >= base_ && !At(id)->done) peers.insert(At(id)->peer);
    }
    std::vector<std::string> names;
    names.reserve(peers.size());
    for (int peer : peers) names.push_back(Peer(peer));
    absl::MutexLock lock(&waiting_mu_);
    waiting_ = absl::StrJoin(names, ", ");
  }

  absl::Status Lost(int peer) const {
    return absl::UnavailableError(absl::StrCat(Peer(peer), " lost (connection closed)"));
  }

  // Waits, up to `until`, for every send this worker has made to complete at its peer.
  void Flush(absl::Time until) {
    ucp_request_param_t param{};
    void* flush = ucp_worker_flush_nbx(w_->worker, &param);
    if (!UCS_PTR_IS_PTR(flush)) return;
    while (ucp_request_check_status(flush) == UCS_INPROGRESS && absl::Now() < until) {
      w_->Progress(absl::Milliseconds(1));
    }
    ucp_request_free(flush);  // released by UCX when it ends, if it has not (a lost peer)
  }

  // A peer's abort notice, as this member's error.
  absl::Status Notice() const {
    if (notice_.status != UCS_OK && notice_.status != UCS_ERR_MESSAGE_TRUNCATED) {
      return UcsStatus(notice_.status, "receiving abort notices");
    }
    return absl::AbortedError(
        absl::StrCat("node ", SourceOf(notice_.sender_tag), " stopped the job: ",
                     absl::string_view(notice_text_, std::min(notice_.sent_bytes, kNoticeBytes))));
  }

  // Posts a tagged receive whose completion fills `p` (sender's tag and size included).
  void* PostTagRecv(Pending* p, void* data, size_t bytes, uint64_t tag, uint64_t mask) {
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    // Checked receives always complete through the callback, which reports the sender's tag
    // and size (UCX 1.13 does not fill recv_info on immediate completion).
    if (p->checked) param.op_attr_mask |= UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    param.cb.recv = [](void* req, ucs_status_t st, const ucp_tag_recv_info_t* info, void* user) {
      auto* q = static_cast<Pending*>(user);
      q->done = true;
      q->status = st;
      if (info != nullptr) {
        q->sender_tag = info->sender_tag;
        q->sent_bytes = info->length;
      }
    };
    param.user_data = p;
    return ucp_tag_recv_nbx(w_->worker, data, bytes, tag, mask, &param);
  }

  uint64_t NewPending(int peer, bool recv) {
    pending_.emplace_back();
    pending_.back().peer = peer;
    pending_.back().recv = recv;
    return pending_.size() - 1 + base_;
  }

  // The request `id` (>= base_: not yet forgotten).
  Pending* At(uint64_t id) { return &pending_[id - base_]; }

  absl::StatusOr<uint64_t> Track(uint64_t id, void* req) {
    Pending& p = *At(id);
    if (req == nullptr) {
      p.done = true;
    } else if (UCS_PTR_IS_ERR(req)) {
      p.done = true;
      p.status = UCS_PTR_STATUS(req);
    } else {
      p.request = req;
    }
    return id;
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

  // Cancels what is in flight and forgets every request: the operation failed, and none of its
  // requests will be waited for.
  void Abandon() {
    CancelAll();
    for (Pending& p : pending_) p.waited = true;
    Reap();
  }

  // Frees completed requests and forgets the bookkeeping once every request has been waited
  // for (a collective may wait for some of its requests while others are in flight). Ids keep
  // counting from base_, so an id of a forgotten request is never reused.
  void Reap() {
    bool busy = false;
    for (Pending& p : pending_) {
      if (p.done && p.request != nullptr) {
        ucp_request_free(p.request);
        p.request = nullptr;
      }
      busy |= !p.done || !p.waited;
    }
    if (!busy) {
      base_ += pending_.size();
      pending_.clear();
    }
  }

  UcxWorker::Impl* const w_;
  const int rank_;
  const int size_;
  uint64_t base_ = 0;            // the id of pending_[0]
  std::deque<Pending> pending_;  // stable addresses for the callbacks
  Pending notice_;
  char notice_text_[kNoticeBytes] = {};
  bool aborted_ = false;
  TagDescriber describe_;
  std::vector<std::string> names_;  // the members' node ids, for errors
  // The peers a WaitAll of more than 100 ms still waits for, read by other threads.
  mutable absl::Mutex waiting_mu_;
  std::string waiting_ ABSL_GUARDED_BY(waiting_mu_);
  std::atomic<int64_t> sent_bytes_{0};
};

absl::StatusOr<std::unique_ptr<UcxWorker>> UcxWorker::Create(const std::string& ip, int port,
                                                             uint64_t credential) {
  std::unique_ptr<UcxWorker> w(new UcxWorker());
  w->credential_ = credential;
  w->impl_ = std::make_unique<Impl>();
  Impl& impl = *w->impl_;
  impl.owner = w.get();
  ucp_config_t* config = nullptr;
  absl::Status s = UcsStatus(ucp_config_read(nullptr, nullptr, &config), "ucp_config_read");
  if (!s.ok()) return s;
  // Peer error handling allows only network transports; name tcp explicitly (RDMA devices, where
  // present, can be added through UCX_TLS in the environment).
  if (std::getenv("UCX_TLS") == nullptr) ucp_config_modify(config, "TLS", "tcp");
  // Over tcp a rendezvous receive takes the sender's data as a put to the receive buffer's
  // address, and a put already on the wire is copied there even after the receive was abandoned
  // (a peer died mid-collective and the operation failed): a late write to memory the caller
  // has freed or reused. Without tcp puts the data of a large message comes as active messages
  // that UCX copies only into a receive still posted. (UCX_TCP_PUT_ENABLE=y brings them back.)
  if (std::getenv("UCX_TCP_PUT_ENABLE") == nullptr &&
      ucp_config_modify(config, "TCP_PUT_ENABLE", "n") != UCS_OK) {
    LOG(WARNING) << "data plane: this UCX does not take TCP_PUT_ENABLE; tcp puts stay on";
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
  s = UcsStatus(ucp_init(&params, config, &impl.context), "ucp_init");
  ucp_config_release(config);
  if (!s.ok()) return s;
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE | UCP_WORKER_PARAM_FIELD_CLIENT_ID;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  wp.client_id = credential;  // presented with each connection this worker makes
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
                                                         absl::Time deadline, absl::string_view job,
                                                         std::vector<std::string> names) {
  const int n = static_cast<int>(addresses.size());
  if (rank < 0 || rank >= n) return absl::InvalidArgumentError("rank outside the group");
  // Ring steps and the all-reduce's second half share a message's 16 index bits.
  if (n > (1 << (MessageStamp::kIndexBits - 2))) {
    return absl::InvalidArgumentError(absl::StrCat("a group of ", n,
                                                   " daemons is too large (at most ",
                                                   1 << (MessageStamp::kIndexBits - 2), ")"));
  }
  if (!impl_->eps.empty()) return absl::FailedPreconditionError("worker already has a comm");
  impl_->eps.assign(n, nullptr);
  impl_->failed.clear();
  auto comm = std::make_unique<UcxComm>(impl_.get(), rank, n);
  if (names.size() == addresses.size()) comm->set_names(std::move(names));
  for (int p = 0; p < n; ++p) {
    if (p == rank) continue;
    auto sa = ParseAddress(addresses[p]);
    if (!sa.ok()) return sa.status();
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER |
                   (credential_ != 0 ? UCP_EP_PARAMS_FLAGS_SEND_CLIENT_ID : 0);
    params.sockaddr.addr = reinterpret_cast<const sockaddr*>(&*sa);
    params.sockaddr.addrlen = sizeof(*sa);
    params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    params.err_handler.cb = &Impl::OnEpError;
    params.err_handler.arg = impl_.get();
    absl::Status s = UcsStatus(ucp_ep_create(impl_->worker, &params, &impl_->eps[p]),
                               absl::StrCat("connect to peer ", p, " at ", addresses[p]));
    if (!s.ok()) return s;
  }
  // Hello round: proves every connection works in both directions, and that the peer is the
  // member it should be, of the same job.
  std::vector<uint64_t> reqs;
  std::vector<Hello> in(n);
  Hello me;
  me.rank = rank;
  me.job = JobKey(job);
  for (int p = 0; p < n; ++p) {
    if (p == rank) continue;
    auto r = comm->PostRecv(p, kHelloTag, &in[p], sizeof(Hello));
    if (!r.ok()) return r.status();
    reqs.push_back(*r);
    auto s = comm->PostSend(p, kHelloTag, &me, sizeof(Hello));
    if (!s.ok()) return s.status();
    reqs.push_back(*s);
  }
  absl::Status st = comm->WaitAll(reqs, deadline);
  if (!st.ok()) return st;
  for (int p = 0; p < n; ++p) {
    if (p == rank) continue;
    if (in[p].rank != p) {
      return absl::DataLossError(absl::StrCat("bad hello from peer ", p, " at ", addresses[p],
                                              ": it says it is member ", in[p].rank));
    }
    if (in[p].job != me.job) {
      return absl::FailedPreconditionError(absl::StrCat("peer ", p, " at ", addresses[p],
                                                        " is not a member of job '", job,
                                                        "' (its hello names another job)"));
    }
  }
  if (absl::Status s = comm->ListenForNotices(); !s.ok()) return s;
  return std::unique_ptr<Comm>(std::move(comm));
}

}  // namespace ragshard::daemon
