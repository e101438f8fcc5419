// JobRuntime's redundancy of the local ranks' persistent state (docs/recovery.md, "A lost node";
// the algorithm is redundancy.h's): OP_PROTECT inside every optimizer step's transaction, and
// OP_REBUILD once the ranks are back after a recovery, which rebuilds the state of a replacement
// daemon's ranks from the other nodes.
#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "infra/status_macros.h"
#include "protocol/pool_contract.h"
#include "server/daemon/job_runtime.h"

namespace ragshard::daemon {

void JobRuntime::EnableRedundancy(RedundancyScheme scheme, const std::string& text, int node,
                                  std::vector<std::string> nodes, bool replacement, Pool* pool) {
  absl::MutexLock lock(&mu_);
  redundancy_ = std::make_unique<NodeRedundancy>(scheme, node, std::move(nodes),
                                                 static_cast<int>(local_ranks_.size()), pool);
  redundancy_text_ = text;
  replacement_ = replacement;
  state_pool_ = pool;
}

absl::StatusOr<int64_t> JobRuntime::LocalStep(int field, const char* what) const {
  int64_t step = -1;
  for (size_t l = 0; l < local_ranks_.size(); ++l) {
    v1::RankProgress p;
    JournalSteps(local_ranks_[l], &p);
    const int64_t s = field == pool::kJournalCommitted ? p.committed_step() : p.begun_step();
    if (s < 0) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, ": rank ", local_ranks_[l], " of job '", job_id_,
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

absl::StatusOr<std::vector<std::vector<StateSegment>>> JobRuntime::ProtectedState() const {
  std::vector<std::vector<StateSegment>> out(local_ranks_.size());
  for (size_t l = 0; l < local_ranks_.size(); ++l) {
    for (int u = 0; u < dp_->units(); ++u) {
      int64_t bytes = 0;
      char* data = dp_->HostParamShard(u, static_cast<int>(l), &bytes);
      if (data == nullptr) {
        return absl::FailedPreconditionError(
            absl::StrCat("redundancy: the ", dp_->name(),
                         " backend keeps parameter shards outside the host "
                         "pool; redundancy needs a host backend (docs/recovery.md)"));
      }
      out[l].push_back({absl::StrCat(pool::kShard, u), data, bytes});
    }
    for (const auto& [key, buffer] : state_) {
      if (key.first != local_ranks_[l] || absl::StartsWith(key.second, pool::kJournal)) continue;
      out[l].push_back({key.second, buffer.first.data(), buffer.second});
    }
  }
  return out;
}

absl::Status JobRuntime::HasRedundancy(const char* what) const {
  if (redundancy_ != nullptr && comm_ != nullptr) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      what, ": job '", job_id_, "' has no redundancy across nodes (JobOptions.redundancy)"));
}

absl::Status JobRuntime::Protect(const Op& op) {
  RAGSHARD_RETURN_IF_ERROR(HasRedundancy("OP_PROTECT"));
  std::vector<std::vector<StateSegment>> state;
  int64_t step = 0;
  uint64_t seq = 0;
  {
    absl::MutexLock lock(&mu_);
    RAGSHARD_ASSIGN_OR_RETURN(step, LocalStep(pool::kJournalBegun, "OP_PROTECT"));
    RAGSHARD_ASSIGN_OR_RETURN(state, ProtectedState());
    seq = running_seq_;
  }
  return redundancy_->Protect(*comm_, state, step, op.deadline, seq);
}

absl::Status JobRuntime::Rebuild(const Op& op) {
  RAGSHARD_RETURN_IF_ERROR(HasRedundancy("OP_REBUILD"));
  std::vector<std::vector<StateSegment>> state;
  int64_t step = 0;
  uint64_t seq = 0;
  bool replacement = false;
  int64_t epoch = 0;
  {
    absl::MutexLock lock(&mu_);
    replacement = replacement_;
    epoch = epoch_;
    if (!replacement) {
      RAGSHARD_ASSIGN_OR_RETURN(step, LocalStep(pool::kJournalCommitted, "OP_REBUILD"));
      RAGSHARD_ASSIGN_OR_RETURN(state, ProtectedState());
    }
    seq = running_seq_;
  }
  const PlaceSegment place = [this](int local, const std::string& name,
                                    int64_t bytes) -> absl::StatusOr<char*> {
    int unit = 0;
    if (absl::StartsWith(name, pool::kShard) &&
        absl::SimpleAtoi(name.substr(sizeof(pool::kShard) - 1), &unit)) {
      int64_t have = 0;
      char* data =
          unit >= 0 && unit < dp_->units() ? dp_->HostParamShard(unit, local, &have) : nullptr;
      if (data == nullptr || have != bytes) {
        return absl::DataLossError(absl::StrCat(
            "the rebuilt state holds ", bytes, " bytes for the parameter shard of unit ", unit,
            "; this node's plan has ", have, " (", dp_->units(), " units)"));
      }
      return data;
    }
    auto b = StateBuffer(local_ranks_[static_cast<size_t>(local)], name, bytes, state_pool_);
    if (!b.ok()) return b.status();
    return b->first->data();
  };
  auto rebuilt = redundancy_->Rebuild(*comm_, replacement, state, step, place, op.deadline, seq);
  if (!rebuilt.ok()) {
    const absl::Status& s = rebuilt.status();
    // A state that cannot be rebuilt, or rebuilt wrong, stops the job (a lost peer or the
    // deadline are the recovery's own failures, handled as every operation's).
    if (!absl::IsUnavailable(s) && !absl::IsDeadlineExceeded(s) && !absl::IsAborted(s)) {
      absl::Status named = absl::Status(
          s.code(),
          absl::StrCat("rebuilding job '", job_id_, "' from its redundancy: ", s.message()));
      Report(named);
      Fail(named);
      return named;
    }
    return s;
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

absl::Status JobRuntime::ExposeCopy(int local, int64_t step, const std::string& name, Pool* pool) {
  int64_t rank = 0;
  NodeRedundancy* redundancy = nullptr;
  bool checked = false;
  const std::string prefix = absl::StrCat(pool::kCopy, step, "/");
  {
    absl::MutexLock lock(&mu_);
    if (local < 0 || static_cast<size_t>(local) >= local_ranks_.size()) {
      return absl::InvalidArgumentError(absl::StrCat("no local rank ", local));
    }
    rank = local_ranks_[static_cast<size_t>(local)];
    if (state_.count({rank, name}) > 0) return absl::OkStatus();  // made already
    redundancy = redundancy_.get();
    checked = copies_checked_.count({local, step}) > 0;
  }
  // The job is stopped (a salvage attachment asks): its thread protects nothing any more, so its
  // parities are read outside the lock. The CRC is checked once per local rank and step.
  if (redundancy == nullptr) return absl::OkStatus();
  auto copy = redundancy->CopyHeld(local, step, /*check=*/!checked);
  if (absl::IsNotFound(copy.status()) || absl::IsFailedPrecondition(copy.status())) {
    return absl::OkStatus();  // no copy here: the directory's bytes stay zeros
  }
  if (!copy.ok()) {
    return absl::Status(
        copy.status().code(),
        absl::StrCat("job '", job_id_, "' on node '", node_id_, "': ", copy.status().message()));
  }
  absl::MutexLock lock(&mu_);
  copies_checked_.insert({local, step});
  auto put = [&](const std::string& to, const char* data, int64_t bytes) -> absl::Status {
    if (state_.count({rank, to}) > 0) return absl::OkStatus();
    auto lease = pool->Allocate(std::max<int64_t>(bytes, 1));
    if (!lease.ok()) {
      return absl::Status(
          lease.status().code(),
          absl::StrCat("the copy of node '", copy->node_name, "''s state buffer '", to, "' (",
                       bytes, " bytes) on node '", node_id_, "': ", lease.status().message()));
    }
    if (bytes > 0) std::memcpy(lease->data(), data, static_cast<size_t>(bytes));
    state_[{rank, to}] = std::make_pair(std::move(*lease), std::max<int64_t>(bytes, 1));
    return absl::OkStatus();
  };
  if (name == prefix + pool::kCopyDirectory || name == prefix + pool::kCopyDirectoryBytes) {
    // Node i holds ranks [i * L, (i + 1) * L) (daemon_job_setup.cc's NodeMesh).
    const int64_t from_rank =
        static_cast<int64_t>(copy->node) * static_cast<int64_t>(local_ranks_.size()) + local;
    std::string directory = absl::StrCat("node ", copy->node_name, " rank ", from_rank, "\n");
    for (const StateSegment& seg : copy->segments) {
      absl::StrAppend(&directory, seg.bytes, " ", seg.name, "\n");
    }
    const int64_t size = static_cast<int64_t>(directory.size());
    RAGSHARD_RETURN_IF_ERROR(put(prefix + pool::kCopyDirectory, directory.data(), size));
    return put(prefix + pool::kCopyDirectoryBytes, reinterpret_cast<const char*>(&size),
               sizeof(size));
  }
  for (const StateSegment& seg : copy->segments) {
    if (prefix + seg.name != name) continue;
    LOG(INFO) << "job " << job_id_ << ": node '" << node_id_ << "' exposes segment '" << seg.name
              << "' (" << seg.bytes << " bytes) of node '" << copy->node_name << "''s local rank "
              << local << " at step " << step << " for a shrink's re-cut";
    return put(name, seg.data, seg.bytes);
  }
  return absl::OkStatus();  // no such segment: the ask makes a buffer of zeros, as any other
}

}  // namespace ragshard::daemon
