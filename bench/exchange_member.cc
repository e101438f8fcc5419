// One member of bench/exchange_bound (a daemon's process): the collectives' exchanges over UCX
// with the daemons' settings and nothing else, as exchange_bound.cc describes them.
#include "bench/exchange_member.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/wait.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "bench/bench_common.h"

namespace ragshard::bench {
namespace {

// server/daemon/collectives.h, copied so that the bound does not move with the daemon's code.
constexpr size_t kDirectMaxBlockBytes = 64 * 1024;
constexpr size_t kMinPieceBytes = size_t{1} << 20;
constexpr size_t kMaxPieces = 16;
constexpr size_t kRingPieceAlignBytes = 64;  // all-gather pieces
constexpr size_t kPieceAlignElems = 16;      // reduce-scatter pieces, in fp32 elements

size_t PiecesFor(size_t step_bytes, int members) {
  if (members < 2) return 1;
  const size_t by_size = std::clamp<size_t>(step_bytes / kMinPieceBytes, 1, kMaxPieces);
  const size_t by_index = std::max<size_t>(1, (size_t{1} << 14) / static_cast<size_t>(members - 1));
  return std::min(by_size, by_index);
}

// [0, total) cut into `count` pieces whose starts are multiples of `align` (collectives.cc).
struct Pieces {
  size_t total, count, align;
  size_t lo(size_t j) const { return j == 0 ? 0 : total * j / count / align * align; }
  size_t hi(size_t j) const { return j + 1 == count ? total : lo(j + 1); }
  size_t bytes(size_t j) const { return hi(j) - lo(j); }
};

int Mod(int a, int n) { return ((a % n) + n) % n; }

void Die(const std::string& why) {
  std::fprintf(stderr, "error: %s\n", why.c_str());
  std::fflush(stderr);
  _exit(1);
}

std::string Str(ucs_status_t s) { return ucs_status_string(s); }

// A context with the daemon's configuration; `transport` replaces UCX_TLS where not empty.
ucs_status_t InitContext(const std::string& transport, ucp_context_h* context) {
  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) return s;
  if (!transport.empty()) {
    s = ucp_config_modify(config, "TLS", transport.c_str());
  } else if (std::getenv("UCX_TLS") == nullptr) {
    s = ucp_config_modify(config, "TLS", "tcp");
  }
  if (s == UCS_OK && std::getenv("UCX_TCP_PUT_ENABLE") == nullptr) {
    (void)ucp_config_modify(config, "TCP_PUT_ENABLE", "n");  // as the daemon: warns, goes on
  }
  if (s == UCS_OK) {
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
    s = ucp_init(&params, config, context);
  }
  ucp_config_release(config);
  return s;
}

struct Req {
  bool done = false;
  bool waited = false;
  ucs_status_t status = UCS_OK;
  void* request = nullptr;
};

class Member {
 public:
  Member(int rank, int n, const std::string& transport, long spin_us)
      : rank_(rank), n_(n), spin_us_(spin_us) {
    ucs_status_t s = InitContext(transport, &context_);
    if (s != UCS_OK) Die("transport '" + TransportName(transport) + "': ucp_init: " + Str(s));
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    if ((s = ucp_worker_create(context_, &wp, &worker_)) != UCS_OK) Die("worker: " + Str(s));
    if ((s = ucp_worker_get_efd(worker_, &efd_)) != UCS_OK) Die("worker fd: " + Str(s));
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    sa.sin_port = 0;
    ucp_listener_params_t lp{};
    lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&sa);
    lp.sockaddr.addrlen = sizeof(sa);
    lp.conn_handler.cb = &Member::OnConnRequest;
    lp.conn_handler.arg = this;
    if ((s = ucp_listener_create(worker_, &lp, &listener_)) != UCS_OK) {
      Die("transport '" + TransportName(transport) + "': listen on 127.0.0.1: " + Str(s));
    }
    ucp_listener_attr_t la{};
    la.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    if ((s = ucp_listener_query(listener_, &la)) != UCS_OK) Die("listener: " + Str(s));
    port_ = ntohs(reinterpret_cast<const sockaddr_in*>(&la.sockaddr)->sin_port);
  }

  int port() const { return port_; }

