// Internal to the UCX transport (server/daemon/ucx_worker.cc and ucx_comm.cc): the worker's
// state, shared by the worker and the communicator it makes. Not part of ucx_comm.h's interface.
#pragma once

#include <netinet/in.h>
#include <poll.h>
#include <ucp/api/ucp.h>

#include <algorithm>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/daemon/ucx_comm.h"

namespace ragshard::daemon {

// "IPv4:port" as a socket address (ucx_worker.cc).
absl::StatusOr<sockaddr_in> ParseAddress(const std::string& address);

struct UcxWorker::Impl {
  UcxWorker* owner = nullptr;
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  ucp_listener_h listener = nullptr;
  int efd = -1;
  // How long Progress polls before it sleeps (UcxWorker::Create's `spin`).
  absl::Duration spin = absl::FromChrono(kUcxDefaultSpin);
  std::vector<ucp_ep_h> accepted;  // server-side endpoints
  // Peers whose endpoint reported an error, by rank of the current comm.
  std::set<int> failed;
  std::vector<ucp_ep_h> eps;  // client endpoints of the current comm, by rank

  // The listener's connection handler: accepts a peer host presenting the credential
  // (ucx_worker.cc).
  static void OnConnRequest(ucp_conn_request_h req, void* arg);
  // Marks the peer of a failed client endpoint as lost (ucx_worker.cc).
  static void OnEpError(void* arg, ucp_ep_h ep, ucs_status_t status);

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

}  // namespace ragshard::daemon
