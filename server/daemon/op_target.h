// What a rank's operations start on: a job's runtime (JobRuntime), or a fake in tests. The
// gRPC handlers and the command queue's poller (command_poller.h) both call it.
#pragma once

#include <cstdint>
#include <functional>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "ragshard/v1/daemon.pb.h"

namespace ragshard::daemon {

class OpTarget {
 public:
  virtual ~OpTarget() = default;
  // Local rank `local` starts the operation `req` names: its sequence number, or why not.
  virtual absl::StatusOr<uint64_t> StartOp(int local, const v1::StartRequest& req) = 0;
  // Calls `done(true, status, placement)` once operation `seq` completes (placement: where
  // `local`'s buffers are then, or nullptr), or `done(false, OK, nullptr)` at `deadline`.
  // Never blocks; `done` never runs under the target's locks.
  using WaitCallback = std::function<void(bool, const absl::Status&, const v1::UnitBuffers*)>;
  virtual void AddWaiter(uint64_t seq, int local, absl::Time deadline, WaitCallback done) = 0;
};

}  // namespace ragshard::daemon