  // Client endpoints to every peer (the daemon's Connect), then a round of small messages both
  // ways that proves each works.
  void Connect(const std::vector<int>& ports, const std::string& transport) {
    eps_.assign(n_, nullptr);
    for (int p = 0; p < n_; ++p) {
      if (p == rank_) continue;
      sockaddr_in sa{};
      sa.sin_family = AF_INET;
      sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      sa.sin_port = htons(static_cast<uint16_t>(ports[p]));
      ucp_ep_params_t params{};
      params.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                          UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
      params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
      params.sockaddr.addr = reinterpret_cast<const sockaddr*>(&sa);
      params.sockaddr.addrlen = sizeof(sa);
      params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
      params.err_handler.cb = [](void* arg, ucp_ep_h, ucs_status_t st) {
        static_cast<Member*>(arg)->lost_ = st;
      };
      params.err_handler.arg = this;
      const ucs_status_t s = ucp_ep_create(worker_, &params, &eps_[p]);
      if (s != UCS_OK) {
        Die("transport '" + TransportName(transport) + "': connect to member " + std::to_string(p) +
            " at 127.0.0.1:" + std::to_string(ports[p]) + ": " + Str(s));
      }
    }
    if (!Barrier(30)) {
      Die("transport '" + TransportName(transport) + "': member " + std::to_string(rank_) +
          " could not exchange a message with its peers over it (the daemons need a transport "
          "with peer error handling between processes, such as tcp)");
    }
  }

  // A message to and from every peer.
  bool Barrier(double seconds) {
    std::vector<uint64_t> in(n_), out(n_, 1);
    std::vector<size_t> reqs;
    const uint64_t tag = NextTag();
    for (int p = 0; p < n_; ++p) {
      if (p == rank_) continue;
      reqs.push_back(Recv(p, tag, &in[p], sizeof(uint64_t)));
      reqs.push_back(Send(p, tag, &out[p], sizeof(uint64_t)));
    }
    return Wait(reqs, seconds);
  }

  // The all-gather's messages for a buffer of n blocks of `block` bytes (block rank() is sent).
  bool AllGather(char* buffer, size_t block) {
    const int n = n_, r = rank_;
    const uint64_t tag = NextTag();
    std::vector<size_t> reqs;
    if (block <= kDirectMaxBlockBytes) {
      for (int p = 0; p < n; ++p) {
        if (p != r) reqs.push_back(Recv(p, tag, buffer + p * block, block));
      }
      for (int p = 0; p < n; ++p) {
        if (p != r) reqs.push_back(Send(p, tag, buffer + r * block, block));
      }
      return Wait(reqs, 120);
    }
    const int next = Mod(r + 1, n), prev = Mod(r - 1, n);
    const Pieces pc{block, n > 2 ? PiecesFor(block, n) : 1, kRingPieceAlignBytes};
    auto at = [&](int b, size_t j) { return buffer + static_cast<size_t>(b) * block + pc.lo(j); };
    std::vector<size_t> recvs, sends;
    for (int s = 0; s < n - 1; ++s) {
      for (size_t j = 0; j < pc.count; ++j) {
        recvs.push_back(Recv(prev, tag + s * pc.count + j, at(Mod(r - s - 1, n), j), pc.bytes(j)));
      }
    }
    for (size_t j = 0; j < pc.count; ++j)
      sends.push_back(Send(next, tag + j, at(r, j), pc.bytes(j)));
    for (int s = 0; s < n - 1; ++s) {
      for (size_t j = 0; j < pc.count; ++j) {
        if (!Wait({recvs[s * pc.count + j]}, 120)) return false;
        if (s == n - 2) continue;
        sends.push_back(
            Send(next, tag + (s + 1) * pc.count + j, at(Mod(r - s - 1, n), j), pc.bytes(j)));
      }
    }
    return Wait(sends, 120);
  }

  // The reduce-scatter's messages: `input` n chunks of `count` floats, `scratch` 2 * count.
  bool ReduceScatter(const float* input, size_t count, float* scratch) {
    const int n = n_, r = rank_;
    const uint64_t tag = NextTag();
    const int next = Mod(r + 1, n), prev = Mod(r - 1, n);
    const Pieces pc{count, PiecesFor(count * sizeof(float), n), kPieceAlignElems};
    float* const bufs[2] = {scratch, scratch + count};
    std::vector<size_t> sends, next_sends, recvs(pc.count);
    auto send_piece = [&](int s, size_t j, const float* from) {
      next_sends.push_back(
          Send(next, tag + s * pc.count + j, from + pc.lo(j), pc.bytes(j) * sizeof(float)));
    };
    for (int s = 0; s < n - 1; ++s) {
      float* const rbuf = bufs[s % 2];
      if (s > 0 && !Wait(sends, 120)) return false;
      sends = std::move(next_sends);
      next_sends.clear();
      for (size_t j = 0; j < pc.count; ++j) {
        recvs[j] = Recv(prev, tag + s * pc.count + j, rbuf + pc.lo(j), pc.bytes(j) * sizeof(float));
      }
      if (s == 0) {
        const float* first = input + static_cast<size_t>(Mod(r - 1, n)) * count;
        for (size_t j = 0; j < pc.count; ++j) send_piece(0, j, first);
        sends = std::move(next_sends);
        next_sends.clear();
      }
      for (size_t j = 0; j < pc.count; ++j) {
        if (!Wait({recvs[j]}, 120)) return false;
        if (s != n - 2) send_piece(s + 1, j, rbuf);  // forwarded unreduced
      }
    }
    sends.insert(sends.end(), next_sends.begin(), next_sends.end());
    return Wait(sends, 120);
  }

