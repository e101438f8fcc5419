#include "server/daemon/node_registration.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/inventory.h"
#include "infra/ids.h"

namespace ragshard::daemon {

absl::StatusOr<std::vector<NodeRegistrationBatch>> NodeRegistrations::Add(
    const v1::RegisterRequest& request, absl::Time deadline, RegistrationDone done) {
  if (absl::Status s = ValidateId("job_id", request.job_id()); !s.ok()) return s;
  const int64_t rank = request.rank();
  if (rank < 0) {
    return absl::InvalidArgumentError(absl::StrCat("rank: must not be negative, got ", rank));
  }
  if (!request.node_id().empty() && request.node_id() != node_id_) {
    return absl::InvalidArgumentError(
        absl::StrCat("node_id: rank ", rank, " of job '", request.job_id(),
                     "' says it is on node '", request.node_id(), "', but its daemon is node '",
                     node_id_, "' (RAGSHARD_NODE or RAGSHARD_SOCKET names the wrong one)"));
  }
  if (request.local_ranks() < 0 || request.local_ranks() > kMaxLocalRanks) {
    return absl::InvalidArgumentError(absl::StrCat("local_ranks: must be in [0, ", kMaxLocalRanks,
                                                   "], got ", request.local_ranks()));
  }
  std::string sha;
  if (request.has_inventory()) {
    sha = InventorySha256(request.inventory());  // outside the lock: several MB for DeepSeek-V3
  } else if (request.has_inventory_sha256()) {
    sha = request.inventory_sha256();
    if (sha.size() != 32) {
      return absl::InvalidArgumentError(
          absl::StrCat("inventory_sha256: must be 32 bytes, got ", sha.size()));
    }
  } else {
    return absl::InvalidArgumentError("inventory_or_hash: send the inventory or its SHA-256");
  }

  absl::MutexLock lock(&mu_);
  JobEntry& entry = jobs_[request.job_id()];
  if (entry.held.empty() && entry.local_ranks != request.local_ranks()) {
    // A new layout of the job (nothing held from the old one): forget what the old one sent.
    entry.local_ranks = request.local_ranks();
    entry.sent.clear();
  }
  if (request.local_ranks() != entry.local_ranks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "local_ranks: rank ", rank, " of job '", request.job_id(), "' says node '", node_id_,
        "' has ", request.local_ranks(), " of its ranks, but the ranks waiting here (",
        entry.held.begin()->first, "...) said ", entry.local_ranks));
  }
  if (entry.held.count(rank) != 0) {
    return absl::AlreadyExistsError(absl::StrCat("rank ", rank, " of job '", request.job_id(),
                                                 "' is already registering through node '",
                                                 node_id_, "'"));
  }
  Held h;
  h.sha256 = sha;
  h.done = std::move(done);
  // The planner needs the inventory once, from the job's rank 0; every other rank's hash is
  // checked against it.
  if (request.has_inventory() && rank == 0) {
    h.inventory = std::make_shared<v1::Inventory>(request.inventory());
  }
  const bool again = entry.sent.count(rank) != 0;
  entry.held.emplace(rank, std::move(h));
  entry.first_deadline = std::min(entry.first_deadline, deadline);
  entry.used = ++clock_;
  int64_t known = static_cast<int64_t>(entry.sent.size());
  for (const auto& kv : entry.held) known += entry.sent.count(kv.first) == 0 ? 1 : 0;
  std::vector<NodeRegistrationBatch> out;
  if (again || entry.local_ranks == 0 || known >= entry.local_ranks) {
    out = Flush(request.job_id(), entry);
  }
  ForgetOldJobs();
  return out;
}

std::vector<NodeRegistrationBatch> NodeRegistrations::Flush(const std::string& job_id,
                                                            JobEntry& entry) {
  std::map<std::string, NodeRegistrationBatch> by_sha;
  for (auto& [rank, h] : entry.held) {
    NodeRegistrationBatch& b = by_sha[h.sha256];
    if (b.waiters.empty()) {
      b.request.set_job_id(job_id);
      b.request.set_node_id(node_id_);
    }
    b.request.add_ranks(rank);  // in rank order: the map's
    if (h.inventory != nullptr && !b.request.has_inventory()) {
      b.request.mutable_inventory()->Swap(h.inventory.get());  // held once: no second copy
    }
    b.waiters.push_back(std::move(h.done));
    entry.sent.insert(rank);
  }
  std::vector<NodeRegistrationBatch> out;
  for (auto& [sha, b] : by_sha) {
    if (!b.request.has_inventory()) b.request.set_inventory_sha256(sha);
    out.push_back(std::move(b));
  }
  entry.held.clear();
  entry.first_deadline = absl::InfiniteFuture();
  return out;
}

void NodeRegistrations::ForgetOldJobs() {
  while (jobs_.size() > kMaxJobs) {
    auto oldest = jobs_.end();
    for (auto it = jobs_.begin(); it != jobs_.end(); ++it) {
      if (it->second.held.empty() &&
          (oldest == jobs_.end() || it->second.used < oldest->second.used)) {
        oldest = it;
      }
    }
    if (oldest == jobs_.end()) return;
    jobs_.erase(oldest);
  }
}

std::vector<NodeRegistrationBatch> NodeRegistrations::Expire(absl::Time now) {
  std::vector<NodeRegistrationBatch> out;
  absl::MutexLock lock(&mu_);
  for (auto& [job_id, entry] : jobs_) {
    if (entry.held.empty() || entry.first_deadline > now) continue;
    for (auto& b : Flush(job_id, entry)) out.push_back(std::move(b));
  }
  return out;
}

std::vector<RegistrationDone> NodeRegistrations::TakeAll() {
  std::vector<RegistrationDone> out;
  absl::MutexLock lock(&mu_);
  for (auto& [job_id, entry] : jobs_) {
    for (auto& [rank, h] : entry.held) out.push_back(std::move(h.done));
    entry.held.clear();
    entry.first_deadline = absl::InfiniteFuture();
  }
  return out;
}

int64_t NodeRegistrations::held() const {
  absl::MutexLock lock(&mu_);
  int64_t n = 0;
  for (const auto& [job_id, entry] : jobs_) n += static_cast<int64_t>(entry.held.size());
  return n;
}

void SendNodeRegistration(PlannerClient& planner, const NodeRegistrationBatch& batch) {
  const absl::StatusOr<v1::Job> job = planner.RegisterNodeRanks(batch.request);
  for (auto& done : batch.waiters) done(job);
}

}  // namespace ragshard::daemon
