#include "server/daemon/job_runtime.h"

#include <chrono>
#include <optional>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "glog/logging.h"

namespace ragshard::daemon {
namespace {

// How long a background protect's windows may wait for a peer (an operation's default bound).
constexpr absl::Duration kBackgroundDeadline = absl::Seconds(60);
// How often the job's thread, with nothing else to do, moves a background protect on: its
// messages wait in the sockets meanwhile, and a new operation wakes the thread at once.
constexpr absl::Duration kBackgroundPoll = absl::Milliseconds(1);

int64_t SteadyNanos() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

JobRuntime::JobRuntime(std::string job_id, std::string node_id, v1::Plan plan,
                       std::vector<int64_t> local_ranks, std::unique_ptr<UcxWorker> worker,
                       std::unique_ptr<Comm> comm, std::unique_ptr<DataBackend> dp,
                       std::shared_ptr<PlannerClient> planner,
                       std::shared_ptr<DaemonMetrics> metrics)
    : job_id_(std::move(job_id)),
      node_id_(std::move(node_id)),
      plan_(std::move(plan)),
      local_ranks_(std::move(local_ranks)),
      worker_(std::move(worker)),
      comm_(std::move(comm)),
      dp_(std::move(dp)),
      planner_(std::move(planner)),
      metrics_(metrics != nullptr ? std::move(metrics) : std::make_shared<DaemonMetrics>()),
      states_(job_id_),
      recovery_(job_id_, local_ranks_.size()),
      next_seq_(local_ranks_.size(), 1) {
  thread_ = std::thread([this] { Run(); });
}

JobRuntime::~JobRuntime() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
  // The data plane's leases go back to the pool before the comm and worker close.
  dp_.reset();
  comm_.reset();
  worker_.reset();
}

void JobRuntime::FillStats(v1::JobStats* out) {
  absl::MutexLock lock(&mu_);
  out->set_job_id(job_id_);
  out->set_local_ranks(static_cast<int64_t>(local_ranks_.size()));
  out->set_replicas(dp_->replicas());
  out->set_staging_bytes(staging_bytes_.load());
  out->set_operations(operations_.load());
  if (redundancy_ != nullptr) redundancy_->FillStats(out);
  for (const auto& [key, count] : unit_operations_) {
    v1::UnitOperations* u = out->add_unit_operations();
    u->set_unit_index(key.first);
    u->set_kind(key.second);
    u->set_count(count);
  }
}

absl::StatusOr<uint64_t> JobRuntime::StartOp(int local, const OpRequest& req) {
  absl::MutexLock lock(&mu_);
  if (!failed_.ok()) return failed_;
  if (req.kind == v1::OP_NOOP) return uint64_t{0};
  if (absl::Status notice = recovery_.notice(); !notice.ok()) return notice;
  if (!departed_.empty()) {
    absl::Status error = absl::UnavailableError(absl::StrCat(
        "rank ", departed_.begin()->second, " of job '", job_id_, "' on node '", node_id_,
        "' detached (its process exited); collective operations cannot run until it attaches "
        "again"));
    // The job thread tells the planner (a gRPC handler must not block on it).
    if (!departure_reported_) {
      departure_reported_ = true;
      report_ = error;
    }
    return error;
  }
  if (req.unit < 0 || req.unit >= dp_->units()) {
    return absl::InvalidArgumentError(absl::StrCat("unit_index: ", req.unit,
                                                   " is not a unit of job '", job_id_, "' (it has ",
                                                   dp_->units(), ")"));
  }
  const uint64_t seq = next_seq_[local]++;
  Op& op = ops_[seq];
  if (op.started == 0) {
    op.kind = req.kind;
    op.unit = req.unit;
    op.reduce = req.reduce;
    op.keep = req.keep_ranks;
    op.accumulate = req.accumulate;
    op.first_start = absl::Now();
    op.deadline = op.first_start + absl::Milliseconds(req.timeout_ms > 0 ? req.timeout_ms : 60000);
  } else if (op.kind != req.kind || op.unit != req.unit || op.reduce != req.reduce ||
             op.keep != req.keep_ranks) {
    op.status = absl::FailedPreconditionError(absl::StrCat(
        "local ranks disagree on operation ", seq, ": ", v1::OpKind_Name(op.kind), " of unit ",
        op.unit, " against ", v1::OpKind_Name(req.kind), " of unit ", req.unit));
    op.done = true;
    // The job cannot go on: the job thread tells the other nodes and the planner.
    if (abort_.ok()) abort_ = op.status;
    return seq;
  } else {
    // A rank whose gradient shard is known to be zero asks for no accumulation; adding into
    // zeros is exact, so one rank that asks is enough.
    op.accumulate = op.accumulate || req.accumulate;
  }
  if (++op.started == static_cast<int>(local_ranks_.size()) && !op.done) queue_.push_back(seq);
  return seq;
}

void JobRuntime::LocalRankLeft(int local, int64_t rank, uint64_t generation, bool clean) {
  absl::Status error;
  bool recovering = false;
  {
    absl::MutexLock lock(&mu_);
    // A process this rank has replaced already is ignored.
    if (!recovery_.Left(local, generation)) return;
    departed_[local] = rank;
    // After the job's first failure, a rank leaving is its consequence: the others keep hearing
    // the first failure (Fail and FailPending answered their operations with it already).
    if (!failed_.ok()) return;
    if (recovery_.recoverable() && (!clean || !recovery_.running())) {
      // A lost process (or any departure during a recovery) is recovered: the job's thread
      // reports it and every rank attaches again.
      if (recovery_.running()) {
        StartRecovery(absl::StrCat("rank ", rank, " of job '", job_id_, "' on node '", node_id_,
                                   "' was lost (its process exited without detaching)"));
      }
      recovering = true;
    } else {
      for (auto& [seq, op] : ops_) {
        if (op.done || op.started == 0 || seq < next_seq_[local]) continue;
        if (error.ok()) {
          departure_reported_ = true;
          error = absl::UnavailableError(
              absl::StrCat("rank ", rank, " of job '", job_id_, "' on node '", node_id_,
                           "' detached (its process exited) before starting operation ", seq));
        }
        op.done = true;
        op.status = error;
      }
    }
  }
  if (recovering) {
    ServeWaiters();
    return;
  }
  if (error.ok()) return;
  LOG(ERROR) << error;
  Report(error);
  ServeWaiters();
}

std::string JobRuntime::Describe(const Op& op) const {
  if (op.kind == v1::OP_PROTECT || op.kind == v1::OP_PROTECT_FINISH || op.kind == v1::OP_REBUILD) {
    return absl::StrCat(v1::OpKind_Name(op.kind), " (the ranks' state across nodes)");
  }
  const std::string name =
      op.unit >= 0 && op.unit < plan_.units_size() ? plan_.units(op.unit).unit() : "";
  return absl::StrCat(v1::OpKind_Name(op.kind), " of unit ", op.unit,
                      name.empty() ? "" : absl::StrCat(" '", name, "'"));
}

void JobRuntime::FillProgress(std::vector<v1::RankProgress>* out) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  for (size_t i = 0; i < local_ranks_.size(); ++i) {
    v1::RankProgress p;
    p.set_job_id(job_id_);
    p.set_rank(local_ranks_[i]);
    p.set_done_seq(last_done_seq_);
    const RankStates::JournalMarks marks = states_.Journal(local_ranks_[i]);
    // Training steps (a load's base added), the planner's progress and `job why`'s.
    p.set_committed_step(marks.committed < 0 ? marks.committed : marks.committed + marks.base);
    p.set_begun_step(marks.begun < 0 ? marks.begun : marks.begun + marks.base);
    p.set_rejoining(recovery_.rejoining(static_cast<int>(i)));
    if (last_done_seq_ != 0) p.set_done(Describe(last_done_));
    // The first operation this rank started that has not completed.
    for (const auto& [seq, op] : ops_) {
      if (op.done || seq >= next_seq_[i]) continue;
      p.set_pending_seq(seq);
      p.set_pending(Describe(op));
      p.set_pending_ms(absl::ToInt64Milliseconds(now - op.first_start));
      std::vector<std::string> late;  // local ranks that have not started it
      for (size_t j = 0; j < local_ranks_.size(); ++j) {
        if (next_seq_[j] <= seq) late.push_back(absl::StrCat(local_ranks_[j]));
      }
      if (!late.empty()) {
        p.set_waiting_on(absl::StrCat(late.size() == 1 ? "local rank " : "local ranks ",
                                      absl::StrJoin(late, ", "), " to start it"));
      } else if (running_seq_ == seq) {
        const std::string peers = comm_ != nullptr ? comm_->waiting_for() : "";
        p.set_waiting_on(peers.empty() ? "the data plane (running)" : peers);
      } else {
        p.set_waiting_on(
            absl::StrCat("its turn on the job's thread (behind operation ", running_seq_, ")"));
      }
      break;
    }
    out->push_back(std::move(p));
  }
}

