// The communicator between daemons over a UcxWorker: tagged sends and receives checked against
// the receiver's stamp, abort notices, waits, and Connect with its hello round (the worker itself,
// its configuration and its credential check: ucx_worker.cc).
#include "server/daemon/ucx_comm.h"

#include <algorithm>
#include <atomic>
#include <deque>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "server/daemon/ucx_worker_impl.h"

namespace ragshard::daemon {
namespace {

constexpr int kRankBits = 16;
constexpr uint64_t kTagMask = (uint64_t{1} << (64 - kRankBits)) - 1;
constexpr uint64_t kRankMask = ~kTagMask;
// A data receive matches its peer and the message's index and lane; the rest of the stamp is
// checked.
constexpr uint64_t kDataMask = kRankMask | MessageStamp::kMatchMask;
// The transport's own messages.
const uint64_t kHelloTag =
    MessageStamp{0, 0, MessageStamp::kControl, MessageStamp::kIndexMask - 1}.Tag();
const uint64_t kNoticeTag =
    MessageStamp{0, 0, MessageStamp::kControl, MessageStamp::kIndexMask}.Tag();
// A notice receive takes any peer's abort notice.
constexpr uint64_t kNoticeMask =
    MessageStamp::kMatchMask |
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

  void Interrupt(const std::string& why) override {
    absl::MutexLock lock(&waiting_mu_);
    if (interrupted_.load()) return;
    interrupt_ = why;
    interrupted_.store(true, std::memory_order_release);
  }

  void SetDescriber(TagDescriber describe) override { describe_ = std::move(describe); }

  using Comm::WaitAll;
  absl::Status WaitAll(const std::vector<uint64_t>& ids, absl::Time deadline,
                       const IdleWork& idle) override {
    absl::Status result;
    bool idle_left = static_cast<bool>(idle);
    absl::Time publish = absl::Now() + absl::Milliseconds(100);
    while (true) {
      if (absl::Now() >= publish) {
        PublishWaiting(ids);
        publish = absl::Now() + absl::Milliseconds(100);
      }
      bool all = true;
      result = Check(ids, &all);
      if (!result.ok() || all) break;
      if (absl::Now() >= deadline) {
        result = Late(ids);
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
    End(ids, result);
    {
      absl::MutexLock lock(&waiting_mu_);
      waiting_.clear();
    }
    return result;
  }

  absl::StatusOr<bool> Poll(const std::vector<uint64_t>& ids, absl::Time deadline) override {
    while (ucp_worker_progress(w_->worker) != 0) {
    }
    bool all = true;
    absl::Status result = Check(ids, &all);
    if (result.ok() && !all) {
      if (absl::Now() < deadline) return false;
      result = Late(ids);
    }
    End(ids, result);
    if (!result.ok()) return result;
    return true;
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

  // Where the requests `ids` stand: an error (a peer's abort notice, an interrupt, a lost peer,
  // a message that does not match: the peers are told), or OK with `all` false while some are
  // still in flight.
  absl::Status Check(const std::vector<uint64_t>& ids, bool* all) {
    if (notice_.done) return Notice();
    if (interrupted_.load(std::memory_order_acquire)) {
      absl::MutexLock lock(&waiting_mu_);
      return absl::AbortedError(interrupt_);
    }
    for (uint64_t id : ids) {
      if (id < base_) continue;  // waited for by an earlier WaitAll
      Pending& p = *At(id);
      if (!p.done) {
        *all = false;
        if (w_->failed.count(p.peer)) {
          // A peer that stopped the job leaves after its notice: prefer the notice.
          const absl::Time grace = absl::Now() + absl::Milliseconds(200);
          while (!notice_.done && absl::Now() < grace) w_->Progress(absl::Milliseconds(1));
          return notice_.done ? Notice() : Lost(p.peer);
        }
      } else if (p.recv && p.checked &&
                 (p.status == UCS_OK || p.status == UCS_ERR_MESSAGE_TRUNCATED) &&
                 (p.stamp() != p.want_tag || p.sent_bytes != p.want_bytes)) {
        absl::Status mismatch = MismatchError(rank_, p.peer, p.stamp(), p.sent_bytes, p.want_tag,
                                              p.want_bytes, describe_);
        // Every peer stops too, with this error, instead of waiting for its deadline.
        Abort(std::string(mismatch.message()));
        return mismatch;
      } else if (p.status != UCS_OK) {
        return w_->failed.count(p.peer)
                   ? Lost(p.peer)
                   : UcsStatus(p.status, absl::StrCat("transfer with ", Peer(p.peer)));
      }
    }
    return absl::OkStatus();
  }

  // The deadline's error, naming a peer still waited for.
  absl::Status Late(const std::vector<uint64_t>& ids) {
    int peer = -1;
    for (uint64_t id : ids) {
      if (id >= base_ && !At(id)->done) peer = At(id)->peer;
    }
    return absl::DeadlineExceededError(
        absl::StrCat("transfer with ", Peer(peer), " did not complete before the deadline"));
  }

  // After a wait: the requests `ids` waited for (their bookkeeping freed once nothing else is in
  // flight), or, on an error, everything in flight given up.
  void End(const std::vector<uint64_t>& ids, const absl::Status& result) {
    if (result.ok()) {
      for (uint64_t id : ids) {
        if (id >= base_) At(id)->waited = true;
      }
      Reap();
    } else {
      Abandon();
    }
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
  std::string interrupt_ ABSL_GUARDED_BY(waiting_mu_);  // Interrupt's why
  std::atomic<bool> interrupted_{false};
  std::atomic<int64_t> sent_bytes_{0};
};

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
