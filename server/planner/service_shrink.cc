// Shrink in place (issue 55; the wire: planner.proto JobOptions.on_node_loss, JOB_SHRUNK,
// Job.successor_job_id, survivor_ranks, predecessor_job_id, shrinks). A job that shrinks on a
// node's loss recovers from it as a job with redundancy does (NodeLostRecovery): the node may come
// back, or a replacement daemon rebuild it, within the recovery deadline. When the deadline passes
// with the lost node (and perhaps others) not recovered, ExpireRecovery shrinks the job instead of
// ending it DEGRADED: its ranks on the other nodes go on as a successor job of fewer ranks, which
// their daemons fill from the old job's buffers. The job turns SHRUNK naming the successor, and the
// successor is created as CreateJob would, once the locks are released.
//
// A shrink keeps whole shard groups (the mesh: rank = replica * F + position, F = shard_size):
// each group must be lost whole or survive whole, since a surviving group holds a whole copy of
// the state only then. The successor's rank i is the old job's survivor_ranks[i], so its groups
// are the surviving groups, in order.
//
// The old job's row is stored before the successor's. A planner that stops between the two
// creates the successor of every stored SHRUNK job whose successor it has no row of when it
// starts (Create): a shrink never leaves its survivors without a job to go on with.
#include <algorithm>
#include <map>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/rank_list.h"
#include "engine/redundancy.h"
#include "glog/logging.h"
#include "infra/status_macros.h"
#include "server/planner/service.h"

namespace ragshard::planner {

namespace {

// "rank 2" or "ranks 2, 3".
std::string Ranks(const std::vector<int64_t>& ranks) {
  return absl::StrCat(ranks.size() == 1 ? "rank " : "ranks ", RankList(ranks));
}

// "node 'n1'" or "nodes 'n1', 'n2'" (the first 8 and how many more).
std::string Nodes(const std::vector<std::string>& nodes) {
  constexpr size_t kShown = 8;
  std::vector<std::string> quoted;
  for (size_t i = 0; i < nodes.size() && i < kShown; ++i) quoted.push_back("'" + nodes[i] + "'");
  std::string out =
      absl::StrCat(nodes.size() == 1 ? "node " : "nodes ", absl::StrJoin(quoted, ", "));
  if (nodes.size() > kShown) absl::StrAppend(&out, " and ", nodes.size() - kShown, " more");
  return out;
}

// The successor's ranks: 0 .. n - 1.
std::vector<int64_t> FirstRanks(size_t n) {
  std::vector<int64_t> ranks(n);
  std::iota(ranks.begin(), ranks.end(), 0);
  return ranks;
}

// "ranks 0, 1 go on there as ranks 0, 1" (or "rank 2 goes on there as rank 0").
std::string GoOn(const std::vector<int64_t>& survivors) {
  return absl::StrCat(Ranks(survivors), survivors.size() == 1 ? " goes" : " go", " on there as ",
                      Ranks(FirstRanks(survivors.size())));
}

// Whether redundancy `r` holds on the nodes of `survivors` (CheckRedundancyNodes).
absl::Status RedundancyLeft(const std::map<int64_t, v1::RankState>& ranks,
                            const std::vector<int64_t>& survivors, const Redundancy& r) {
  std::set<std::string> left;
  for (int64_t rank : survivors) {
    if (auto it = ranks.find(rank); it != ranks.end()) left.insert(it->second.node_id());
  }
  return CheckRedundancyNodes(r, static_cast<int64_t>(left.size()));
}

}  // namespace

absl::Status PlannerService::CheckReCut(JobState* js, const std::set<std::string>& lost,
                                        const Redundancy& redundancy) {
  // The daemons' nodes in ListJobNodes' order: replica's copy of node i is on node i + 1 (a
  // ring), parity:1's on the other node of its pair (server/daemon/redundancy.h).
  const v1::ListJobNodesResponse& jn = JobNodes(js);
  const int nodes = jn.node_ids_size();
  for (int i = 0; i < nodes; ++i) {
    if (lost.count(jn.node_ids(i)) == 0) continue;
    const int holder = redundancy.kind == Redundancy::Kind::kReplica ? (i + 1) % nodes : i ^ 1;
    if (holder < nodes && lost.count(jn.node_ids(holder)) > 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "node '", jn.node_ids(i), "''s state was copied only on node '", jn.node_ids(holder),
          "' (redundancy ", redundancy.name(), "), lost too: the survivors cannot re-cut"));
    }
  }
  if (js->plan && js->plan->factors_size() > 0) {
    return absl::FailedPreconditionError(
        "its plan shards gradients or optimizer state apart from the parameters (AMSP factors): "
        "a re-cut moves one shard group's shards");
  }
  return absl::OkStatus();
}

