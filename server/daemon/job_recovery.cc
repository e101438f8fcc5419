// JobRuntime's recovery in place (docs/recovery.md): a lost rank process, or a peer node's
// notice, stops the job's operations with a recovery notice; the planner names the next epoch;
// every local rank attaches again (the rank processes that were not lost exit on the notice and
// are restarted too, so that all of them redo the interrupted step from its start); the job's
// thread returns the transient buffers, connects the epoch's data plane and runs again from
// operation 1. The persistent shards and the ranks' state buffers stay in the pool throughout.
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "glog/logging.h"
#include "protocol/pool_contract.h"
#include "server/daemon/job_runtime.h"

namespace ragshard::daemon {

void JobRuntime::EnableRecovery(int64_t epoch, absl::Duration deadline, Reconnect reconnect,
                                RelayComm* relay) {
  absl::MutexLock lock(&mu_);
  recoverable_ = true;
  recovery_deadline_ = deadline;
  epoch_ = epoch;
  reconnect_ = std::move(reconnect);
  relay_ = relay;
}

JobRuntime::Joined JobRuntime::Rejoined(int local) {
  absl::MutexLock lock(&mu_);
  departed_.erase(local);
  if (departed_.empty()) departure_reported_ = false;
  Joined out;
  out.adopted = generation_[local] > 0;
  out.generation = ++generation_[local];
  if (phase_ != Phase::kRunning) rejoined_[local] = true;
  return out;
}

void JobRuntime::StartRecovery(const std::string& lost) {
  phase_ = Phase::kReporting;
  target_ = 0;
  deadline_ = absl::Now() + recovery_deadline_;
  comm_aborted_ = false;
  lost_ = lost;
  notice_ = absl::AbortedError(absl::StrCat(
      "ragshard recovery in progress: ", lost,
      "; every rank of the job attaches again and the job redoes its step from the last one "
      "completed"));
  LOG(WARNING) << "job " << job_id_ << ": " << notice_.message();
  rejoined_.assign(local_ranks_.size(), false);
  for (auto& [seq, op] : ops_) {
    if (op.done) continue;
    op.done = true;
    op.status = notice_;
  }
  queue_.clear();
}

void JobRuntime::BeginRecovery(int64_t epoch, absl::Time deadline, const std::string& lost) {
  {
    absl::MutexLock lock(&mu_);
    if (!recoverable_ || !failed_.ok() || epoch <= epoch_) return;
    if (phase_ == Phase::kRecovering && target_ == epoch) {
      deadline_ = deadline;
      return;
    }
    if (phase_ == Phase::kRunning) StartRecovery(lost);
    phase_ = Phase::kRecovering;
    target_ = epoch;
    deadline_ = deadline;
  }
  ServeWaiters();
}

absl::Status JobRuntime::AwaitRunning(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto running = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return phase_ == Phase::kRunning || !failed_.ok() || stopping_;
  };
  if (!mu_.AwaitWithDeadline(absl::Condition(&running), deadline)) {
    return absl::DeadlineExceededError(
        absl::StrCat("job '", job_id_, "' is recovering (epoch ", target_,
                     "): the other ranks have not all attached again yet; ", notice_.message()));
  }
  if (stopping_) return absl::AbortedError("the job was released");
  return failed_;
}

absl::StatusOr<std::pair<const Lease*, bool>> JobRuntime::StateBuffer(int64_t rank,
                                                                      const std::string& name,
                                                                      int64_t bytes, Pool* pool) {
  absl::MutexLock lock(&mu_);
  auto it = state_.find({rank, name});
  if (it != state_.end()) {
    if (it->second.second != bytes) {
      return absl::FailedPreconditionError(
          absl::StrCat("state buffer '", name, "' of rank ", rank, " of job '", job_id_, "' has ",
                       it->second.second, " bytes; asked for ", bytes));
    }
    return std::make_pair(&it->second.first, true);
  }
  auto lease = pool->Allocate(bytes);
  if (!lease.ok()) {
    return absl::Status(lease.status().code(),
                        absl::StrCat("state buffer '", name, "' of rank ", rank, " (", bytes,
                                     " bytes): ", lease.status().message()));
  }
  std::memset(lease->data(), 0, static_cast<size_t>(bytes));
  auto [at, added] =
      state_.emplace(std::make_pair(rank, name), std::make_pair(std::move(*lease), bytes));
  return std::make_pair(&at->second.first, false);
}

