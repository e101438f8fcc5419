#include "ctl/ctl_recovery.h"

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "ctl/ctl_format.h"
#include "engine/rank_list.h"
#include "engine/redundancy.h"

namespace ragshard {
namespace {

std::string Seconds(int64_t ms) {
  return absl::StrFormat("%.1f s", static_cast<double>(ms) / 1000.0);
}

// "in 95.3 s" or, once it passed (the planner ends the recovery at its next check), "passed
// 0.3 s ago".
std::string Deadline(const v1::JobRecovery& r, int64_t now_ms) {
  const int64_t left = r.deadline_unix_ms() - now_ms;
  return left >= 0 ? absl::StrCat("in ", Seconds(left))
                   : absl::StrCat("passed ", Seconds(-left), " ago");
}

std::string Recoveries(const v1::Job& job) {
  return absl::StrFormat("%d recover%s, %.1f s lost", job.recoveries(),
                         job.recoveries() == 1 ? "y" : "ies", job.recovery_seconds());
}

// "rebuilding node 'n1' on a replacement daemon" while a lost node is rebuilt, else empty.
std::string Rebuilding(const v1::JobRecovery& r) {
  return r.lost_node_id().empty()
             ? ""
             : absl::StrCat("rebuilding node '", r.lost_node_id(), "' on a replacement daemon");
}

std::string Rebuilds(const v1::Job& job) {
  return absl::StrCat("rebuilds: ", job.rebuilds(), " (", job.rebuilt_bytes(), " bytes)");
}

}  // namespace

std::string ShrinkLines(const v1::Job& job) {
  std::string out;
  if (!job.predecessor_job_id().empty()) {
    absl::StrAppend(&out, "shrunk from:  ", job.predecessor_job_id(), " (shrinks: ", job.shrinks(),
                    ")\n");
  }
  if (job.status() == v1::JOB_SHRUNK || !job.successor_job_id().empty()) {
    const int n = job.survivor_ranks_size();
    absl::StrAppend(&out, "shrunk to:    ", job.successor_job_id(), " (",
                    n == 1 ? "rank " : "ranks ", RankList(job.survivor_ranks()),
                    n == 1 ? " goes on)\n" : " go on)\n");
  }
  return out;
}

std::string ShrinkNote(const v1::Job& job) {
  if (job.predecessor_job_id().empty()) return "";
  return absl::StrCat("shrunk from ", job.predecessor_job_id(), " (shrinks: ", job.shrinks(), ")");
}

std::string RedundancyNote(const v1::Job& job) {
  const auto r = ParseRedundancy("redundancy", job.options().redundancy());
  std::vector<std::string> parts;
  if (r.ok() && r->enabled()) parts.push_back(r->name());
  if (job.rebuilds() > 0) parts.push_back(Rebuilds(job));
  return absl::StrJoin(parts, ", ");
}

std::string RedundancyLines(const v1::Job& job) {
  const auto r = ParseRedundancy("redundancy", job.options().redundancy());
  std::string out;
  if (r.ok() && r->kind == Redundancy::Kind::kParity) {
    absl::StrAppend(&out, "redundancy:   ", r->name(), " (nodes in groups of ", r->k + 1,
                    ", each node's state covered by parity on the others of its group; a lost "
                    "node is rebuilt on a replacement daemon)\n");
  } else if (r.ok() && r->kind == Redundancy::Kind::kReplica) {
    absl::StrAppend(&out,
                    "redundancy:   replica (each node's state copied on another node; a "
                    "lost node is rebuilt on a replacement daemon)\n");
  } else if (r.ok() && r->kind == Redundancy::Kind::kHsdp) {
    absl::StrAppend(&out,
                    "redundancy:   hsdp (each rank's shards held by its HSDP replicas on other "
                    "nodes; a lost node is rebuilt on a replacement daemon from them)\n");
  }
  if (!out.empty() || job.rebuilds() > 0) {
    absl::StrAppend(&out, "rebuilds:     ", job.rebuilds(), " (", job.rebuilt_bytes(), " bytes)\n");
  }
  return out;
}

std::string RecoveryNote(const v1::Job& job, int64_t now_ms) {
  if (job.status() == v1::JOB_RECOVERING) {
    const v1::JobRecovery& r = job.recovery();
    const int64_t left = r.deadline_unix_ms() - now_ms;
    // ListJobs gives the count only (recovered_nodes); GetJob the names.
    const int64_t recovered = std::max<int64_t>(r.recovered_nodes(), r.recovered_node_ids_size());
    const std::string rebuilding = Rebuilding(r);
    return absl::StrCat("epoch ", r.epoch(), ", ", rebuilding, rebuilding.empty() ? "" : ", ",
                        recovered, " node(s) recovered, ",
                        left >= 0 ? absl::StrCat(Seconds(left), " left") : "deadline passed");
  }
  return job.recoveries() > 0 ? Recoveries(job) : "";
}

std::string RecoveryLines(const v1::Job& job, const std::vector<std::string>& nodes,
                          int64_t now_ms) {
  const v1::JobRecovery& r = job.recovery();
  if (job.status() != v1::JOB_RECOVERING) {
    if (job.recoveries() == 0) return "";
    return absl::StrCat("recoveries:   ", Recoveries(job), " (the last: epoch ", r.epoch(),
                        ", from ", OneLine(r.lost()), ")\n");
  }
  const std::set<std::string> recovered(r.recovered_node_ids().begin(),
                                        r.recovered_node_ids().end());
  std::vector<std::string> rejoining;
  for (const std::string& n : nodes) {
    if (recovered.count(n) == 0) rejoining.push_back(n);
  }
  std::string out = absl::StrCat(
      "recovery:     epoch ", r.epoch(), ", reported by node '", r.reporter_node_id(), "' ",
      Seconds(now_ms - r.started_unix_ms()), " ago\n", "lost:         ", OneLine(r.lost()), "\n",
      r.lost_node_id().empty()
          ? ""
          : absl::StrCat("lost node:    ", Rebuilding(r),
                         r.rebuilt_bytes() > 0
                             ? absl::StrCat(" (", r.rebuilt_bytes(), " bytes rebuilt)")
                             : "",
                         "\n"),
      "recovered:    ",
      recovered.empty() ? "none yet" : absl::StrJoin(r.recovered_node_ids(), ", "), " (",
      recovered.size(), "/", nodes.size(), " nodes)\n",
      "rejoining:    ", rejoining.empty() ? "none" : absl::StrJoin(rejoining, ", "),
      rejoining.empty() ? "" : " (their ranks re-attach to their daemons)", "\n",
      "deadline:     ", Deadline(r, now_ms), "\n");
  if (job.recoveries() > 0) absl::StrAppend(&out, "recoveries:   ", Recoveries(job), " before\n");
  return out;
}

std::string StepLines(const v1::Job& job,
                      const std::map<int64_t, const v1::RankProgress*>& progress) {
  int64_t least = -1, most = -1;
  std::vector<std::string> rejoining;
  for (const auto& [rank, p] : progress) {
    if (p->rejoining()) rejoining.push_back(absl::StrCat(rank));
    if (p->committed_step() < 0) continue;
    least = least < 0 ? p->committed_step() : std::min(least, p->committed_step());
    most = std::max(most, std::max(p->committed_step(), p->begun_step()));
  }
  std::string out;
  if (job.status() == v1::JOB_RECOVERING) {
    if (least >= 0) {
      absl::StrAppend(&out, "redoing:      step ", least + 1, " (every rank completed step ", least,
                      most > least
                          ? absl::StrCat("; some began or completed step ", most, ", rolled back")
                          : "",
                      ")\n");
    }
    absl::StrAppend(
        &out, "not back:     ",
        rejoining.empty() ? "none" : absl::StrCat("rank(s) ", absl::StrJoin(rejoining, ", ")),
        "\n");
  } else if (least >= 0) {
    absl::StrAppend(&out, "steps:        ", least, " completed by every rank",
                    most > least ? absl::StrCat(", ", most, " begun") : "", "\n");
  }
  return out;
}

}  // namespace ragshard
