// NodeDaemon's background threads: the descriptor side channel (it passes the pool's memfd to
// attached processes and notices those that die), the heartbeats to the planner (and what its
// replies say of the jobs), and the clock that answers waits at their deadline.
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "protocol/command_queue.h"
#include "protocol/fd_passing.h"
#include "server/daemon/daemon.h"
#include "server/daemon/job_runtime.h"
#include "server/daemon/peer_check.h"

namespace ragshard::daemon {

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
      // The socket's mode lets in the daemon's user and its group's members; the credentials
      // the kernel recorded at connect are checked too (a socket file's mode can be changed).
      absl::Status allowed = absl::OkStatus();
      if (conn.valid()) {
        auto cred = PeerCredentialsOf(conn.get());
        allowed = cred.ok() ? CheckPeer(*cred, SupplementaryGroups(cred->pid), ::geteuid(),
                                        socket_gid_, options_.socket_group)
                            : cred.status();
        if (!allowed.ok()) {
          LOG(WARNING) << "side channel: " << allowed.message();
          metrics_->Error(allowed);
          (void)SendWithFds(conn.get(), absl::StrCat("error: ", allowed.message()), {});
          conn = ScopedFd();
        }
      }
      if (conn.valid()) {
        timeval tv{2, 0};
        ::setsockopt(conn.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
        auto msg = ReceiveWithFds(conn.get(), 0);
        // "ID" asks for the arena; "queue ID" for the arena, then the attachment's command
        // queue and its doorbell (docs/daemon.md). Without a queue (none could be made) the
        // rank uses gRPC alone.
        std::string id = msg.ok() ? msg->payload : std::string();
        const bool wants_queue = absl::StartsWith(id, kQueueRequest);
        if (wants_queue) id = id.substr(sizeof(kQueueRequest) - 1);
        absl::StatusOr<std::pair<std::shared_ptr<JobRuntime>, int>> found =
            absl::UnknownError("no attachment id");
        if (msg.ok()) found = FindAttachment(id);
        std::vector<ScopedFd> queue;
        if (found.ok() && wants_queue) {
          auto q = poller_->Add(id, found->first, found->second);
          if (q.ok()) {
            queue = std::move(*q);
          } else {
            LOG(WARNING) << "attachment " << id << " gets no command queue: " << q.status();
          }
        }
        std::vector<int> pass = {pool_->arena().fd()};
        for (const ScopedFd& f : queue) pass.push_back(f.get());
        if (found.ok() && SendWithFds(conn.get(), "ok", pass).ok()) {
          const int fd = conn.get();
          clients[fd] = {std::move(conn), id};
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
          ReleaseAttachment(it->second.second, /*clean=*/false);
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
    hb.set_incarnation(incarnation_);
    PoolStats s = pool_->Stats();
    auto* f = hb.mutable_figures();
    f->set_pool_capacity_bytes(s.capacity);
    f->set_pool_used_bytes(s.used);
    f->set_pool_peak_bytes(s.peak);
    f->set_pool_fragmentation(s.fragmentation);
    f->set_buffers(s.leases);
    {
      absl::MutexLock lock(&mu_);
      f->set_attachments(static_cast<int64_t>(attachments_.size()));
    }
    std::vector<v1::RankProgress> progress;
    const auto jobs = JobsSnapshot(&progress);
    for (auto& p : progress) *f->add_ranks() = std::move(p);
    std::map<std::string, int64_t> by_kind;
    f->set_jobs(static_cast<int64_t>(jobs.size()));
    for (const auto& [id, js] : jobs) {
      hb.add_jobs(id);
      f->set_operations(f->operations() + js.operations());
      f->set_staging_bytes(f->staging_bytes() + js.staging_bytes());
      for (const auto& u : js.unit_operations()) by_kind[v1::OpKind_Name(u.kind())] += u.count();
    }
    for (const auto& [kind, count] : by_kind) {
      v1::KindCount* k = f->add_operations_by_kind();
      k->set_kind(kind);
      k->set_count(count);
    }
    const absl::Time sent = absl::Now();
    auto resp = planner_->Heartbeat(hb);
    if (!resp.ok()) {
      if (absl::IsNotFound(resp.status())) {
        (void)planner_->RegisterNode(Registration());
      } else if (absl::IsFailedPrecondition(resp.status())) {
        FenceStale(resp.status());
      } else {
        LOG_EVERY_N(WARNING, 10) << "heartbeat: " << resp.status();
      }
      continue;
    }
    if (lease_.Acknowledged(sent, resp->lease_ms())) {
      LOG(WARNING) << "the planner acknowledges this node's heartbeats again: the fence ends "
                      "(jobs that recover in place go on recovering; the jobs it stopped stay "
                      "failed)";
    }
    for (const v1::JobFailure& f : resp->failed_jobs()) {
      if (std::shared_ptr<JobRuntime> job = FindJob(f.job_id()); job != nullptr) {
        job->Fail(absl::UnavailableError(
            absl::StrCat("job '", f.job_id(), "' stopped by the planner: ", f.error())));
      }
    }
    for (const v1::JobRecovery& r : resp->recovering_jobs()) {
      if (std::shared_ptr<JobRuntime> job = FindJob(r.job_id()); job != nullptr) {
        job->BeginRecovery(r.epoch(), absl::FromUnixMillis(r.deadline_unix_ms()), r.lost());
      }
    }
    for (const std::string& job : resp->release_jobs()) DropJob(job, "deleted by the planner");
  }
}

void NodeDaemon::FenceJobs(const absl::Status& fence) {
  LOG(ERROR) << fence.message();
  std::fprintf(stderr, "ragshardd %s: %s\n", options_.node_id.c_str(),
               std::string(fence.message()).c_str());
  std::vector<std::shared_ptr<JobRuntime>> jobs;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, job] : jobs_) jobs.push_back(job);
  }
  // A job that does not go on without this node fails where the planner declares it lost, and
  // rides out an outage of the planner; one that recovers in place starts a recovery.
  for (const auto& job : jobs) {
    if (job->fenced_with_node()) job->Fence(fence);
  }
}