void JobRuntime::Fail(const absl::Status& error) {
  {
    absl::MutexLock lock(&mu_);
    if (!failed_.ok() || stopping_) return;
    failed_ = error;
    for (auto& [seq, op] : ops_) {
      if (op.done) continue;
      op.done = true;
      op.status = error;
    }
    queue_.clear();
  }
  LOG(ERROR) << "job " << job_id_ << ": " << error;
  ServeWaiters();
}

void JobRuntime::Report(const absl::Status& error) {
  v1::ReportFailureRequest report;
  report.set_job_id(job_id_);
  report.set_reporter_node_id(node_id_);
  report.set_lost_peer(std::string(error.message()).substr(0, 256));
  report.set_message(std::string(error.message()).substr(0, 1024));
  report.set_reporter_incarnation(incarnation_.load());
  if (auto r = planner_->ReportFailure(report); !r.ok()) {
    LOG(WARNING) << "reporting the failure to the planner: " << r.status();
  }
}

void JobRuntime::AddWaiter(uint64_t seq, int local, absl::Time deadline, WaitCallback done) {
  bool finished = true;
  absl::Status status;
  v1::UnitBuffers placement;
  bool placed = false;
  OpTimes times;
  if (seq != 0) {  // 0 is a no-op, done at once
    absl::MutexLock lock(&mu_);
    auto it = ops_.find(seq);
    if (it == ops_.end()) {
      status = absl::NotFoundError(absl::StrCat("no operation ", seq, " in job '", job_id_, "'"));
    } else if (it->second.done) {
      status = it->second.status;
      if (static_cast<size_t>(local) < it->second.placements.size()) {
        placement = it->second.placements[local];
        placed = true;
      }
      times = it->second.times;
      Waited(it);
    } else if (deadline > absl::Now()) {
      it->second.waiters.push_back({deadline, local, std::move(done)});
      return;
    } else {
      finished = false;  // a poll of an operation still running
    }
  }
  done(finished, status, placed ? &placement : nullptr, times);
}

