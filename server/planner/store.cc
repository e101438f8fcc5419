#include "server/planner/store.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace ragshard::planner {
namespace {

absl::Status SqliteError(sqlite3* db, const std::string& what) {
  return absl::InternalError(absl::StrCat("sqlite: ", what, ": ", sqlite3_errmsg(db)));
}

// One move-only owner of a prepared statement.
class Statement {
 public:
  Statement(sqlite3* db, const std::string& sql) : db_(db) {
    if (sqlite3_prepare_v2(db, sql.c_str(), -1, &stmt_, nullptr) != SQLITE_OK) stmt_ = nullptr;
  }
  ~Statement() { sqlite3_finalize(stmt_); }
  Statement(const Statement&) = delete;
  Statement& operator=(const Statement&) = delete;
  sqlite3_stmt* get() const { return stmt_; }
  bool ok() const { return stmt_ != nullptr; }

 private:
  sqlite3* db_;
  sqlite3_stmt* stmt_ = nullptr;
};

// Creates `dir` and its missing parents with mode 0700 (the state holds tokens and plans: the
// planner's user alone reads it); an existing directory is left as it is.
std::string Column(sqlite3_stmt* s, int i) {
  const void* p = sqlite3_column_blob(s, i);
  int n = sqlite3_column_bytes(s, i);
  return p ? std::string(static_cast<const char*>(p), static_cast<size_t>(n)) : std::string();
}

}  // namespace

absl::Status MakeDataDir(const std::string& dir) {
  struct stat st {};
  if (stat(dir.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) return absl::OkStatus();
    return absl::FailedPreconditionError(
        absl::StrCat("--data-dir '", dir, "': exists and is not a directory"));
  }
  for (size_t at = 1; at <= dir.size(); ++at) {
    if (at != dir.size() && dir[at] != '/') continue;
    const std::string prefix = dir.substr(0, at);
    if (mkdir(prefix.c_str(), 0700) != 0 && errno != EEXIST) {
      return absl::FailedPreconditionError(absl::StrCat("--data-dir '", dir, "': cannot create '",
                                                        prefix, "': ", std::strerror(errno)));
    }
  }
  if (stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--data-dir '", dir, "': cannot create it: a part of the path is not a directory"));
  }
  LOG(INFO) << "created the data directory " << dir << " (mode 0700)";
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Store>> Store::Open(const std::string& data_dir) {
  if (absl::Status s = MakeDataDir(data_dir); !s.ok()) return s;
  if (struct stat st{};
      stat(data_dir.c_str(), &st) == 0 && (st.st_mode & (S_IRWXG | S_IRWXO)) != 0) {
    LOG(WARNING) << "--data-dir " << data_dir << " is open to other users (mode " << std::oct
                 << (st.st_mode & 07777) << std::dec
                 << "): they may read the jobs and rendezvous addresses in its database; "
                    "chmod 700 it";
  }
  const std::string path = data_dir + "/planner.db";
  sqlite3* db = nullptr;
  if (sqlite3_open_v2(path.c_str(), &db,
                      SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_FULLMUTEX,
                      nullptr) != SQLITE_OK) {
    absl::Status s = absl::FailedPreconditionError(
        absl::StrCat("cannot open '", path, "': ", db ? sqlite3_errmsg(db) : "out of memory"));
    sqlite3_close(db);
    return s;
  }
  std::unique_ptr<Store> store(new Store(db));
  sqlite3_busy_timeout(db, 5000);
  for (const char* sql : {
           "PRAGMA journal_mode=WAL",
           "PRAGMA synchronous=NORMAL",  // WAL: durable across process crashes (SIGKILL)
           "CREATE TABLE IF NOT EXISTS schema_version(version INTEGER NOT NULL)",
           "CREATE TABLE IF NOT EXISTS jobs(job_id TEXT PRIMARY KEY, job BLOB NOT NULL)",
           "CREATE TABLE IF NOT EXISTS inventories(job_id TEXT PRIMARY KEY, inventory BLOB NOT "
           "NULL)",
           "CREATE TABLE IF NOT EXISTS plans(job_id TEXT NOT NULL, version INTEGER NOT NULL, "
           "plan BLOB NOT NULL, PRIMARY KEY(job_id, version))",
           "CREATE TABLE IF NOT EXISTS ranks(job_id TEXT NOT NULL, rank INTEGER NOT NULL, "
           "state BLOB NOT NULL, PRIMARY KEY(job_id, rank))",
           "CREATE TABLE IF NOT EXISTS nodes(node_id TEXT PRIMARY KEY, node BLOB NOT NULL)",
           "CREATE TABLE IF NOT EXISTS kv(job_id TEXT NOT NULL, key TEXT NOT NULL, value BLOB NOT "
           "NULL, PRIMARY KEY(job_id, key))",
       }) {
    absl::Status s = store->Exec(sql);
    if (!s.ok()) return s;
  }
  Statement q(db, "SELECT version FROM schema_version");
  if (!q.ok()) return SqliteError(db, "schema_version");
  if (sqlite3_step(q.get()) == SQLITE_ROW) {
    int64_t v = sqlite3_column_int64(q.get(), 0);
    if (v > kSchemaVersion) {
      return absl::FailedPreconditionError(absl::StrCat(
          path, ": schema version ", v, " is newer than this planner's ", kSchemaVersion));
    }
    if (v < kSchemaVersion) {
      // Schema 1's job rows carry their ranks; Load moves them and the next write drops them.
      absl::Status s =
          store->Exec(absl::StrCat("UPDATE schema_version SET version = ", kSchemaVersion));
      if (!s.ok()) return s;
    }
  } else {
    absl::Status s = store->Exec(
        absl::StrCat("INSERT INTO schema_version(version) VALUES (", kSchemaVersion, ")"));
    if (!s.ok()) return s;
  }
  return store;
}

void Store::CloseDatabase::operator()(sqlite3* db) const {
  if (sqlite3_close(db) != SQLITE_OK) LOG(ERROR) << "sqlite close: " << sqlite3_errmsg(db);
}

absl::Status Store::Exec(const std::string& sql) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  char* err = nullptr;
  if (sqlite3_exec(db(), sql.c_str(), nullptr, nullptr, &err) != SQLITE_OK) {
    absl::Status s = absl::InternalError(absl::StrCat("sqlite: ", sql, ": ", err ? err : "?"));
    sqlite3_free(err);
    return s;
  }
  return absl::OkStatus();
}

