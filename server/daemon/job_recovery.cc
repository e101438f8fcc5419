// JobRuntime's recovery in place (docs/recovery.md): a lost rank process, or a peer node's
// notice, stops the job's operations with a recovery notice; the planner names the next epoch;
// every local rank attaches again (the rank processes that were not lost exit on the notice and
// are restarted too, so that all of them redo the interrupted step from its start); the job's
// thread returns the transient buffers, connects the epoch's data plane and runs again from
// operation 1. The persistent shards and the ranks' state buffers stay in the pool throughout.
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "glog/logging.h"
#include "server/daemon/job_runtime.h"

namespace ragshard::daemon {

using Phase = RecoveryState::Phase;

void JobRuntime::EnableRecovery(int64_t epoch, absl::Duration deadline, Reconnect reconnect,
                                RelayComm* relay) {
  absl::MutexLock lock(&mu_);
  recovery_.Enable(epoch, deadline, std::move(reconnect), relay);
}

JobRuntime::Joined JobRuntime::Rejoined(int local) {
  absl::MutexLock lock(&mu_);
  departed_.erase(local);
  if (departed_.empty()) departure_reported_ = false;
  return recovery_.Rejoin(local);
}

void JobRuntime::StartRecovery(const std::string& lost) {
  const absl::Status notice = recovery_.Start(lost);
  if (!notice.ok()) FailUnfinished(notice);
}

void JobRuntime::StopForRecovery(const absl::Status& notice) {
  FailUnfinished(notice);
  if (RelayComm* relay = recovery_.relay(); relay != nullptr) {
    relay->Interrupt(std::string(notice.message()));
  }
}

void JobRuntime::BeginRecovery(int64_t epoch, absl::Time deadline, const std::string& lost) {
  {
    absl::MutexLock lock(&mu_);
    if (!failed_.ok()) return;
    // The lost node may never answer (a host gone without a reset).
    const absl::Status notice = recovery_.Named(epoch, deadline, lost);
    if (!notice.ok()) StopForRecovery(notice);
  }
  ServeWaiters();
}

void JobRuntime::Fence(const absl::Status& fence) {
  bool recover = false;
  {
    absl::MutexLock lock(&mu_);
    if (!failed_.ok() || stopping_) return;
    recover = recovery_.recoverable();
    if (recover && recovery_.running()) {
      // The nodes this one cannot reach never answer the running operation.
      const absl::Status notice = recovery_.Start(std::string(fence.message()));
      if (!notice.ok()) StopForRecovery(notice);
    }
  }
  if (!recover) {
    Fail(fence);
    return;
  }
  ServeWaiters();
}

absl::Status JobRuntime::AwaitRunning(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto running = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return recovery_.running() || !failed_.ok() || stopping_;
  };
  if (!mu_.AwaitWithDeadline(absl::Condition(&running), deadline)) {
    const RecoveryState::View v = recovery_.view();
    return absl::DeadlineExceededError(absl::StrCat(
        "job '", job_id_, "' is recovering (epoch ", v.target,
        "): the other ranks have not all attached again yet; ", recovery_.notice().message()));
  }
  if (stopping_) return absl::AbortedError("the job was released");
  return failed_;
}

absl::StatusOr<RankStates::Buffer> JobRuntime::StateBuffer(int64_t rank, int local,
                                                           const std::string& name, int64_t bytes,
                                                           Pool* pool) {
  return states_.Get(rank, name, bytes, pool, dp_.get(), local);
}

void JobRuntime::FailRecovery(const absl::Status& error) {
  {
    absl::MutexLock lock(&mu_);
    if (!failed_.ok()) return;
    failed_ = error;
    FailPending();
  }
  LOG(ERROR) << "job " << job_id_ << ": " << error;
  Report(error);
  ServeWaiters();
}