void JobRuntime::FailUnfinished(const absl::Status& error) {
  // Queued operations, and those some local ranks have started but not all: after a failure, a
  // rank already waiting on one hears the job's first failure, not what follows from it (a
  // sibling rank that exited on that failure).
  for (auto& [seq, op] : ops_) {
    if (op.done) continue;
    op.done = true;
    op.status = error;
  }
  queue_.clear();
}

void JobRuntime::ServeWaiters() {
  std::vector<std::function<void()>> calls;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    for (auto it = ops_.begin(); it != ops_.end();) {
      auto next = std::next(it);
      Op& op = it->second;
      std::vector<Op::Waiter> keep;
      int resolved = 0;
      for (Op::Waiter& w : op.waiters) {
        if (op.done) {
          std::optional<v1::UnitBuffers> placement;
          if (static_cast<size_t>(w.local) < op.placements.size()) {
            placement = op.placements[w.local];
          }
          calls.push_back([cb = std::move(w.done), st = op.status, placement, t = op.times] {
            cb(true, st, placement ? &*placement : nullptr, t);
          });
          ++resolved;
        } else if (w.deadline <= now) {
          calls.push_back(
              [cb = std::move(w.done)] { cb(false, absl::OkStatus(), nullptr, OpTimes()); });
        } else {
          keep.push_back(std::move(w));
        }
      }
      op.waiters = std::move(keep);
      if (resolved > 0) {
        op.waited += resolved - 1;
        Waited(it);
      }
      it = next;
    }
  }
  for (auto& c : calls) c();
}