absl::Status Store::Upsert(const std::string& sql, const std::vector<std::string>& texts,
                           const std::string* blob, const int64_t* number) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  Statement st(db(), sql);
  if (!st.ok()) return SqliteError(db(), sql);
  int i = 1;
  for (const std::string& t : texts) {
    sqlite3_bind_text(st.get(), i++, t.data(), static_cast<int>(t.size()), SQLITE_TRANSIENT);
  }
  if (number != nullptr) sqlite3_bind_int64(st.get(), i++, *number);
  if (blob != nullptr) {
    sqlite3_bind_blob(st.get(), i++, blob->data(), static_cast<int>(blob->size()),
                      SQLITE_TRANSIENT);
  }
  if (sqlite3_step(st.get()) != SQLITE_DONE) return SqliteError(db(), sql);
  return absl::OkStatus();
}

absl::StatusOr<StoredState> Store::Load() {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  StoredState out;
  {
    Statement st(db(), "SELECT job FROM jobs ORDER BY job_id");
    if (!st.ok()) return SqliteError(db(), "load jobs");
    while (sqlite3_step(st.get()) == SQLITE_ROW) {
      v1::Job job;
      if (!job.ParseFromString(Column(st.get(), 0))) return absl::DataLossError("corrupt job row");
      for (v1::RankState& r : *job.mutable_legacy_ranks()) {
        if (r.registered()) out.ranks.emplace_back(job.job_id(), std::move(r));
      }
      job.clear_legacy_ranks();
      out.jobs.push_back(std::move(job));
    }
  }
  {
    Statement st(db(), "SELECT job_id, state FROM ranks ORDER BY job_id, rank");
    if (!st.ok()) return SqliteError(db(), "load ranks");
    while (sqlite3_step(st.get()) == SQLITE_ROW) {
      v1::RankState r;
      if (!r.ParseFromString(Column(st.get(), 1))) return absl::DataLossError("corrupt rank row");
      out.ranks.emplace_back(Column(st.get(), 0), std::move(r));
    }
  }
  {
    Statement st(db(), "SELECT job_id, inventory FROM inventories");
    if (!st.ok()) return SqliteError(db(), "load inventories");
    while (sqlite3_step(st.get()) == SQLITE_ROW) {
      out.inventories.push_back({Column(st.get(), 0), Column(st.get(), 1)});
    }
  }
  {
    // The latest version of each job's plan.
    Statement st(db(),
                 "SELECT p.job_id, p.plan FROM plans p JOIN (SELECT job_id, MAX(version) v FROM "
                 "plans GROUP BY job_id) m ON p.job_id = m.job_id AND p.version = m.v");
    if (!st.ok()) return SqliteError(db(), "load plans");
    while (sqlite3_step(st.get()) == SQLITE_ROW) {
      out.plans.push_back({Column(st.get(), 0), Column(st.get(), 1)});
    }
  }
  {
    Statement st(db(), "SELECT node FROM nodes ORDER BY node_id");
    if (!st.ok()) return SqliteError(db(), "load nodes");
    while (sqlite3_step(st.get()) == SQLITE_ROW) {
      v1::Node node;
      if (!node.ParseFromString(Column(st.get(), 0)))
        return absl::DataLossError("corrupt node row");
      out.nodes.push_back(std::move(node));
    }
  }
  {
    Statement st(db(), "SELECT job_id, key, value FROM kv");
    if (!st.ok()) return SqliteError(db(), "load kv");
    while (sqlite3_step(st.get()) == SQLITE_ROW) {
      out.kv.push_back({Column(st.get(), 0), Column(st.get(), 1), Column(st.get(), 2)});
    }
  }
  return out;
}

