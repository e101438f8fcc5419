#include "server/daemon/recovery_state.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace ragshard::daemon {

RecoveryState::RecoveryState(std::string job_id, size_t locals)
    : job_id_(std::move(job_id)),
      locals_(locals),
      generation_(locals, 0),
      rejoined_(locals, false) {}

void RecoveryState::Enable(int64_t epoch, absl::Duration deadline, Reconnect reconnect,
                           RelayComm* relay) {
  absl::MutexLock lock(&mu_);
  recoverable_ = true;
  recovery_deadline_ = deadline;
  epoch_ = epoch;
  reconnect_ = std::move(reconnect);
  relay_ = relay;
}

bool RecoveryState::recoverable() {
  absl::MutexLock lock(&mu_);
  return recoverable_;
}

int64_t RecoveryState::epoch() {
  absl::MutexLock lock(&mu_);
  return epoch_;
}

RecoveryState::Phase RecoveryState::phase() {
  absl::MutexLock lock(&mu_);
  return phase_;
}

bool RecoveryState::running() {
  absl::MutexLock lock(&mu_);
  return phase_ == Phase::kRunning;
}

absl::Status RecoveryState::notice() {
  absl::MutexLock lock(&mu_);
  return phase_ == Phase::kRunning ? absl::OkStatus() : notice_;
}

RecoveryState::View RecoveryState::view() {
  absl::MutexLock lock(&mu_);
  View v{phase_, epoch_, target_, deadline_, lost_, {}};
  for (size_t i = 0; i < locals_; ++i) {
    if (!rejoined_[i]) v.missing.push_back(static_cast<int>(i));
  }
  return v;
}

RecoveryState::Joined RecoveryState::Rejoin(int local) {
  absl::MutexLock lock(&mu_);
  Joined out;
  out.adopted = generation_[local] > 0;
  out.generation = ++generation_[local];
  if (phase_ != Phase::kRunning) rejoined_[local] = true;
  return out;
}

bool RecoveryState::Left(int local, uint64_t generation) {
  absl::MutexLock lock(&mu_);
  if (generation != generation_[local]) return false;
  rejoined_[local] = false;
  return true;
}

bool RecoveryState::rejoining(int local) {
  absl::MutexLock lock(&mu_);
  return phase_ != Phase::kRunning && !rejoined_[local];
}

bool RecoveryState::all_rejoined() {
  absl::MutexLock lock(&mu_);
  for (bool r : rejoined_) {
    if (!r) return false;
  }
  return true;
}

absl::Status RecoveryState::Start(const std::string& lost) {
  absl::MutexLock lock(&mu_);
  return StartLocked(lost);
}

absl::Status RecoveryState::StartLocked(const std::string& lost) {
  if (!recoverable_ || phase_ != Phase::kRunning) return absl::OkStatus();
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
  rejoined_.assign(locals_, false);
  return notice_;
}

absl::Status RecoveryState::Named(int64_t epoch, absl::Time deadline, const std::string& lost) {
  absl::MutexLock lock(&mu_);
  if (!recoverable_ || epoch <= epoch_) return absl::OkStatus();
  if (phase_ == Phase::kRecovering && target_ == epoch) {
    deadline_ = deadline;
    return absl::OkStatus();
  }
  absl::Status started = StartLocked(lost);
  phase_ = Phase::kRecovering;
  target_ = epoch;
  deadline_ = deadline;
  return started;
}

bool RecoveryState::reporting() {
  absl::MutexLock lock(&mu_);
  return phase_ == Phase::kReporting;
}

bool RecoveryState::Accept(int64_t epoch, absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  if (phase_ != Phase::kReporting || epoch <= epoch_) return false;
  phase_ = Phase::kRecovering;
  target_ = epoch;
  deadline_ = deadline;
  LOG(INFO) << "job " << job_id_ << ": recovering in epoch " << target_;
  return true;
}

bool RecoveryState::TakeCommAbort() {
  absl::MutexLock lock(&mu_);
  return !std::exchange(comm_aborted_, true);
}

void RecoveryState::MarkCommAborted() {
  absl::MutexLock lock(&mu_);
  comm_aborted_ = true;
}

void RecoveryState::Finish(int64_t target) {
  absl::MutexLock lock(&mu_);
  epoch_ = target;
  phase_ = Phase::kRunning;
  notice_ = absl::OkStatus();
  rejoined_.assign(locals_, false);
}

}  // namespace ragshard::daemon
