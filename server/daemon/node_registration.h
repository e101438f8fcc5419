// A node's ranks registered with the planner in one RegisterNodeRanks call (docs/daemon.md,
// "Registration"). Each rank asks its daemon (Daemon.Register, client/client.cc); the daemon
// holds a job's requests until as many ranks as the ranks said the node has (`local_ranks`) have
// asked, or until the first held one's deadline, and then sends one RegisterNodeRanks per
// distinct inventory among them (one, unless ranks disagree: the planner then names the ranks
// that differ) and answers every held rank with the planner's answer. A rank that asks again
// after its node's call (a restarted rank) is sent at once. The call of the node that holds
// rank 0 carries rank 0's inventory in full where rank 0 sent it so (the planner's reference);
// every other call carries the hash, which the planner checks against the reference and which
// waits for it. The planner thus gets one inventory per job and one hash per node, not per rank.
//
// NodeRegistrations is the holding and batching, without threads or I/O: the daemon sends the
// batches it returns on threads of its own, and bench/control_plane_bench's simulated nodes run
// the same code (SendNodeRegistration).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "protocol/planner_client.h"
#include "ragshard/v1/daemon.pb.h"
#include "ragshard/v1/planner.pb.h"

namespace ragshard::daemon {

// Called once per held rank with the planner's answer to its node's call.
using RegistrationDone = std::function<void(const absl::StatusOr<v1::Job>&)>;

// One RegisterNodeRanks call and the ranks it answers.
struct NodeRegistrationBatch {
  v1::RegisterNodeRanksRequest request;
  std::vector<RegistrationDone> waiters;
};

class NodeRegistrations {
 public:
  // The most ranks of one job a node holds (the planner's own limit on one call).
  static constexpr int64_t kMaxLocalRanks = 4096;
  // Jobs whose sent ranks are remembered (for a restarted rank's prompt re-registration); the
  // least recently used without held ranks is forgotten beyond this.
  static constexpr size_t kMaxJobs = 1024;

  explicit NodeRegistrations(std::string node_id) : node_id_(std::move(node_id)) {}

  // Holds a rank's registration; returns the batches it completes (none while the node's other
  // ranks are still to come). An error is this request's alone (nothing was held): a bad field,
  // another node, a rank already waiting, or `local_ranks` unlike the held ranks'.
  absl::StatusOr<std::vector<NodeRegistrationBatch>> Add(const v1::RegisterRequest& request,
                                                         absl::Time deadline,
                                                         RegistrationDone done);
  // The batches of the jobs whose first held rank's deadline is at or before `now`, with the
  // ranks that came.
  std::vector<NodeRegistrationBatch> Expire(absl::Time now);
  // Every held rank, to be answered with an error (the daemon shuts down).
  std::vector<RegistrationDone> TakeAll();
  // Ranks held now, over all jobs.
  int64_t held() const;

 private:
  struct Held {
    std::string sha256;
    std::shared_ptr<v1::Inventory> inventory;  // rank 0's, where it sent it in full
    RegistrationDone done;
  };
  struct JobEntry {
    int64_t local_ranks = 0;
    std::map<int64_t, Held> held;  // by rank
    std::set<int64_t> sent;        // ranks registered through this daemon
    absl::Time first_deadline = absl::InfiniteFuture();
    uint64_t used = 0;
  };
  // The held ranks of `job_id` as batches, one per inventory hash; the entry is emptied.
  std::vector<NodeRegistrationBatch> Flush(const std::string& job_id, JobEntry& entry)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ForgetOldJobs() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string node_id_;
  mutable absl::Mutex mu_;
  std::map<std::string, JobEntry> jobs_ ABSL_GUARDED_BY(mu_);
  uint64_t clock_ ABSL_GUARDED_BY(mu_) = 0;
};

// Sends one batch (RegisterNodeRanks) and answers its ranks. Blocks for the planner's answer,
// which waits, for a node that sent only the hash, until some node has sent the inventory.
void SendNodeRegistration(PlannerClient& planner, const NodeRegistrationBatch& batch);

}  // namespace ragshard::daemon
