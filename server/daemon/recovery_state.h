// A job's recovery in place on this node (docs/recovery.md): whether the job recovers in place,
// its epoch, the phase of a recovery in progress (what was lost, the notice its operations get,
// the epoch it recovers in and until when), and the local ranks' attachments. JobRuntime drives
// it (job_recovery.cc); the attaches read it.
//
// Thread-safe. Lock order: JobRuntime's mutex, then this one. JobRuntime changes it only with its
// own mutex held, so that waits on that mutex (the job's thread's, AwaitRunning) see each change;
// reads need no other lock.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/daemon/comm.h"
#include "server/daemon/relay_comm.h"
#include "server/daemon/ucx_comm.h"

namespace ragshard::daemon {

class RecoveryState {
 public:
  // Connects a recovery epoch's data plane (null for a job on one node).
  using Reconnect =
      std::function<absl::StatusOr<std::pair<std::unique_ptr<UcxWorker>, std::unique_ptr<Comm>>>(
          int64_t epoch, absl::Time deadline)>;
  // kReporting: a loss is known here and the planner is being told; kRecovering: the planner
  // named the epoch, and the local ranks attach again.
  enum class Phase { kRunning, kReporting, kRecovering };
  // A new process attached for a local rank: its attachment's generation, and whether a process
  // of this rank had attached before (it adopts the rank's state).
  struct Joined {
    uint64_t generation = 0;
    bool adopted = false;
  };
  // A recovery as the job's thread works on it.
  struct View {
    Phase phase = Phase::kRunning;
    int64_t epoch = 0;   // the epoch the job ran in
    int64_t target = 0;  // the epoch it recovers in (kRecovering)
    absl::Time deadline;
    std::string lost;
    std::vector<int> missing;  // the local ranks that have not attached again
  };

  RecoveryState(std::string job_id, size_t locals);

  // The job recovers in place, from epoch `epoch`, each recovery within `deadline`.
  void Enable(int64_t epoch, absl::Duration deadline, Reconnect reconnect, RelayComm* relay);
  bool recoverable();
  int64_t epoch();
  Phase phase();
  bool running();
  // What an operation gets while a recovery runs (ABORTED, "ragshard recovery in progress"), or
  // OK while the job runs.
  absl::Status notice();
  View view();
  // Enable's; fixed before the job runs.
  const Reconnect& reconnect() const { return reconnect_; }
  RelayComm* relay() const { return relay_; }

  // A process attached for local rank `local`.
  Joined Rejoin(int local);
  // The attachment `generation` of local rank `local` left: false where the rank has attached
  // again since (a later generation), and then nothing changes.
  bool Left(int local, uint64_t generation);
  // Whether local rank `local` has yet to attach again in a recovery in progress.
  bool rejoining(int local);
  bool all_rejoined();

  // A recovery starts, `lost` naming what was lost: returns the notice every operation not done
  // fails with; OK where one runs already (or the job does not recover in place).
  absl::Status Start(const std::string& lost);
  // The planner names epoch `epoch` until `deadline` (a heartbeat): the notice where this
  // starts the recovery (as Start), else OK; an epoch not after the job's is ignored.
  absl::Status Named(int64_t epoch, absl::Time deadline, const std::string& lost);
  // Whether a loss is known here and the planner is being told (Phase::kReporting).
  bool reporting();
  // The planner's answer to that report names epoch `epoch`, the recovery's until `deadline`:
  // true (and the ranks attach again) where it is after the job's epoch.
  bool Accept(int64_t epoch, absl::Time deadline);
  // Once per recovery: true where the job's thread has yet to abort the data plane's connection
  // (it failed already where an operation of it saw the loss: MarkCommAborted).
  bool TakeCommAbort();
  void MarkCommAborted();
  // The recovery is done: the job runs in epoch `target`.
  void Finish(int64_t target);

 private:
  absl::Status StartLocked(const std::string& lost) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string job_id_;
  const size_t locals_;
  Reconnect reconnect_;
  RelayComm* relay_ = nullptr;
  absl::Mutex mu_;
  bool recoverable_ ABSL_GUARDED_BY(mu_) = false;
  absl::Duration recovery_deadline_ ABSL_GUARDED_BY(mu_);
  int64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
  Phase phase_ ABSL_GUARDED_BY(mu_) = Phase::kRunning;
  int64_t target_ ABSL_GUARDED_BY(mu_) = 0;  // the epoch being recovered
  absl::Time deadline_ ABSL_GUARDED_BY(mu_);
  absl::Status notice_ ABSL_GUARDED_BY(mu_);  // what operations get while recovering
  std::string lost_ ABSL_GUARDED_BY(mu_);     // what was lost, for the planner and errors
  bool comm_aborted_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<uint64_t> generation_ ABSL_GUARDED_BY(mu_);  // per local rank
  std::vector<bool> rejoined_ ABSL_GUARDED_BY(mu_);        // attached since the recovery began
};

}  // namespace ragshard::daemon
