// UCX (ucp) transport for the collectives between daemons: one worker with a listener on the
// data port, client endpoints to every peer with peer error handling (which limits UCX to
// network transports: tcp here, RDMA where present), tagged sends and receives.
//
// The data port is authenticated: a worker made with a job's credential (infra/secrets.h)
// presents it with each connection it makes (UCX's client id) and accepts only connections that
// present it, from the job's peer hosts. Others are rejected before they have an endpoint, so no
// message of theirs ever reaches a receive; each rejection is counted and reported.
//
// Threading: a UcxWorker and the Comms it makes are used by one thread at a time; progress is
// driven inside Connect and WaitAll (docs/collectives.md).
#pragma once

#include <ucp/api/ucp.h>

#include <chrono>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "server/daemon/comm.h"

namespace ragshard::daemon {

// The one place where ucs_status_t becomes a Status.
absl::Status UcsStatus(ucs_status_t status, absl::string_view what);

// How long a worker's progress polls, yielding the core, before it sleeps on its event fd
// (docs/collectives.md: 50 us, measured).
inline constexpr std::chrono::microseconds kUcxDefaultSpin{50};

// RAGSHARD_UCX_SPIN_US (microseconds in [0, 1e6], for measuring), else kUcxDefaultSpin; another
// value is logged and ignored. For programs to read once at their top (ragshardd's
// --ucx-spin-us default, the benchmarks).
std::chrono::microseconds UcxSpinFromEnvironment();

class UcxWorker {
 public:
  // Listens on `ip`:`port` (0 picks a free port). A nonzero `credential` is presented and
  // required on every connection; 0 (tests, benchmarks) checks the peer hosts only. `spin`: how
  // long progress polls before it sleeps.
  static absl::StatusOr<std::unique_ptr<UcxWorker>> Create(
      const std::string& ip, int port = 0, uint64_t credential = 0,
      std::chrono::microseconds spin = kUcxDefaultSpin);
  ~UcxWorker();
  UcxWorker(const UcxWorker&) = delete;
  UcxWorker& operator=(const UcxWorker&) = delete;

  // "ip:port" of the listener, to publish through the planner's rendezvous.
  const std::string& address() const { return address_; }

  // Only connections from these hosts are accepted (the planner's peers of the job); others are
  // rejected. Empty allows none except through AllowAnyPeer (tests).
  void AllowPeerHosts(std::set<std::string> hosts);
  void AllowAnyPeer() { allow_any_ = true; }
  // Connections rejected so far: from hosts that are not peers, or without the credential.
  int64_t rejected_connections() const { return rejected_; }
  // Called (on the thread that drives progress) with why, for each rejected connection.
  void set_on_reject(std::function<void(const absl::Status&)> on_reject) {
    on_reject_ = std::move(on_reject);
  }

  // A communicator of job `job` in which this worker is member `rank` and member i listens at
  // addresses[i]. Connects to every peer and exchanges a hello with each before `deadline`; a
  // peer that is another member, or of another job, is an error naming it. At most 16384
  // members. `names` (the members' node ids, or empty) name the peers in errors:
  // "peer 1 (node 'node-1') lost".
  absl::StatusOr<std::unique_ptr<Comm>> Connect(int rank, const std::vector<std::string>& addresses,
                                                absl::Time deadline, absl::string_view job = "",
                                                std::vector<std::string> names = {});

  // Message checks (comm.h) are on unless a benchmark turns them off to measure their cost
  // side by side: receives then match the whole tag and nothing is compared, so a mismatch
  // waits for the deadline. The daemon never turns them off. Set before Connect.
  void set_message_checks(bool on) { message_checks_ = on; }
  bool message_checks() const { return message_checks_; }

  // Drives progress (incoming connections, pending transfers) for up to `max_wait` when idle.
  void Progress(absl::Duration max_wait);

  // Internal, used by the callbacks and UcxComm.
  struct Impl;

 private:
  UcxWorker() = default;
  std::unique_ptr<Impl> impl_;
  std::string address_;
  bool allow_any_ = false;
  bool message_checks_ = true;
  uint64_t credential_ = 0;
  int64_t rejected_ = 0;
  std::function<void(const absl::Status&)> on_reject_;
  std::set<std::string> allowed_hosts_;
  friend struct Impl;
};

}  // namespace ragshard::daemon
