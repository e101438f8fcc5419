// One node's heartbeat stream to the planner (Planner.HeartbeatStream): a long-lived call on
// which each heartbeat is a message and its answer another, in place of a unary call per beat
// (issue 73: the planner's cost per beat, and a daemon's, is a message's, not a call's).
//
// Thread-safe; Beat calls are serialized (a node beats from one thread).
#pragma once

#include <chrono>
#include <memory>

#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"
#include "infra/rpc.h"
#include "ragshard/v1/planner.grpc.pb.h"

namespace ragshard {

class HeartbeatStream {
 public:
  // `stub` and `security` outlive the stream.
  HeartbeatStream(v1::Planner::Stub* stub, const ClientSecurity* security);
  ~HeartbeatStream();  // cancels the open call and waits for gRPC to be done with it
  HeartbeatStream(const HeartbeatStream&) = delete;
  HeartbeatStream& operator=(const HeartbeatStream&) = delete;

  // Sends `request` and waits up to `timeout` for its answer, into *response. The call is opened
  // at the first beat and again after one ended. A beat not answered within `timeout` cancels the
  // call (DEADLINE_EXCEEDED: a stalled stream misses beats as unary calls would); a call that
  // ended answers the status it ended with (UNIMPLEMENTED from a planner without the method).
  grpc::Status Beat(const v1::HeartbeatRequest& request, std::chrono::milliseconds timeout,
                    v1::HeartbeatResponse* response);

 private:
  class Call;
  v1::Planner::Stub* const stub_;
  const ClientSecurity* const security_;
  absl::Mutex mu_;  // serializes beats
  std::unique_ptr<Call> call_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ragshard