bool PlannerService::ShrinksOnNodeLoss(const v1::Job& job) {
  return job.options().on_node_loss() == "shrink" && job.options().recovery_deadline_ms() > 0;
}

absl::Status PlannerService::Shrink(JobState* js, const std::set<std::string>& lost,
                                    const std::string& why, Deferred* deferred) {
  v1::Job& job = js->job;
  const int64_t world = job.world_size();
  const int64_t f = job.mesh().shard_size();
  if (f <= 0 || world % f != 0 || static_cast<int64_t>(js->ranks.size()) != world) {
    return absl::FailedPreconditionError(
        absl::StrCat("only ", js->ranks.size(), " of its ", world, " ranks are registered"));
  }
  // A job of one shard group whose redundancy holds each node's state whole on another node
  // (replica, parity:1) may instead lose part of it: its survivors re-cut the shards for their
  // number, the lost nodes' share read from those copies (docs/recovery.md).
  const auto redundancy = ParseRedundancy("options.redundancy", job.options().redundancy());
  const bool recut = redundancy.ok() && redundancy->whole_copies() && f == world;
  std::vector<int64_t> survivors;
  for (int64_t g = 0; g < world / f; ++g) {
    // The group's ranks on lost nodes, by node.
    std::map<std::string, std::vector<int64_t>> lost_ranks;
    int64_t lost_count = 0;
    for (int64_t rank = g * f; rank < (g + 1) * f; ++rank) {
      const auto r = js->ranks.find(rank);
      if (r == js->ranks.end()) {
        return absl::FailedPreconditionError(absl::StrCat("rank ", rank, " is not registered"));
      }
      if (lost.count(r->second.node_id()) > 0) {
        lost_ranks[r->second.node_id()].push_back(rank);
        ++lost_count;
      }
    }
    if (lost_count == 0 || (recut && lost_count < f)) {
      for (int64_t rank = g * f; rank < (g + 1) * f; ++rank) {
        if (lost.count(js->ranks.at(rank).node_id()) == 0) survivors.push_back(rank);
      }
    } else if (lost_count < f) {
      const auto& [node, ranks] = *lost_ranks.begin();
      return absl::FailedPreconditionError(absl::StrCat(
          "node '", node, "' held ", Ranks(ranks), " of shard group ", g, " (ranks ", g * f, "-",
          (g + 1) * f - 1,
          "), and a shrink keeps whole shard groups (HSDP replica groups: --replicate 2 or more, "
          "with each group on nodes of its own) unless one shard group re-cuts from whole copies "
          "(redundancy replica or parity:1)"));
    }
  }
  if (recut && survivors.size() < static_cast<size_t>(world)) {
    RAGSHARD_RETURN_IF_ERROR(CheckReCut(js, lost, *redundancy));
  }
  if (survivors.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the lost ", Nodes({lost.begin(), lost.end()}), " held all of its ", world,
                     " ranks: no shard group is left to go on"));
  }
  // An explicit redundancy goes on with the successor (SuccessorOf), so the nodes left must
  // hold it; hsdp is decided again. A re-cut's successor goes on without one it cannot hold.
  std::string kept;
  if (redundancy.ok() && redundancy->enabled() && redundancy->kind != Redundancy::Kind::kHsdp) {
    absl::Status fits = RedundancyLeft(js->ranks, survivors, *redundancy);
    if (!fits.ok() && recut) {
      kept = absl::StrCat("; the successor keeps no redundancy (", fits.message(), ")");
    } else if (!fits.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "its redundancy '", job.options().redundancy(), "' would not hold on the nodes left (",
          fits.message(), "); under HSDP leave the redundancy to its default, hsdp"));
    }
  }
  const std::string successor = absl::StrCat(job.job_id(), "/shrink-", job.recovery_epoch());
  if (absl::Status id = ValidateId("job_id", successor, options_.limits.max_id_length); !id.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "its successor's id '", successor, "' is not a valid job id (", id.message(), ")"));
  }
  RAGSHARD_RETURN_IF_ERROR(JobStatusMachine::Move(&job, v1::JOB_SHRUNK));
  job.set_successor_job_id(successor);
  job.clear_survivor_ranks();
  for (int64_t rank : survivors) job.add_survivor_ranks(rank);
  job.set_error(absl::StrCat(why, ": shrunk to job '", successor, "' of ", survivors.size(),
                             survivors.size() == 1 ? " rank" : " ranks", " (was ", world, "); ",
                             GoOn(survivors),
                             survivors.size() % f != 0 ? ", re-cutting the shards" : "", kept));
  metrics_.RecoveryEnded(RecoveryOutcome::kShrunk, 0);
  metrics_.JobShrunk();
  LOG(WARNING) << "job " << job.job_id() << " SHRUNK: " << job.error();
  (void)JobChanged(js, deferred);
  deferred->push_back([this, next = SuccessorOf(*js)] { CreateSuccessor(next); });
  return absl::OkStatus();
}

