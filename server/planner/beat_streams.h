// The planner's HeartbeatStream calls: one long-lived stream per node, on which each heartbeat
// request is answered by one response (issue 73: a heartbeat costs the planner a message, not a
// call). The registry owns the open streams' reactors so that Shutdown can end them.
//
// Thread-safe.
#pragma once

#include <functional>
#include <map>
#include <memory>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"
#include "ragshard/v1/planner.pb.h"

namespace ragshard::planner {

class BeatStreams {
 public:
  // Answers one heartbeat into *response; an error ends the stream with it.
  using Beat = std::function<absl::Status(const v1::HeartbeatRequest&, v1::HeartbeatResponse*)>;
  using Reactor = grpc::ServerBidiReactor<v1::HeartbeatRequest, v1::HeartbeatResponse>;

  // A reactor for a new call, answering its heartbeats with `beat` (which outlives the stream);
  // one that ends at once with `refused` when that is not OK (the call was not admitted), or
  // UNAVAILABLE once the registry is closed.
  Reactor* Open(const absl::Status& refused, Beat beat);
  // Ends every open stream with `status` and refuses new ones. Idempotent.
  void CloseAll(const grpc::Status& status);
  int64_t open() const;

 private:
  class Stream;
  void Remove(Stream* s);

  mutable absl::Mutex mu_;
  std::map<Stream*, std::shared_ptr<Stream>> open_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace ragshard::planner