void JobRuntime::Recover() {
  std::string lost;
  bool abort_comm = false;
  {
    absl::MutexLock lock(&mu_);
    lost = recovery_.view().lost;
    abort_comm = recovery_.TakeCommAbort();
  }
  // The other nodes hear at once (a waiting collective of theirs with this node ends); the
  // planner's heartbeats tell the rest.
  if (abort_comm && comm_ != nullptr) comm_->Abort(absl::StrCat("recovery in place: ", lost));
  // The old connection goes now, not at the reconnect: a peer's collective with this node that
  // still sends to it (a rendezvous send nobody receives, which cannot be cancelled) fails at
  // once instead of at its bound.
  RelayComm* const relay = recovery_.relay();
  if (relay != nullptr) relay->Close();
  // A protect running in the background dies with the connection, which wrote its last message
  // into it (its parities made whole before it stay): JobRedundancy::AbandonProtect.
  if (JobRedundancy* redundancy = redundancy_state(); redundancy != nullptr) {
    redundancy->AbandonProtect();
  }
  RecoveryState::View v;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      auto changed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !failed_.ok() || recovery_.phase() != Phase::kRecovering ||
               recovery_.all_rejoined();
      };
      if (recovery_.phase() == Phase::kRecovering) {
        mu_.AwaitWithTimeout(absl::Condition(&changed), absl::Milliseconds(50));
      }
      if (stopping_ || !failed_.ok() || recovery_.running()) return;
      v = recovery_.view();
    }
    const bool late = absl::Now() > v.deadline;
    if (v.phase == Phase::kReporting) {
      v1::ReportFailureRequest report;
      report.set_job_id(job_id_);
      report.set_reporter_node_id(node_id_);
      report.set_lost_peer(lost.substr(0, 256));
      report.set_message(lost.substr(0, 1024));
      report.set_recoverable(true);
      report.set_epoch(v.epoch);
      report.set_reporter_incarnation(incarnation_.load());
      auto resp = planner_->ReportFailure(report);
      {
        absl::MutexLock lock(&mu_);
        if (!recovery_.reporting()) continue;  // a heartbeat named the epoch meanwhile
        if (resp.ok() &&
            recovery_.Accept(resp->recovery_epoch(),
                             absl::FromUnixMillis(resp->recovery_deadline_unix_ms()))) {
          continue;
        }
      }
      if (resp.ok()) {
        FailRecovery(absl::UnavailableError(absl::StrCat(
            lost,
            "; the planner did not start a recovery in place (the job is not READY, or "
            "another failure came first: ragshardctl job why)")));
        return;
      }
      if (late) {
        FailRecovery(absl::UnavailableError(
            absl::StrCat(lost, "; the planner could not be told within the recovery deadline: ",
                         resp.status().message())));
        return;
      }
      absl::SleepFor(absl::Milliseconds(200));  // the planner is unreachable: try again
      continue;
    }
    // Recovering: every local rank must attach again.
    if (v.missing.empty()) break;
    if (late) {
      std::vector<std::string> missing;
      for (int i : v.missing) missing.push_back(absl::StrCat(local_ranks_[static_cast<size_t>(i)]));
      FailRecovery(absl::DeadlineExceededError(
          absl::StrCat("the recovery of job '", job_id_, "' in epoch ", v.target, " (", lost,
                       ") ran past its ", "deadline: rank(s) ", absl::StrJoin(missing, ", "),
                       " of node '", node_id_, "' did not attach again")));
      return;
    }
  }
  // Every local rank is back: the transient buffers go, the epoch's data plane connects (its
  // rendezvous waits for the other nodes' ranks), and the job runs again from operation 1.
  dp_->ResetTransient();
  if (recovery_.reconnect() && relay != nullptr) {
    auto connected = recovery_.reconnect()(v.target, v.deadline);
    if (!connected.ok()) {
      FailRecovery(absl::Status(
          connected.status().code(),
          absl::StrCat("the recovery of job '", job_id_, "' in epoch ", v.target, " (", lost,
                       "): connecting the other nodes: ", connected.status().message())));
      return;
    }
    relay->Replace(std::move(connected->first), std::move(connected->second));
  }
  {
    absl::MutexLock lock(&mu_);
    if (stopping_ || !failed_.ok()) return;
    recovery_.Finish(v.target);
    next_seq_.assign(local_ranks_.size(), 1);
    ops_.clear();  // all answered with the notice; the epoch numbers its operations from 1
    queue_.clear();
    departed_.clear();
    departure_reported_ = false;
    report_ = absl::OkStatus();
    abort_ = absl::OkStatus();
    running_seq_ = 0;
  }
  LOG(INFO) << "job " << job_id_ << ": recovered in epoch " << v.target << " on node '" << node_id_
            << "'";
  metrics_->Recovered();
  v1::ReportRecoveredRequest done;
  done.set_job_id(job_id_);
  done.set_node_id(node_id_);
  done.set_epoch(v.target);
  if (auto r = planner_->ReportRecovered(done); !r.ok()) {
    LOG(WARNING) << "job " << job_id_ << ": telling the planner of the recovery: " << r.status();
  }
}

}  // namespace ragshard::daemon
