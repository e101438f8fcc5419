#include "server/daemon/job_redundancy.h"

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "infra/status_macros.h"
#include "protocol/pool_contract.h"

namespace ragshard::daemon {

JobRedundancy::JobRedundancy(std::string job_id, std::string node_id, RedundancyScheme scheme,
                             std::string text, int node, std::vector<std::string> nodes,
                             std::vector<int64_t> local_ranks, bool replacement, Pool* pool,
                             RankStates* states, std::shared_ptr<PlannerClient> planner,
                             std::shared_ptr<DaemonMetrics> metrics)
    : job_id_(std::move(job_id)),
      node_id_(std::move(node_id)),
      text_(std::move(text)),
      local_ranks_(std::move(local_ranks)),
      pool_(pool),
      states_(states),
      planner_(std::move(planner)),
      metrics_(std::move(metrics)),
      redundancy_(scheme, node, std::move(nodes), static_cast<int>(local_ranks_.size()), pool),
      replacement_(replacement) {}

void JobRedundancy::FillStats(v1::JobStats* out) const {
  out->set_protected_bytes(redundancy_.protected_bytes());
  out->set_parity_bytes(redundancy_.parity_bytes());
  for (int64_t step : redundancy_.parity_steps()) out->add_parity_steps(step);
}

absl::StatusOr<int64_t> JobRedundancy::LocalStep(bool committed, const char* what) {
  int64_t step = -1;
  for (size_t l = 0; l < local_ranks_.size(); ++l) {
    const RankStates::JournalMarks marks = states_->Journal(local_ranks_[l]);
    const int64_t s = committed ? marks.committed : marks.begun;
    if (s < 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          what, ": rank ", local_ranks_[l], " of job '", job_id_,
          "' has no step journal (state buffer '", pool::kJournalMeta, "'; docs/recovery.md)"));
    }
    if (l > 0 && s != step) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, ": the ranks of job '", job_id_, "' on node '", node_id_,
                       "' are at different steps (rank ", local_ranks_[0], " ", step, ", rank ",
                       local_ranks_[l], " ", s, ")"));
    }
    step = s;
  }
  return step;
}

absl::StatusOr<std::vector<std::vector<StateSegment>>> JobRedundancy::ProtectedState(
    const DataBackend& dp) {
  std::vector<std::vector<StateSegment>> out(local_ranks_.size());
  for (size_t l = 0; l < local_ranks_.size(); ++l) {
    for (int u = 0; u < dp.units(); ++u) {
      StateSegment shard = dp.ParamShardSegment(u, static_cast<int>(l));
      if (shard.data == nullptr) {
        return absl::FailedPreconditionError(
            absl::StrCat("redundancy: the ", dp.name(), " backend has no parameter shard of unit ",
                         u, " for local rank ", l));
      }
      out[l].push_back(std::move(shard));
    }
    for (StateSegment& s : states_->Protected(local_ranks_[l])) out[l].push_back(std::move(s));
  }
  return out;
}

absl::Status JobRedundancy::Protect(Comm& comm, const DataBackend& dp, absl::Time deadline,
                                    uint64_t seq) {
  RAGSHARD_ASSIGN_OR_RETURN(const int64_t step, LocalStep(/*committed=*/false, "OP_PROTECT"));
  RAGSHARD_ASSIGN_OR_RETURN(auto state, ProtectedState(dp));
  return redundancy_.StartProtect(comm, std::move(state), step, deadline, seq);
}