absl::Status Store::Atomically(const std::function<absl::Status()>& writes) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  if (absl::Status s = Exec("BEGIN IMMEDIATE"); !s.ok()) return s;
  absl::Status s = writes();
  if (s.ok()) s = Exec("COMMIT");
  if (!s.ok()) (void)Exec("ROLLBACK");
  return s;
}

absl::Status Store::PutRank(const std::string& job_id, const v1::RankState& rank) {
  std::string blob;
  rank.SerializeToString(&blob);
  const int64_t r = rank.rank();
  return Upsert("INSERT OR REPLACE INTO ranks(job_id, rank, state) VALUES (?, ?, ?)", {job_id},
                &blob, &r);
}

absl::Status Store::PutJob(const v1::Job& job) {
  std::string blob;
  job.SerializeToString(&blob);
  return Upsert("INSERT OR REPLACE INTO jobs(job_id, job) VALUES (?, ?)", {job.job_id()}, &blob);
}

absl::Status Store::PutInventory(const std::string& job_id, const std::string& serialized) {
  return Upsert("INSERT OR REPLACE INTO inventories(job_id, inventory) VALUES (?, ?)", {job_id},
                &serialized);
}

absl::Status Store::PutPlan(const std::string& job_id, uint64_t version,
                            const std::string& serialized) {
  const int64_t v = static_cast<int64_t>(version);
  return Upsert("INSERT OR REPLACE INTO plans(job_id, version, plan) VALUES (?, ?, ?)", {job_id},
                &serialized, &v);
}

absl::Status Store::PurgeJobData(const std::string& job_id) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  for (const char* table : {"ranks", "inventories", "plans", "kv"}) {
    absl::Status s =
        Upsert(absl::StrCat("DELETE FROM ", table, " WHERE job_id = ?"), {job_id}, nullptr);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status Store::PutNode(const v1::Node& node) {
  std::string blob;
  node.SerializeToString(&blob);
  return Upsert("INSERT OR REPLACE INTO nodes(node_id, node) VALUES (?, ?)", {node.node_id()},
                &blob);
}

absl::Status Store::PutKv(const std::string& job_id, const std::string& key,
                          const std::string& value) {
  return Upsert("INSERT OR REPLACE INTO kv(job_id, key, value) VALUES (?, ?, ?)", {job_id, key},
                &value);
}

}  // namespace ragshard::planner