  void Close() {
    ucp_request_param_t fp{};
    Finish(ucp_worker_flush_nbx(worker_, &fp), 2);
    for (ucp_ep_h ep : eps_) CloseEp(ep);
    for (ucp_ep_h ep : accepted_) CloseEp(ep);
    ucp_listener_destroy(listener_);
    ucp_worker_destroy(worker_);
    ucp_cleanup(context_);
  }

 private:
  static std::string TransportName(const std::string& transport) {
    if (!transport.empty()) return transport;
    const char* env = std::getenv("UCX_TLS");
    return env != nullptr ? env : "tcp";
  }

  static void OnConnRequest(ucp_conn_request_h req, void* arg) {
    auto* self = static_cast<Member*>(arg);
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                        UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.conn_request = req;
    params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    params.err_handler.cb = [](void*, ucp_ep_h, ucs_status_t) {};  // the client ep reports
    params.err_handler.arg = nullptr;
    ucp_ep_h ep = nullptr;
    if (ucp_ep_create(self->worker_, &params, &ep) == UCS_OK) self->accepted_.push_back(ep);
  }

  void CloseEp(ucp_ep_h ep) {
    if (ep == nullptr) return;
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_EP_CLOSE_FLAG_FORCE;
    Finish(ucp_ep_close_nbx(ep, &param), 1);
  }

  // Progresses the worker until `request` (what a *_nbx call answered) completes or `seconds`
  // pass, then frees it; nothing where the call answered a status instead.
  void Finish(void* request, double seconds) {
    if (!UCS_PTR_IS_PTR(request)) return;
    const double until = Now() + seconds;
    while (ucp_request_check_status(request) == UCS_INPROGRESS && Now() < until) {
      ucp_worker_progress(worker_);
    }
    ucp_request_free(request);
  }

  // The tag of a message: the sender in the top 16 bits (as the daemon's), an operation number
  // and the message's index; receives match all of it.
  uint64_t NextTag() { return (++op_ & 0xffffffffULL) << 16; }
  uint64_t Full(int src, uint64_t tag) const {
    return (static_cast<uint64_t>(src) << 48) | (tag & ((uint64_t{1} << 48) - 1));
  }

  // A new request's id (ids count on across the operations; reqs_[0] is id base_).
  size_t NewReq() {
    reqs_.emplace_back();
    return base_ + reqs_.size() - 1;
  }
  Req& At(size_t id) { return reqs_[id - base_]; }

  size_t Track(size_t id, void* req) {
    Req& q = At(id);
    if (req == nullptr) {
      q.done = true;
    } else if (UCS_PTR_IS_ERR(req)) {
      q.done = true;
      q.status = UCS_PTR_STATUS(req);
    } else {
      q.request = req;
    }
    return id;
  }

  size_t Send(int peer, uint64_t tag, const void* data, size_t bytes) {
    const size_t id = NewReq();
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.send = [](void*, ucs_status_t st, void* user) {
      auto* q = static_cast<Req*>(user);
      q->done = true;
      q->status = st;
    };
    param.user_data = &At(id);
    return Track(id, ucp_tag_send_nbx(eps_[peer], data, bytes, Full(rank_, tag), &param));
  }

  size_t Recv(int peer, uint64_t tag, void* data, size_t bytes) {
    const size_t id = NewReq();
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.recv = [](void*, ucs_status_t st, const ucp_tag_recv_info_t*, void* user) {
      auto* q = static_cast<Req*>(user);
      q->done = true;
      q->status = st;
    };
    param.user_data = &At(id);
    return Track(id, ucp_tag_recv_nbx(worker_, data, bytes, Full(peer, tag), ~uint64_t{0}, &param));
  }

  // The daemon's wait (ucx_worker_impl.h's Progress): progress; when idle, spin yielding the
  // core for up to the spin, then sleep on the worker's fd for up to 1 ms.
  void Progress() {
    if (ucp_worker_progress(worker_) != 0) return;
    for (const double until = Now() + spin_us_ * 1e-6; Now() < until;) {
      std::this_thread::yield();
      if (ucp_worker_progress(worker_) != 0) return;
    }
    if (ucp_worker_arm(worker_) == UCS_OK) {
      pollfd p{efd_, POLLIN, 0};
      poll(&p, 1, 1);
    }
  }