void JobRuntime::Run() {
  bool background = false;  // a protect with windows to move in the idle moments
  while (true) {
    uint64_t seq = 0;
    Op op;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !queue_.empty() || (!abort_.ok() && failed_.ok()) ||
               (!recovery_.running() && failed_.ok());
      };
      mu_.AwaitWithTimeout(absl::Condition(&ready),
                           background ? kBackgroundPoll : absl::Milliseconds(50));
      if (stopping_) break;  // the waiters left are answered below
      if (!recovery_.running() && failed_.ok()) {
        mu_.Unlock();
        Recover();
        mu_.Lock();
        continue;
      }
      // The other nodes first (a notice over the data plane, at once), then the planner (a round
      // trip that tells every daemon, at its next heartbeat).
      if (!abort_.ok() && failed_.ok()) {
        failed_ = abort_;
        FailPending();
        const absl::Status a = abort_;
        mu_.Unlock();
        LOG(ERROR) << "job " << job_id_ << ": " << a;
        if (comm_ != nullptr) comm_->Abort(std::string(a.message()));
        Report(a);
        ServeWaiters();
        mu_.Lock();
      }
      if (!report_.ok()) {
        absl::Status r = std::exchange(report_, absl::OkStatus());
        mu_.Unlock();
        Report(r);
        mu_.Lock();
      }
      if (queue_.empty()) {
        if (background) {
          mu_.Unlock();
          background = AdvanceProtect();
          mu_.Lock();
        }
        continue;
      }
      seq = queue_.front();
      queue_.pop_front();
      auto found = ops_.find(seq);
      if (found == ops_.end() || found->second.done) continue;  // answered already (a departure)
      op = found->second;
      running_seq_ = seq;
    }
    const int64_t sent_before = comm_ != nullptr ? comm_->sent_bytes() : 0;
    const absl::Time started = absl::Now();
    OpTimes times;
    times.started_ns = SteadyNanos();
    const absl::Status s = Execute(seq, op);
    times.finished_ns = SteadyNanos();
    metrics_->OperationDone(op.kind, absl::ToDoubleSeconds(absl::Now() - started), s,
                            comm_ != nullptr ? comm_->sent_bytes() - sent_before : 0);
    std::vector<v1::UnitBuffers> placements;
    if (s.ok()) {
      placements.resize(local_ranks_.size());
      for (size_t i = 0; i < placements.size(); ++i) {
        dp_->Placement(op.unit, static_cast<int>(i), &placements[i]);
      }
    }
    // A lost peer, the deadline, or ranks that disagree (ABORTED) end the job.
    const bool fatal =
        !s.ok() && (absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s) || absl::IsAborted(s));
    bool known = false;    // the job failed already (the planner told us): nothing new to report
    bool recover = false;  // a job that recovers in place: the failure starts (or is) a recovery
    {
      absl::MutexLock lock(&mu_);
      known = !failed_.ok();
      if (fatal && !known && recovery_.recoverable()) {
        recover = true;
        StartRecovery(absl::StrCat("node '", node_id_, "' lost ", Describe(op), ": ", s.message()));
        // The connection failed already (a peer's notice, or a lost peer) and gave up its
        // requests: the recovery replaces it without aborting it again, which would wait once
        // more for sends that a peer that stopped never receives.
        recovery_.MarkCommAborted();
      }
    }
    const bool report = fatal && !known && !recover;
    if (report) LOG(ERROR) << "job " << job_id_ << ": " << s;
    {
      absl::MutexLock lock(&mu_);
      ++operations_;
      ++unit_operations_[{op.unit, op.kind}];
      staging_bytes_.store(dp_->staging_bytes());
      if (fatal && failed_.ok() && !recover) failed_ = s;
      running_seq_ = 0;
      last_done_seq_ = seq;
      last_done_.kind = op.kind;  // described when progress is asked for
      last_done_.unit = op.unit;
      // An operation the job's failure (Fail, a departed rank) already answered keeps that answer.
      auto it = ops_.find(seq);
      if (it != ops_.end() && !it->second.done) {
        it->second.done = true;
        it->second.status = s;
        it->second.placements = std::move(placements);
        it->second.times = times;
      }
      if (!failed_.ok()) FailPending();
    }
    ServeWaiters();
    // The planner hears of it once the ranks have their answer: a node cut off from the planner
    // (whose report waits out its retries) still tells its ranks at once.
    if (report) Report(s);
    background = AdvanceProtect();
  }
  // Stopping: nobody will complete the remaining operations; answer their waiters.
  std::vector<WaitCallback> pending;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [seq, op] : ops_) {
      for (auto& w : op.waiters) pending.push_back(std::move(w.done));
      op.waiters.clear();
    }
  }
  for (auto& cb : pending) {
    cb(true, absl::AbortedError("the job was released"), nullptr, OpTimes());
  }
}