v1::Job PlannerService::SuccessorOf(const JobState& js) const {
  const v1::Job& job = js.job;
  v1::CreateJobRequest req;
  req.set_job_id(job.successor_job_id());
  const int64_t f = job.mesh().shard_size();
  const int64_t n = job.survivor_ranks_size();
  if (f > 0 && n % f != 0) {  // a re-cut: one shard group of the survivors
    req.mutable_mesh()->set_shard_size(n);
    req.mutable_mesh()->set_replicate_size(1);
  } else {
    req.mutable_mesh()->set_shard_size(f);
    req.mutable_mesh()->set_replicate_size(f > 0 ? n / f : 0);
  }
  *req.mutable_options() = job.options();
  // hsdp where it was the default or asked for: the default decides again on the survivors
  // (MaybePlan), and a successor of one replica group has none.
  if (req.options().redundancy() == "hsdp") req.mutable_options()->clear_redundancy();
  // A re-cut goes on without a redundancy that the nodes left cannot hold (Shrink says so).
  const auto redundancy = ParseRedundancy("options.redundancy", job.options().redundancy());
  if (f > 0 && n % f != 0 && redundancy.ok() &&
      !RedundancyLeft(js.ranks, {job.survivor_ranks().begin(), job.survivor_ranks().end()},
                      *redundancy)
           .ok()) {
    req.mutable_options()->set_redundancy("none");
  }
  v1::Job next = NewJob(req);
  next.set_predecessor_job_id(job.job_id());
  next.set_shrinks(job.shrinks() + 1);
  return next;
}

void PlannerService::CreateSuccessor(const v1::Job& successor) {
  const std::string& id = successor.job_id();
  EntryPtr e = Entry(id, /*create=*/true);
  absl::MutexLock lock(&e->mu);
  const bool existed = !e->state.job.job_id().empty();
  if (existed && e->state.job.status() != v1::JOB_DELETED) {
    LOG(INFO) << "job " << id << ", the successor of job " << successor.predecessor_job_id()
              << ", exists already (predecessor '" << e->state.job.predecessor_job_id()
              << "'): kept";
    return;
  }
  JobState js;
  js.job = successor;
  BeforeJobWrite(id);
  absl::Status s = store_->Atomically([&] {
    if (existed) RAGSHARD_RETURN_IF_ERROR(store_->PurgeJobData(id));
    return store_->PutJob(js.job);
  });
  if (!s.ok()) {
    LOG(ERROR) << "store job " << id << ", the successor of job " << successor.predecessor_job_id()
               << ": " << s << " (the planner creates it when it starts again)";
    return;
  }
  LOG(INFO) << "job " << id << " created: world " << successor.world_size() << " (mesh "
            << successor.mesh().replicate_size() << " x " << successor.mesh().shard_size()
            << "), the successor of job " << successor.predecessor_job_id() << " (shrinks "
            << successor.shrinks() << ")";
  e->state = std::move(js);
}

std::string PlannerService::ShrunkText(const JobState& js) {
  const v1::Job& job = js.job;
  const std::set<int64_t> kept(job.survivor_ranks().begin(), job.survivor_ranks().end());
  std::vector<std::string> lost;
  std::set<std::string> seen;
  for (const auto& [rank, r] : js.ranks) {
    if (kept.count(rank) == 0 && seen.insert(r.node_id()).second) lost.push_back(r.node_id());
  }
  return absl::StrCat("job '", job.job_id(), "' shrank to '", job.successor_job_id(), "'",
                      lost.empty() ? "" : absl::StrCat(" (", Nodes(lost), " lost)"), ": its ",
                      GoOn({job.survivor_ranks().begin(), job.survivor_ranks().end()}));
}

}  // namespace ragshard::planner