  bool Wait(const std::vector<size_t>& ids, double seconds) {
    const double deadline = Now() + seconds;
    while (true) {
      bool all = true;
      for (size_t id : ids) {
        const Req& q = At(id);
        if (q.done && q.status != UCS_OK) {
          std::fprintf(stderr, "error: member %d: transfer failed: %s\n", rank_,
                       Str(q.status).c_str());
          return false;
        }
        all &= q.done;
      }
      if (all) break;
      if (lost_ != UCS_OK) {
        std::fprintf(stderr, "error: member %d: a peer was lost: %s\n", rank_, Str(lost_).c_str());
        return false;
      }
      if (Now() > deadline) {
        std::fprintf(stderr, "error: member %d: transfers did not complete in %.0f s\n", rank_,
                     seconds);
        return false;
      }
      Progress();
    }
    for (size_t id : ids) {
      Req& q = At(id);
      q.waited = true;
      if (q.request != nullptr) {
        ucp_request_free(q.request);
        q.request = nullptr;
      }
    }
    // Once every request has been waited for, forget them (ids go on from base_).
    if (std::all_of(reqs_.begin(), reqs_.end(), [](const Req& q) { return q.waited; })) {
      base_ += reqs_.size();
      reqs_.clear();
    }
    return true;
  }

  const int rank_, n_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  ucp_listener_h listener_ = nullptr;
  int efd_ = -1;
  int port_ = 0;
  const long spin_us_;
  ucs_status_t lost_ = UCS_OK;
  std::vector<ucp_ep_h> eps_, accepted_;
  std::deque<Req> reqs_;  // stable addresses for the callbacks
  size_t base_ = 0;       // the id of reqs_[0]
  uint64_t op_ = 0;
};

}  // namespace

// Every name of a UCX_TLS-style list must be a transport (or alias) this UCX offers: UCX itself
// only warns about an unknown name among known ones, and the bound would then be measured on
// something other than what was asked for. Returns "" or the error.
std::string CheckTransport(const std::string& list) {
  if (list.empty()) return "--transport: empty (name UCX transports, as UCX_TLS takes them)";
  std::string body = list[0] == '^' ? list.substr(1) : list;
  std::stringstream ss(body);
  std::string name;
  while (std::getline(ss, name, ',')) {
    const std::string bare = name.substr(0, name.find(':'));  // "tcp:aux" is tcp's
    if (bare.empty()) return "--transport '" + list + "': an empty transport name";
    if (bare == "all") continue;
    ucp_context_h ctx = nullptr;
    const ucs_status_t s = InitContext(bare, &ctx);
    if (s != UCS_OK) {
      return "--transport '" + list + "': UCX does not know transport '" + bare +
             "' or offers none of it on this machine (" + Str(s) + "; ucx_info -d lists them)";
    }
    ucp_cleanup(ctx);
  }
  return "";
}

// One member's run: "op,bytes,seconds" lines (its mean per operation) to the pipe `up`, once
// every size is done; its peers' ports come from the pipe `down`.
int RunMember(int rank, int n, const std::vector<size_t>& sizes, const std::string& transport,
              long spin_us, int up, int down) {
  Member m(rank, n, transport, spin_us);
  const std::string mine = std::to_string(m.port()) + "\n";
  if (write(up, mine.data(), mine.size()) < 0) return 11;
  std::vector<int> ports;
  for (const std::string& line : ReadLines(down, n)) ports.push_back(std::atoi(line.c_str()));
  close(down);
  if (static_cast<int>(ports.size()) != n) return 12;
  m.Connect(ports, transport);
  std::string lines;
  for (size_t bytes : sizes) {
    const size_t block = bytes / n;  // a daemon's block: its `ranks` ranks' shards
    const int iters = Iterations(bytes);
    std::vector<char> buf(bytes, static_cast<char>(rank));
    if (!m.AllGather(buf.data(), block) || !m.Barrier(60)) return 3;  // warm-up
    double t0 = Now();
    for (int i = 0; i < iters; ++i) {
      if (!m.AllGather(buf.data(), block)) return 3;
    }
    lines +=
        "allgather," + std::to_string(bytes) + "," + std::to_string((Now() - t0) / iters) + "\n";
    buf = std::vector<char>();
    const size_t count = block / sizeof(float);
    std::vector<float> in(count * n, 1.0f), scratch(2 * count);
    if (!m.ReduceScatter(in.data(), count, scratch.data()) || !m.Barrier(60)) return 4;
    t0 = Now();
    for (int i = 0; i < iters; ++i) {
      if (!m.ReduceScatter(in.data(), count, scratch.data())) return 4;
    }
    lines += "reducescatter," + std::to_string(count * n * sizeof(float)) + "," +
             std::to_string((Now() - t0) / iters) + "\n";
    if (!m.Barrier(60)) return 5;
  }
  m.Close();
  if (write(up, lines.data(), lines.size()) < 0) return 13;
  close(up);
  return 0;
}

}  // namespace ragshard::bench
