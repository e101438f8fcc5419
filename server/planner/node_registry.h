// The planner's node registry: every daemon's node, its data address, figures and liveness.
//
// Thread-safe: its own mutex guards the nodes, and a node's store row is written under it, so
// the database and memory agree; it is a leaf lock (nothing else is locked under it).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "ragshard/v1/planner.pb.h"
#include "server/planner/store.h"

namespace ragshard::planner {

// A node's lease (HeartbeatResponse.lease_ms): three quarters of the node timeout. A daemon with
// no heartbeat acknowledged for this long after it sent one fences itself; the planner counts
// the timeout from the heartbeat's arrival, after its sending, so the daemon has stopped at
// least a quarter of the timeout before the node can be declared lost.
inline int64_t LeaseMs(std::chrono::milliseconds node_timeout) {
  return node_timeout.count() / 4 * 3;
}

class NodeRegistry {
 public:
  explicit NodeRegistry(Store* store) : store_(store) {}

  // The stored nodes, each with a fresh heartbeat grace period from `now_ms`.
  void Load(std::vector<v1::Node> nodes, int64_t now_ms);
  // Records (again) a node, UP; the store's error if it could not be written. A node registered
  // before, LOST or still UP (a restarted or replacement daemon with the same node id), is
  // replaced whole: its old address and figures are dropped. Returns, when the node was UP with
  // another incarnation (both nonzero: a daemon lost without a reset and replaced before its
  // heartbeats timed out), why its daemon before counts as lost; else "".
  absl::StatusOr<std::string> Register(const v1::RegisterNodeRequest& req, int64_t now_ms);
  // Refreshes a registered node's figures (UP again if it was LOST); NOT_FOUND naming it when it
  // never registered; FAILED_PRECONDITION naming both when the heartbeat's incarnation is not
  // the registered one (a stale daemon that another replaced).
  absl::Status Heartbeat(const v1::HeartbeatRequest& req, int64_t now_ms);
  std::vector<v1::Node> List() const;
  // Marks LOST every UP node silent for longer than `timeout` and returns their ids.
  std::vector<std::string> ExpireSilent(int64_t now_ms, std::chrono::milliseconds timeout);
  // How many nodes are in each state.
  std::map<v1::NodeStatus, int64_t> CountByStatus() const;
  size_t size() const;
  // Whether `node_id` is registered and UP (its heartbeats go on).
  bool Up(const std::string& node_id) const;
  // FAILED_PRECONDITION naming both where `node_id`'s daemon of `incarnation` is stale: the node
  // registered since with another incarnation (both nonzero). OK otherwise (unknown nodes too).
  absl::Status CheckIncarnation(const std::string& node_id, uint64_t incarnation) const;

 private:
  static absl::Status Stale(const v1::Node& node, uint64_t incarnation);
  Store* const store_;
  mutable absl::Mutex mu_;
  std::map<std::string, v1::Node> nodes_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ragshard::planner