void JobRuntime::JournalSteps(int64_t rank, v1::RankProgress* out) const {
  // The step journal's marks (protocol/pool_contract.h; the rank's StepJournal writes them).
  auto it = state_.find({rank, pool::kJournalMeta});
  int64_t steps[pool::kJournalMetaFields] = {};
  steps[pool::kJournalCommitted] = steps[pool::kJournalBegun] = -1;
  if (it != state_.end() && it->second.second >= static_cast<int64_t>(sizeof(steps))) {
    std::memcpy(steps, it->second.first.data(), sizeof(steps));
  }
  out->set_committed_step(steps[pool::kJournalCommitted]);
  out->set_begun_step(steps[pool::kJournalBegun]);
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
    lost = lost_;
    abort_comm = !std::exchange(comm_aborted_, true);
  }
  // The other nodes hear at once (a waiting collective of theirs with this node ends); the
  // planner's heartbeats tell the rest.
  if (abort_comm && comm_ != nullptr) comm_->Abort(absl::StrCat("recovery in place: ", lost));
  // The old connection goes now, not at the reconnect: a peer's collective with this node that
  // still sends to it (a rendezvous send nobody receives, which cannot be cancelled) fails at
  // once instead of at its bound.
  if (relay_ != nullptr) relay_->Close();
  int64_t target = 0;
  absl::Time deadline;
  while (true) {
    Phase phase;
    int64_t epoch = 0;
    {
      absl::MutexLock lock(&mu_);
      auto changed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        if (stopping_ || !failed_.ok() || phase_ != Phase::kRecovering) return true;
        for (bool r : rejoined_) {
          if (!r) return false;
        }
        return true;
      };
      if (phase_ == Phase::kRecovering) {
        mu_.AwaitWithTimeout(absl::Condition(&changed), absl::Milliseconds(50));
      }
      if (stopping_ || !failed_.ok() || phase_ == Phase::kRunning) return;
      phase = phase_;
      epoch = epoch_;
      target = target_;
      deadline = deadline_;
    }
    const bool late = absl::Now() > deadline;
    if (phase == Phase::kReporting) {
      v1::ReportFailureRequest report;
      report.set_job_id(job_id_);
      report.set_reporter_node_id(node_id_);
      report.set_lost_peer(lost.substr(0, 256));
      report.set_message(lost.substr(0, 1024));
      report.set_recoverable(true);
      report.set_epoch(epoch);
      auto resp = planner_->ReportFailure(report);
      absl::MutexLock lock(&mu_);
      if (phase_ != Phase::kReporting) continue;  // a heartbeat named the epoch meanwhile
      if (resp.ok() && resp->recovery_epoch() > epoch_) {
        phase_ = Phase::kRecovering;
        target_ = resp->recovery_epoch();
        deadline_ = absl::FromUnixMillis(resp->recovery_deadline_unix_ms());
        LOG(INFO) << "job " << job_id_ << ": recovering in epoch " << target_;
        continue;
      }
      mu_.Unlock();
      if (resp.ok()) {
        FailRecovery(absl::UnavailableError(absl::StrCat(
            lost,
            "; the planner did not start a recovery in place (the job is not READY, or "
            "another failure came first: ragshardctl job why)")));
        mu_.Lock();
        return;
      }
      if (late) {
        FailRecovery(absl::UnavailableError(
            absl::StrCat(lost, "; the planner could not be told within the recovery deadline: ",
                         resp.status().message())));
        mu_.Lock();
        return;
      }
      absl::SleepFor(absl::Milliseconds(200));  // the planner is unreachable: try again
      mu_.Lock();
      continue;
    }
    // Recovering: every local rank must attach again.
    std::vector<std::string> missing;
    {
      absl::MutexLock lock(&mu_);
      for (size_t i = 0; i < local_ranks_.size(); ++i) {
        if (!rejoined_[i]) missing.push_back(absl::StrCat(local_ranks_[i]));
      }
    }
    if (missing.empty()) break;
    if (late) {
      FailRecovery(absl::DeadlineExceededError(
          absl::StrCat("the recovery of job '", job_id_, "' in epoch ", target, " (", lost,
                       ") ran past its ", "deadline: rank(s) ", absl::StrJoin(missing, ", "),
                       " of node '", node_id_, "' did not attach again")));
      return;
    }
  }
  // Every local rank is back: the transient buffers go, the epoch's data plane connects (its
  // rendezvous waits for the other nodes' ranks), and the job runs again from operation 1.
  dp_->ResetTransient();
  if (reconnect_ && relay_ != nullptr) {
    auto connected = reconnect_(target, deadline);
    if (!connected.ok()) {
      FailRecovery(absl::Status(
          connected.status().code(),
          absl::StrCat("the recovery of job '", job_id_, "' in epoch ", target, " (", lost,
                       "): connecting the other nodes: ", connected.status().message())));
      return;
    }
    relay_->Replace(std::move(connected->first), std::move(connected->second));
  }
  {
    absl::MutexLock lock(&mu_);
    if (stopping_ || !failed_.ok()) return;
    epoch_ = target;
    phase_ = Phase::kRunning;
    notice_ = absl::OkStatus();
    next_seq_.assign(local_ranks_.size(), 1);
    ops_.clear();  // all answered with the notice; the epoch numbers its operations from 1
    queue_.clear();
    departed_.clear();
    departure_reported_ = false;
    report_ = absl::OkStatus();
    abort_ = absl::OkStatus();
    running_seq_ = 0;
    rejoined_.assign(local_ranks_.size(), false);
  }
  LOG(INFO) << "job " << job_id_ << ": recovered in epoch " << target << " on node '" << node_id_
            << "'";
  metrics_->Recovered();
  v1::ReportRecoveredRequest done;
  done.set_job_id(job_id_);
  done.set_node_id(node_id_);
  done.set_epoch(target);
  if (auto r = planner_->ReportRecovered(done); !r.ok()) {
    LOG(WARNING) << "job " << job_id_ << ": telling the planner of the recovery: " << r.status();
  }
}

}  // namespace ragshard::daemon