absl::Status JobRedundancy::Rebuild(Comm& comm, const DataBackend& dp, int64_t epoch,
                                    absl::Time deadline, uint64_t seq,
                                    const std::function<void(const absl::Status&)>& stop) {
  const bool replacement = this->replacement();
  std::vector<std::vector<StateSegment>> state;
  int64_t step = 0;
  if (!replacement) {
    RAGSHARD_ASSIGN_OR_RETURN(step, LocalStep(/*committed=*/true, "OP_REBUILD"));
    RAGSHARD_ASSIGN_OR_RETURN(state, ProtectedState(dp));
  }
  const PlaceSegment place = [this, &dp](int local, const std::string& name,
                                         int64_t bytes) -> absl::StatusOr<StateSegment> {
    int unit = 0;
    if (absl::StartsWith(name, pool::kShard) &&
        absl::SimpleAtoi(name.substr(sizeof(pool::kShard) - 1), &unit)) {
      StateSegment shard =
          unit >= 0 && unit < dp.units() ? dp.ParamShardSegment(unit, local) : StateSegment{name};
      if (shard.data == nullptr || shard.bytes != bytes) {
        return absl::DataLossError(absl::StrCat(
            "the rebuilt state holds ", bytes, " bytes for the parameter shard of unit ", unit,
            "; this node's plan has ", shard.bytes, " (", dp.units(), " units)"));
      }
      return shard;
    }
    auto b = states_->Get(local_ranks_[static_cast<size_t>(local)], name, bytes, pool_, &dp, local);
    if (!b.ok()) return b.status();
    return StateSegment{name, b->lease->data(), bytes,
                        b->rank_memory ? dp.rank_memory(local) : nullptr};
  };
  auto rebuilt = redundancy_.Rebuild(comm, replacement, state, step, place, deadline, seq);
  if (!rebuilt.ok()) {
    const absl::Status& s = rebuilt.status();
    if (absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s) || absl::IsAborted(s)) return s;
    absl::Status named = absl::Status(
        s.code(),
        absl::StrCat("rebuilding job '", job_id_, "' from its redundancy: ", s.message()));
    stop(named);
    return named;
  }
  if (!replacement) return absl::OkStatus();
  {
    absl::MutexLock lock(&mu_);
    replacement_ = false;
  }
  LOG(INFO) << "job " << job_id_ << ": node '" << node_id_ << "' rebuilt " << *rebuilt
            << " bytes of its ranks' state from the other nodes (epoch " << epoch << ")";
  metrics_->Rebuilt(*rebuilt);
  v1::ReportRecoveredRequest done;
  done.set_job_id(job_id_);
  done.set_node_id(node_id_);
  done.set_epoch(epoch);
  done.set_replacement(true);
  done.set_rebuilt_bytes(*rebuilt);
  if (auto r = planner_->ReportRecovered(done); !r.ok()) {
    LOG(WARNING) << "job " << job_id_ << ": telling the planner of the rebuild: " << r.status();
  }
  return absl::OkStatus();
}

absl::Status JobRedundancy::ExposeCopy(int local, int64_t step, const std::string& name,
                                       Pool* pool) {
  if (local < 0 || static_cast<size_t>(local) >= local_ranks_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("no local rank ", local));
  }
  const int64_t rank = local_ranks_[static_cast<size_t>(local)];
  if (states_->Has(rank, name)) return absl::OkStatus();  // made already
  bool checked = false;
  {
    absl::MutexLock lock(&mu_);
    checked = copies_checked_.count({local, step}) > 0;
  }
  // The job is stopped (a salvage attachment asks): its thread protects nothing any more, so its
  // parities are read here. The CRC is checked once per local rank and step.
  auto copy = redundancy_.CopyHeld(local, step, /*check=*/!checked);
  if (absl::IsNotFound(copy.status()) || absl::IsFailedPrecondition(copy.status())) {
    return absl::OkStatus();  // no copy here: the directory's bytes stay zeros
  }
  if (!copy.ok()) {
    return absl::Status(
        copy.status().code(),
        absl::StrCat("job '", job_id_, "' on node '", node_id_, "': ", copy.status().message()));
  }
  {
    absl::MutexLock lock(&mu_);
    copies_checked_.insert({local, step});
  }
  auto put = [&](const std::string& to, const char* data, int64_t bytes) -> absl::Status {
    absl::Status s = states_->PutCopy(rank, to, data, bytes, pool);
    if (s.ok()) return s;
    return absl::Status(
        s.code(), absl::StrCat("the copy of node '", copy->node_name, "''s state buffer '", to,
                               "' (", bytes, " bytes) on node '", node_id_, "': ", s.message()));
  };
  const std::string directory_name = pool::CopyName(step, pool::kCopyDirectory);
  const std::string directory_bytes_name = pool::CopyName(step, pool::kCopyDirectoryBytes);
  if (name == directory_name || name == directory_bytes_name) {
    // Node i holds ranks [i * L, (i + 1) * L) (daemon_job_setup.cc's NodeMesh).
    const int64_t from_rank =
        static_cast<int64_t>(copy->node) * static_cast<int64_t>(local_ranks_.size()) + local;
    std::string directory = absl::StrCat("node ", copy->node_name, " rank ", from_rank, "\n");
    for (const StateSegment& seg : copy->segments) {
      absl::StrAppend(&directory, seg.bytes, " ", seg.name, "\n");
    }
    const int64_t size = static_cast<int64_t>(directory.size());
    RAGSHARD_RETURN_IF_ERROR(put(directory_name, directory.data(), size));
    return put(directory_bytes_name, reinterpret_cast<const char*>(&size), sizeof(size));
  }
  for (const StateSegment& seg : copy->segments) {
    if (pool::CopyName(step, seg.name) != name) continue;
    LOG(INFO) << "job " << job_id_ << ": node '" << node_id_ << "' exposes segment '" << seg.name
              << "' (" << seg.bytes << " bytes) of node '" << copy->node_name << "''s local rank "
              << local << " at step " << step << " for a shrink's re-cut";
    return put(name, seg.data, seg.bytes);
  }
  return absl::OkStatus();  // no such segment: the ask makes a buffer of zeros, as any other
}

}  // namespace ragshard::daemon