void NodeDaemon::FenceStale(const absl::Status& refused) {
  // Another daemon holds the node id and the jobs went on without this one: it must not write
  // to them again, nor register again (it would take the id back). Its jobs fail naming why and
  // it ends at once, without the shutdown's cleanup: its socket paths may be the replacement's
  // now (on one host), and gRPC's shutdown removes a Unix socket's path whoever bound it last.
  const absl::Status stale = absl::FailedPreconditionError(absl::StrCat(
      "the planner refuses this daemon's heartbeat: ", refused.message(), "; ragshardd exits"));
  LOG(ERROR) << stale.message();
  std::vector<std::shared_ptr<JobRuntime>> jobs;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, job] : jobs_) jobs.push_back(job);
  }
  for (const auto& job : jobs) job->Fail(stale);
  std::fprintf(stderr, "ragshardd %s: %s\n", options_.node_id.c_str(),
               std::string(stale.message()).c_str());
  std::fflush(stderr);
  google::FlushLogFiles(google::GLOG_INFO);
  std::_Exit(kStaleExitCode);
}

void NodeDaemon::RunWaiterClock() {
  while (!stop_.WaitForNotificationWithTimeout(absl::Milliseconds(50))) {
    if (lease_.Expire(absl::Now())) FenceJobs(lease_.Fenced());
    std::vector<std::shared_ptr<JobRuntime>> jobs;
    {
      absl::MutexLock lock(&mu_);
      for (const auto& [id, job] : jobs_) jobs.push_back(job);
    }
    for (const auto& job : jobs) job->ServeWaiters();
    // Registrations whose wait for the node's other ranks ran out go with the ranks that came.
    SendRegistrations(registrations_.Expire(absl::Now()));
  }
}

std::vector<std::pair<std::string, v1::JobStats>> NodeDaemon::JobsSnapshot(
    std::vector<v1::RankProgress>* progress) const {
  std::vector<std::shared_ptr<JobRuntime>> jobs;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, job] : jobs_) jobs.push_back(job);
  }
  // The jobs' figures outside the daemon's lock (each job has its own).
  std::vector<std::pair<std::string, v1::JobStats>> out;
  for (const auto& job : jobs) {
    v1::JobStats js;
    job->FillStats(&js);
    out.emplace_back(js.job_id(), std::move(js));
    if (progress != nullptr) job->FillProgress(progress);
  }
  return out;
}

std::vector<prometheus::MetricFamily> NodeDaemon::ScrapeFigures() const {
  const PoolStats s = pool_->Stats();
  double attachments = 0;
  {
    absl::MutexLock lock(&mu_);
    attachments = static_cast<double>(attachments_.size());
  }
  double staging = 0;
  const auto jobs = JobsSnapshot();
  for (const auto& [id, js] : jobs) staging += static_cast<double>(js.staging_bytes());
  auto one = [](const char* name, const char* help, double value) {
    return GaugeFamily(name, help, "", {{"", value}});
  };
  return {
      one("ragshard_daemon_pool_capacity_bytes", "Bytes of the node's shared-memory pool",
          static_cast<double>(s.capacity)),
      one("ragshard_daemon_pool_used_bytes", "Bytes of the pool leased now",
          static_cast<double>(s.used)),
      one("ragshard_daemon_pool_peak_bytes", "Most bytes of the pool leased at once",
          static_cast<double>(s.peak)),
      one("ragshard_daemon_pool_largest_free_bytes", "The pool's largest free block",
          static_cast<double>(s.largest_free)),
      one("ragshard_daemon_pool_fragmentation",
          "1 - largest free block / free bytes (0: the free space is one block)", s.fragmentation),
      one("ragshard_daemon_pool_leases", "Buffers leased from the pool now",
          static_cast<double>(s.leases)),
      one("ragshard_daemon_jobs", "Jobs this daemon holds", static_cast<double>(jobs.size())),
      one("ragshard_daemon_attachments", "Ranks attached to this daemon", attachments),
      one("ragshard_daemon_staging_bytes",
          "Bytes the jobs wrote into pool buffers outside the collectives (design: 0)", staging),
  };
}

}  // namespace ragshard::daemon
