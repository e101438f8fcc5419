// What the planner's parts share about parked calls: a unary call answered later (when an event
// comes or its deadline passes), and the work collected under a lock to run once it is released,
// so that no reactor is finished and no stream written under a lock.
#pragma once

#include <chrono>
#include <functional>
#include <vector>

#include "grpcpp/grpcpp.h"

namespace ragshard::planner {

using Clock = std::chrono::system_clock;

// Work to run after the locks are released.
using Deferred = std::vector<std::function<void()>>;

inline void RunDeferred(Deferred* deferred) {
  for (auto& f : *deferred) f();
  deferred->clear();
}

// Finishes `reactor` with `status` once the locks are released.
inline void FinishLater(Deferred* deferred, grpc::ServerUnaryReactor* reactor,
                        const grpc::Status& status) {
  deferred->push_back([reactor, status] { reactor->Finish(status); });
}

// A unary call parked until an event or its deadline.
struct Parked {
  grpc::ServerUnaryReactor* reactor = nullptr;
  Clock::time_point deadline;
};

}  // namespace ragshard::planner
