// Durable planner state in SQLite (WAL mode) under --data-dir. The data directory must be on a
// local disk: SQLite's WAL mode does not work over NFS.
//
// Thread-safe: one connection, its calls serialized by the store's own (recursive) mutex, which
// Atomically holds across its writes. The service writes a job's rows under that job's lock, the
// nodes' under the node registry's and the keys' under the rendezvous', never under a lock of
// the whole service, so the store serializes only the writes themselves.
#pragma once

#include <sqlite3.h>

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "ragshard/v1/plan.pb.h"
#include "ragshard/v1/planner.pb.h"

namespace ragshard::planner {

// 2: ranks live in their own table (schema 1 kept them in the job row; Load moves them).
inline constexpr int kSchemaVersion = 2;

struct StoredState {
  std::vector<v1::Job> jobs;                                     // legacy_ranks moved into `ranks`
  std::vector<std::pair<std::string, v1::RankState>> ranks;      // job id, a registered rank
  std::vector<std::pair<std::string, std::string>> inventories;  // job id, serialized Inventory
  std::vector<std::pair<std::string, std::string>> plans;        // job id, serialized Plan (latest)
  std::vector<v1::Node> nodes;
  struct Kv {
    std::string job_id, key, value;
  };
  std::vector<Kv> kv;
};

// Creates `dir` and its missing parents, mode 0700; OK when it is a directory already.
// FAILED_PRECONDITION saying why it cannot be created.
absl::Status MakeDataDir(const std::string& dir);

class Store {
 public:
  // Opens (creating if needed) <data_dir>/planner.db; a missing data_dir is created first, with
  // its missing parents, mode 0700. Fails with FAILED_PRECONDITION, saying why, when data_dir
  // cannot be created or the file's schema version is newer than this binary's.
  static absl::StatusOr<std::unique_ptr<Store>> Open(const std::string& data_dir);

  absl::StatusOr<StoredState> Load();

  // Runs `writes` (calls of the Put methods) in one transaction: all of them are durable, or none.
  absl::Status Atomically(const std::function<absl::Status()>& writes);

  absl::Status PutJob(const v1::Job& job);
  absl::Status PutRank(const std::string& job_id, const v1::RankState& rank);
  absl::Status PutInventory(const std::string& job_id, const std::string& serialized);
  // Stores plan bytes exactly as given; they are served as stored.
  absl::Status PutPlan(const std::string& job_id, uint64_t version, const std::string& serialized);
  // Removes the ranks, inventory, plans and rendezvous keys of a job (the job row stays as a
  // tombstone).
  absl::Status PurgeJobData(const std::string& job_id);
  absl::Status PutNode(const v1::Node& node);
  absl::Status PutKv(const std::string& job_id, const std::string& key, const std::string& value);

 private:
  struct CloseDatabase {
    void operator()(sqlite3* db) const;
  };
  explicit Store(sqlite3* db) : db_(db) {}
  sqlite3* db() const { return db_.get(); }
  absl::Status Exec(const std::string& sql);
  absl::Status Upsert(const std::string& sql, const std::vector<std::string>& texts,
                      const std::string* blob, const int64_t* number = nullptr);

  // Closed with the store; the mutex makes the store neither copyable nor movable.
  std::unique_ptr<sqlite3, CloseDatabase> db_;
  // Recursive: Atomically holds it while `writes` call the Put methods, which take it too.
  std::recursive_mutex mu_;
};

}  // namespace ragshard::planner