absl::Status JobRuntime::Execute(uint64_t seq, const Op& op) {
  switch (op.kind) {
    case v1::OP_UNSHARD:
      return dp_->Unshard(op.unit, op.deadline);
    case v1::OP_ALLOCATE_UNSHARDED:
      return dp_->AllocateUnsharded(op.unit);
    case v1::OP_RESHARD:
      return dp_->Reshard(op.unit, op.keep);
    case v1::OP_ALLOCATE_GRAD:
      return dp_->AllocateGrad(op.unit);
    case v1::OP_REDUCE_SCATTER:
      return dp_->ReduceScatter(op.unit, ToReduceOp(op.reduce), op.accumulate, op.deadline);
    case v1::OP_ALL_REDUCE:
      return dp_->AllReduce(op.unit, ToReduceOp(op.reduce), op.deadline);
    case v1::OP_GATHER_TO_OWNER:
      return dp_->GatherToOwner(op.unit, op.deadline);
    case v1::OP_SCATTER_FROM_OWNER:
      return dp_->ScatterFromOwner(op.unit, op.deadline);
    case v1::OP_PROTECT:
    case v1::OP_PROTECT_FINISH:
    case v1::OP_REBUILD:
      return Redundancy(seq, op);
    case v1::OP_UPDATE_GATHER:
      return dp_->UpdateGather(op.unit, op.deadline);
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unknown operation kind ", static_cast<int>(op.kind)));
  }
}

void JobRuntime::EnableRedundancy(RedundancyScheme scheme, const std::string& text, int node,
                                  std::vector<std::string> nodes, bool replacement, Pool* pool) {
  auto redundancy = std::make_unique<JobRedundancy>(job_id_, node_id_, scheme, text, node,
                                                    std::move(nodes), local_ranks_, replacement,
                                                    pool, &states_, planner_, metrics_);
  absl::MutexLock lock(&mu_);
  redundancy_ = std::move(redundancy);
}

absl::Status JobRuntime::ExposeCopy(int local, int64_t step, const std::string& name, Pool* pool) {
  JobRedundancy* redundancy = redundancy_state();
  if (redundancy == nullptr) return absl::OkStatus();  // no copy: the buffers stay zeros
  return redundancy->ExposeCopy(local, step, name, pool);
}

bool JobRuntime::AdvanceProtect() {
  JobRedundancy* redundancy = redundancy_state();
  if (redundancy == nullptr || comm_ == nullptr || !redundancy->protect_in_flight()) return false;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_ || !failed_.ok() || !recovery_.running()) return false;
  }
  const absl::Status s = redundancy->AdvanceProtect(*comm_, kBackgroundDeadline);
  if (s.ok()) return redundancy->protect_in_flight();
  // (The protect stays until the recovery closes the connection, or the job ends: its windows
  // in flight may still write into its buffers.)
  const std::string what =
      absl::StrCat("node '", node_id_, "' lost the protect of the ranks' state: ", s.message());
  {
    absl::MutexLock lock(&mu_);
    if (!failed_.ok() || stopping_) return false;
    const bool fatal = absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s) || absl::IsAborted(s);
    if (fatal && recovery_.recoverable()) {
      StartRecovery(what);
      recovery_.MarkCommAborted();  // (as an operation's failure: JobRuntime::Run)
      return false;
    }
    failed_ = absl::Status(s.code(), what);
    FailPending();
  }
  LOG(ERROR) << "job " << job_id_ << ": " << what;
  Report(absl::Status(s.code(), what));
  ServeWaiters();
  return false;
}

absl::Status JobRuntime::Redundancy(uint64_t seq, const Op& op) {
  const std::string what = v1::OpKind_Name(op.kind);
  JobRedundancy* redundancy = redundancy_state();
  if (redundancy == nullptr || comm_ == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, ": job '", job_id_, "' has no redundancy across nodes (JobOptions.redundancy)"));
  }
  if (op.kind == v1::OP_PROTECT) return redundancy->Protect(*comm_, *dp_, op.deadline, seq);
  if (op.kind == v1::OP_PROTECT_FINISH) return redundancy->FinishProtect(*comm_, op.deadline);
  return redundancy->Rebuild(*comm_, *dp_, recovery_.epoch(), op.deadline, seq,
                             [this](const absl::Status& error) {
                               Report(error);
                               Fail(error);
                             });
}

}  // namespace ragshard::daemon
