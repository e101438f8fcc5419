#include "server/daemon/rank_states.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "protocol/pool_contract.h"

namespace ragshard::daemon {

absl::StatusOr<RankStates::Buffer> RankStates::Get(int64_t rank, const std::string& name,
                                                   int64_t bytes, Pool* pool, const DataBackend* dp,
                                                   int local) {
  absl::MutexLock lock(&mu_);
  auto it = buffers_.find({rank, name});
  if (it != buffers_.end()) {
    if (it->second.bytes != bytes) {
      return absl::FailedPreconditionError(
          absl::StrCat("state buffer '", name, "' of rank ", rank, " of job '", job_id_, "' has ",
                       it->second.bytes, " bytes; asked for ", bytes));
    }
    return Buffer{&it->second.lease, true, it->second.rank_memory};
  }
  Held held;
  held.bytes = bytes;
  absl::StatusOr<Lease> lease = absl::UnimplementedError("");
  if (dp != nullptr && pool::InRankMemory(name)) {
    lease = dp->AllocateRankState(local, bytes);
    held.rank_memory = lease.ok() || !absl::IsUnimplemented(lease.status());
    if (held.rank_memory) held.memory = dp->rank_memory(local);
  }
  if (!held.rank_memory) {
    lease = pool->Allocate(bytes);
    if (lease.ok()) std::memset(lease->data(), 0, static_cast<size_t>(bytes));
  }
  if (!lease.ok()) {
    return absl::Status(lease.status().code(),
                        absl::StrCat("state buffer '", name, "' of rank ", rank, " (", bytes,
                                     " bytes): ", lease.status().message()));
  }
  held.lease = std::move(*lease);
  auto [at, added] = buffers_.emplace(std::make_pair(rank, name), std::move(held));
  return Buffer{&at->second.lease, false, at->second.rank_memory};
}

bool RankStates::Has(int64_t rank, const std::string& name) {
  absl::MutexLock lock(&mu_);
  return buffers_.count({rank, name}) > 0;
}

absl::Status RankStates::PutCopy(int64_t rank, const std::string& name, const char* data,
                                 int64_t bytes, Pool* pool) {
  absl::MutexLock lock(&mu_);
  if (buffers_.count({rank, name}) > 0) return absl::OkStatus();
  const int64_t size = std::max<int64_t>(bytes, 1);
  auto lease = pool->Allocate(size);
  if (!lease.ok()) return lease.status();
  if (bytes > 0) std::memcpy(lease->data(), data, static_cast<size_t>(bytes));
  Held& held = buffers_[{rank, name}];
  held.lease = std::move(*lease);
  held.bytes = size;
  return absl::OkStatus();
}

RankStates::JournalMarks RankStates::Journal(int64_t rank) {
  absl::MutexLock lock(&mu_);
  int64_t fields[pool::kJournalMetaFields] = {};
  fields[pool::kJournalCommitted] = fields[pool::kJournalBegun] = -1;
  auto it = buffers_.find({rank, pool::kJournalMeta});
  if (it != buffers_.end() && it->second.bytes >= static_cast<int64_t>(sizeof(fields)) &&
      it->second.memory == nullptr) {
    std::memcpy(fields, it->second.lease.data(), sizeof(fields));
  }
  return {fields[pool::kJournalCommitted], fields[pool::kJournalBegun], fields[pool::kJournalBase]};
}

std::vector<StateSegment> RankStates::Protected(int64_t rank) {
  absl::MutexLock lock(&mu_);
  std::vector<StateSegment> out;
  for (auto it = buffers_.lower_bound({rank, std::string()});
       it != buffers_.end() && it->first.first == rank; ++it) {
    if (absl::StartsWith(it->first.second, pool::kJournal)) continue;
    out.push_back({it->first.second, it->second.lease.data(), it->second.bytes, it->second.memory});
  }
  return out;
}

}  // namespace ragshard::daemon
