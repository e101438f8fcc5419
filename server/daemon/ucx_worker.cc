// The UCX worker: its configuration (transports, tcp puts, the spin before sleeping), the
// listener on the data port and the credential and peer-host check of each incoming connection,
// endpoint errors, and progress. The communicator it makes is in ucx_comm.cc.
#include <arpa/inet.h>
#include <netinet/in.h>

#include <cstdlib>
#include <set>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "server/daemon/ucx_comm.h"
#include "server/daemon/ucx_worker_impl.h"

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

std::chrono::microseconds UcxSpinFromEnvironment() {
  const char* s = std::getenv("RAGSHARD_UCX_SPIN_US");
  if (s == nullptr) return kUcxDefaultSpin;
  int64_t us = 0;
  if (!absl::SimpleAtoi(s, &us) || us < 0 || us > 1'000'000) {
    LOG(WARNING) << "RAGSHARD_UCX_SPIN_US='" << s << "' is not microseconds in [0, 1e6]; "
                 << kUcxDefaultSpin.count();
    return kUcxDefaultSpin;
  }
  return std::chrono::microseconds(us);
}

void UcxWorker::Impl::OnConnRequest(ucp_conn_request_h req, void* arg) {
  auto* self = static_cast<Impl*>(arg);
  ucp_conn_request_attr_t attr{};
  attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR | UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ID;
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

void UcxWorker::Impl::OnEpError(void* arg, ucp_ep_h ep, ucs_status_t status) {
  auto* self = static_cast<Impl*>(arg);
  for (size_t r = 0; r < self->eps.size(); ++r) {
    if (self->eps[r] == ep) {
      if (self->failed.insert(static_cast<int>(r)).second) {
        LOG(WARNING) << "data plane: peer " << r << " lost: " << ucs_status_string(status);
      }
    }
  }
}

absl::StatusOr<std::unique_ptr<UcxWorker>> UcxWorker::Create(const std::string& ip, int port,
                                                             uint64_t credential,
                                                             std::chrono::microseconds spin) {
  std::unique_ptr<UcxWorker> w(new UcxWorker());
  w->credential_ = credential;
  w->impl_ = std::make_unique<Impl>();
  Impl& impl = *w->impl_;
  impl.owner = w.get();
  impl.spin = absl::FromChrono(spin);
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

}  // namespace ragshard::daemon
