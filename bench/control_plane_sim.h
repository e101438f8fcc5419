// The simulated nodes of control_plane_bench: one process's share of the job's nodes (a
// contiguous range), each on a gRPC connection of its own to the planner, speaking a daemon's
// protocol:
//   * RegisterNode, then a heartbeat every interval the planner answers (1 s), each carrying the
//     node's figures and its K ranks' progress, as ragshardd sends them;
//   * one WatchPlan stream per node, taking the plan compact (zstd), as ragshardd does; the
//     node's ranks get the plan from their daemon (Attach), never from the planner;
//   * each node's K ranks register through the daemon's registration code
//     (server/daemon/node_registration.h, as ragshardd runs it): one RegisterNodeRanks call per
//     node, node 0's carrying the model's inventory (rank 0's), the others its SHA-256;
//   * then the daemon's rendezvous: GetJob (the data secret), ListJobNodes, Put of its data
//     address and one GetKeys for every node's address.
// The first node of the range to get the plan decodes and checks it; every other node compares
// the frame it got with that one, byte for byte (a real daemon would parse its own copy; N parses
// in one process would measure this process, not the planner). The bench compares the ranges'
// frames with each other by their SHA-256.
//
// bench/control_plane_bench.cc runs several such processes (its --worker mode) and drives them
// through their phases; a process reports each phase as one JSON line on its standard output.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "nlohmann/json.hpp"
#include "protocol/planner_client.h"

namespace ragshard::bench {

inline constexpr char kBenchJob[] = "bench";

std::string SimNodeId(int64_t n);
// The data address simulated node n publishes in the rendezvous.
std::string SimDataAddress(int64_t n);

struct SimOptions {
  std::string planner;     // address
  std::string token_file;  // the planner's token
  int64_t nodes = 64;      // of the whole job
  int64_t ranks_per_node = 8;
  int64_t first = 0;  // this process's nodes: [first, first + count)
  int64_t count = 0;
  std::string model = "deepseek-v3";
  std::string granule = "rows:128";
  bool unary_heartbeats = false;  // a unary call per beat, not the node's stream
};

class SimulatedNodes {
 public:
  // Connects the range's nodes, registers them (RegisterNode), starts their heartbeats and
  // opens their plan watches; returns once every watch is open (up to 120 s, else an error).
  static absl::StatusOr<std::unique_ptr<SimulatedNodes>> Start(const SimOptions& o);
  ~SimulatedNodes();

  // Registers the ranks of the range's nodes; `only_node_0`: node 0's alone (it carries the
  // inventory), else every node but node 0. Failures are counted.
  void RegisterRanks(bool only_node_0);
  // Waits (up to 600 s) until every node of the range holds the plan; reports what the watches
  // saw: {"first_at_ns", "all_at_ns", "holding", "mismatched", "corrupt", "frame_sha256",
  // "plan_wire_bytes", "plan_bytes", "error"} (times on the steady clock, which every process of
  // the machine shares).
  nlohmann::json AwaitPlans();
  // The rendezvous, in two phases: every node publishes (GetDataSecret, Put), then every node
  // fetches (ListJobNodes, GetKeys); each answer is checked in full. Reports {"wrong"}.
  void Publish();
  nlohmann::json Fetch();
  int64_t beats() const { return beats_.load(); }
  int64_t interval_ms() const { return interval_.count(); }
  // Stops the heartbeats and closes the watches; reports {"failures", "beat_failures"}.
  nlohmann::json Stop();

  SimulatedNodes(const SimulatedNodes&) = delete;
  SimulatedNodes& operator=(const SimulatedNodes&) = delete;

 private:
  explicit SimulatedNodes(const SimOptions& o) : o_(o) {}
  GrpcPlannerClient& client(int64_t node) { return *clients_[node - o_.first]; }
  void RegisterNode(int64_t n);
  // Counts a failed call (unless !count) and keeps the first failure's text.
  void Failed(absl::string_view call, const absl::Status& why, bool count = true);

  const SimOptions o_;
  std::vector<std::unique_ptr<GrpcPlannerClient>> clients_;
  v1::Inventory inventory_;  // node 0's range only
  std::string sha_;
  std::chrono::milliseconds interval_{1000};

  std::atomic<bool> stop_{false};
  std::atomic<int64_t> beats_{0}, beat_failures_{0}, failures_{0};
  std::vector<std::thread> beaters_;

  // What the plan watches saw.
  absl::Mutex mu_;
  std::string reference_ ABSL_GUARDED_BY(mu_);  // the first frame, decoded and checked
  std::chrono::steady_clock::time_point first_at_ ABSL_GUARDED_BY(mu_), all_at_
      ABSL_GUARDED_BY(mu_);
  int64_t holding_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t mismatched_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t corrupt_ ABSL_GUARDED_BY(mu_) = 0;
  std::string error_ ABSL_GUARDED_BY(mu_);
  std::string first_failure_ ABSL_GUARDED_BY(mu_);
  std::atomic<int64_t> connected_{0};
  std::vector<std::unique_ptr<PlanWatch>> watches_;
};

// The --worker mode: reads the bench's commands ("register-0", "register", "plans", "publish",
// "fetch", "beats", "stop"), one per line on standard input, and answers each with one JSON line.
int RunSimWorker(const SimOptions& o);

}  // namespace ragshard::bench
