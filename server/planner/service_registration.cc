#include <algorithm>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/plan_codec.h"
#include "engine/planner.h"
#include "engine/redundancy.h"
#include "glog/logging.h"
#include "infra/proto_text.h"
#include "infra/rpc.h"
#include "infra/status_macros.h"
#include "server/planner/service.h"

namespace ragshard::planner {

namespace {

// Errors name the rank, or the span of a node's ranks.
std::string RanksName(const std::vector<int64_t>& ranks, const std::string& node) {
  if (ranks.size() == 1) return absl::StrCat("rank ", ranks[0]);
  return absl::StrCat("ranks ", ranks.front(), "..", ranks.back(), " of node '", node, "'");
}

}  // namespace

grpc::ServerUnaryReactor* PlannerService::RegisterRank(Ctx* ctx, const v1::RegisterRankRequest* req,
                                                       v1::RegisterRankResponse* resp) {
  return Register(
      ctx, /*node=*/false, [&] { return ValidateRegisterRank(*req, options_.limits); },
      [&] { return Registration::Of(*req, {req->rank()}); }, resp->mutable_job());
}

grpc::ServerUnaryReactor* PlannerService::RegisterNodeRanks(Ctx* ctx,
                                                            const v1::RegisterNodeRanksRequest* req,
                                                            v1::RegisterNodeRanksResponse* resp) {
  return Register(
      ctx, /*node=*/true, [&] { return ValidateRegisterNodeRanks(*req, options_.limits); },
      [&] {
        std::vector<int64_t> ranks(req->ranks().begin(), req->ranks().end());
        std::sort(ranks.begin(), ranks.end());
        return Registration::Of(*req, std::move(ranks));
      },
      resp->mutable_job());
}

grpc::ServerUnaryReactor* PlannerService::Register(Ctx* ctx, bool node,
                                                   const std::function<absl::Status()>& validate,
                                                   const std::function<Registration()>& make,
                                                   v1::Job* job_out) {
  if (absl::Status s = Admit(ctx, Access::kUser, validate); !s.ok()) return ReplyUnary(ctx, s);
  metrics_.RegistrationCall(node);
  Registration reg = make();
  // Hash outside the lock: a DeepSeek-V3 inventory is several MB.
  if (reg.inventory != nullptr) reg.sha = InventorySha256(*reg.inventory);
  Deferred deferred;
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  std::optional<grpc::Status> result;
  if (EntryPtr e = Entry(reg.job_id); e == nullptr) {
    result = ToGrpcStatus(LiveJob(reg.job_id, nullptr).status());
  } else {
    absl::MutexLock lock(&e->mu);
    auto found = LiveJob(reg.job_id, &e->state);
    result = found.ok() ? RegisterOnJob(**found, reg, job_out, reactor, &deferred)
                        : ToGrpcStatus(found.status());
  }
  RunDeferred(&deferred);
  if (result) reactor->Finish(*result);  // else parked until a full inventory or the deadline
  return reactor;
}

std::optional<grpc::Status> PlannerService::RegisterOnJob(JobState& js, const Registration& reg,
                                                          v1::Job* job_out,
                                                          grpc::ServerUnaryReactor* reactor,
                                                          Deferred* deferred) {
  const bool full = reg.inventory != nullptr;
  const std::string& sha = reg.sha;
  v1::Job& job = js.job;
  auto registered_alike = [&] {
    return std::all_of(reg.ranks.begin(), reg.ranks.end(), [&](int64_t rank) {
      const auto r = js.ranks.find(rank);
      return r != js.ranks.end() && r->second.inventory_sha256() == sha;
    });
  };
  const bool has_reference = !job.inventory_sha256().empty();
  std::optional<grpc::Status> result = grpc::Status::OK;
  if (job.status() == v1::JOB_SHRUNK) {
    // A survivor's new process: it goes on with the successor.
    result = grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, ShrunkText(js));
  } else if (reg.ranks.back() >= job.world_size()) {
    result = ToGrpcStatus(absl::InvalidArgumentError(
        absl::StrCat("rank: ", reg.ranks.back(), " is outside [0, ", job.world_size(), ") of job '",
                     job.job_id(), "'")));
  } else if (job.status() != v1::JOB_REGISTERING || js.planning) {
    // Registration is closed; an identical re-registration (a restarted rank) is fine.
    if (!registered_alike() || JobStatusMachine::Terminal(job.status())) {
      std::string error =
          absl::StrCat("job '", job.job_id(), "' is ", v1::JobStatus_Name(job.status()),
                       job.error().empty() ? "" : absl::StrCat(" (", job.error(), ")"),
                       "; registration is closed");
      // A rank that registered before and now brings another model: name both hashes.
      for (int64_t rank : reg.ranks) {
        const auto r = js.ranks.find(rank);
        if (JobStatusMachine::Terminal(job.status()) || r == js.ranks.end() ||
            r->second.inventory_sha256() == sha)
          continue;
        absl::StrAppend(&error, ": rank ", rank, " registers inventory hash ", HexString(sha),
                        " but registered with ", HexString(r->second.inventory_sha256()),
                        "; a restarted rank must run the same model");
        break;
      }
      result = grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, error);
    }
  } else if (has_reference && sha != job.inventory_sha256()) {
    const std::string who = RanksName(reg.ranks, reg.node_id);
    std::string error;
    if (full && js.inventory) {
      error = absl::StrCat(who, ": inventory differs from the reference: ",
                           FirstInventoryDifference(*js.inventory, *reg.inventory));
    } else {
      error = absl::StrCat(who, ": inventory hash ", HexString(sha), " differs from the reference ",
                           HexString(job.inventory_sha256()));
    }
    job.set_error(error);
    (void)JobChanged(&js, deferred);
    result = grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, error);
  } else if (!has_reference && !full) {
    // Wait for the first full inventory (or the registration deadline).
    PendingHash p;
    p.ranks = reg.ranks;
    p.node_id = reg.node_id;
    p.sha256 = sha;
    p.job_out = job_out;
    p.parked.reactor = reactor;
    js.pending_hash.push_back(std::move(p));
    result = std::nullopt;
  } else {
    // The first full inventory becomes the reference, stored with the registration (a job
    // without one gets here only with a full registration).
    const Inventory* reference = has_reference ? nullptr : reg.inventory;
    const std::string bytes = reference != nullptr ? DeterministicBytes(*reference) : "";
    absl::Status s =
        RecordRanks(&js, reg.ranks, reg.node_id, sha, reference != nullptr ? &bytes : nullptr);
    if (!s.ok()) {
      result = ToGrpcStatus(s);
    } else {
      if (reference != nullptr) {
        js.inventory = *reference;
        ResolvePendingHashes(&js, deferred);
      }
      NotifyWatchers(&js, deferred);
      // The registration that completes a job whose nodes do not fit its redundancy fails it,
      // and is answered why.
      if (absl::Status planned = MaybePlan(job.job_id(), &js, deferred); !planned.ok()) {
        result = ToGrpcStatus(planned);
      }
    }
  }
  *job_out = Summary(job);
  return result;
}

absl::Status PlannerService::RecordRanks(JobState* js, const std::vector<int64_t>& ranks,
                                         const std::string& node, const std::string& sha,
                                         const std::string* inventory_bytes) {
  std::vector<v1::RankState> rows;
  v1::Job job = js->job;  // a summary: O(1) in the world size
  int64_t fresh = 0;
  for (int64_t rank : ranks) {
    v1::RankState& r = rows.emplace_back();
    r.set_rank(rank);
    r.set_registered(true);
    r.set_node_id(node);
    r.set_inventory_sha256(sha);
    fresh += js->ranks.count(rank) == 0 ? 1 : 0;
  }
  job.set_registered_ranks(job.registered_ranks() + fresh);
  if (inventory_bytes != nullptr) job.set_inventory_sha256(sha);
  BeforeJobWrite(job.job_id());
  absl::Status s = store_->Atomically([&] {
    if (inventory_bytes != nullptr) {
      RAGSHARD_RETURN_IF_ERROR(store_->PutInventory(job.job_id(), *inventory_bytes));
    }
    for (const v1::RankState& r : rows) RAGSHARD_RETURN_IF_ERROR(store_->PutRank(job.job_id(), r));
    return store_->PutJob(job);
  });
  const std::string who = RanksName(ranks, node);
  if (!s.ok()) {
    LOG(ERROR) << "store " << who << " of job " << job.job_id() << ": " << s;
    return absl::UnavailableError(absl::StrCat("the planner could not store the registration of ",
                                               who, " of job '", job.job_id(), "': ", s.message()));
  }
  js->job = std::move(job);
  for (v1::RankState& r : rows) js->ranks[r.rank()] = std::move(r);
  js->nodes.reset();
  for (int64_t i = 0; i < fresh; ++i) metrics_.RankRegistered();
  return absl::OkStatus();
}

void PlannerService::ResolvePendingHashes(JobState* js, Deferred* deferred) {
  for (PendingHash& p : js->pending_hash) {
    grpc::Status status;
    if (p.sha256 == js->job.inventory_sha256()) {
      status = ToGrpcStatus(RecordRanks(js, p.ranks, p.node_id, p.sha256));
    } else {
      std::string error =
          absl::StrCat("rank ", p.ranks.front(), ": inventory hash ", HexString(p.sha256),
                       " differs from the reference ", HexString(js->job.inventory_sha256()));
      js->job.set_error(error);
      status = grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, error);
    }
    *p.job_out = Summary(js->job);
    FinishLater(deferred, p.parked.reactor, status);
  }
  js->pending_hash.clear();
}

absl::Status PlannerService::MaybePlan(const std::string& job_id, JobState* js,
                                       Deferred* deferred) {
  if (js->planning || js->plan || js->job.status() != v1::JOB_REGISTERING || !js->inventory) {
    return absl::OkStatus();
  }
  if (js->job.registered_ranks() < js->job.world_size()) return absl::OkStatus();
  // Every rank is registered, so the job's nodes are known: they must fit its redundancy.
  // CreateJob accepted the spelling, so it parses; a stored job of an older planner has none.
  auto redundancy = ParseRedundancy("options.redundancy", js->job.options().redundancy());
  if (redundancy.ok()) {
    const int64_t nodes = JobNodes(js).node_ids_size();
    const int64_t shard = js->job.mesh().shard_size();
    std::vector<std::string> rank_nodes;
    for (int64_t r = 0; r < js->job.world_size(); ++r) {
      const auto state = js->ranks.find(r);
      rank_nodes.push_back(state == js->ranks.end() ? "" : state->second.node_id());
    }
    // HSDP's default, where it covers the loss of any one node: the other replica groups'
    // copy of the same shards (docs/recovery.md, "A lost node"), decided once and kept.
    if (js->job.options().redundancy().empty() && js->job.mesh().replicate_size() >= 2 &&
        js->job.options().recovery_deadline_ms() > 0 && nodes >= 2 &&
        CheckHsdpLayout(shard, rank_nodes).ok()) {
      js->job.mutable_options()->set_redundancy("hsdp");
      redundancy->kind = Redundancy::Kind::kHsdp;
      LOG(INFO) << "job " << job_id << ": redundancy hsdp (its replica groups, by default)";
    }
    absl::Status fits = CheckRedundancyNodes(*redundancy, nodes);
    if (fits.ok() && redundancy->kind == Redundancy::Kind::kHsdp) {
      fits = CheckHsdpLayout(shard, rank_nodes);
    }
    if (!fits.ok()) {
      const std::string error = absl::StrCat("job '", job_id, "': ", fits.message());
      FailJob(js, error, deferred);
      return absl::FailedPreconditionError(error);
    }
  }
  js->planning = true;
  executor_.Submit([this, job_id] { ComputePlan(job_id); });
  return absl::OkStatus();
}

bool PlannerService::PlanInputs(JobState& js, Inventory* inventory, PlanOptions* options,
                                v1::JobOptions* job_options,
                                std::vector<std::string>* rank_nodes) const {
  if (!js.inventory) return false;
  const v1::Job& job = js.job;
  *inventory = *js.inventory;
  *job_options = job.options();
  for (int64_t r = 0; r < job.world_size(); ++r) {
    const auto state = js.ranks.find(r);
    rank_nodes->push_back(state == js.ranks.end() ? "" : state->second.node_id());
  }
  if (job.options().policy() != "auto") options->policy = *ParsePolicy(job.options().policy());
  options->world = job.mesh().shard_size();
  options->align_bytes = job.options().align_bytes();
  options->job_id = job.job_id();
  options->version = job.plan_version() + 1;
  if (!job.options().default_granule().empty()) {
    auto g = *ParseGranule(job.options().default_granule());
    for (UnitSpec& unit : *inventory->mutable_units()) {
      for (TensorSpec& t : *unit.mutable_tensors()) {
        if (t.shape_size() >= 2 && t.granule_kind() == v1::GRANULE_ELEMENT) {
          t.set_granule_kind(g.kind);
          t.set_granule_rows(g.rows);
        }
      }
    }
  }
  return true;
}

void PlannerService::ComputePlan(const std::string& job_id) {
  Inventory inventory;
  PlanOptions options;
  v1::JobOptions job_options;
  std::vector<std::string> rank_nodes;
  EntryPtr e = Entry(job_id);
  if (e == nullptr) return;
  {
    absl::MutexLock lock(&e->mu);
    if (!PlanInputs(e->state, &inventory, &options, &job_options, &rank_nodes)) return;
  }
  const auto started = std::chrono::steady_clock::now();
  absl::StatusOr<v1::Plan> plan;
  int64_t shard = 0, replicate = 0;
  if (job_options.policy() == "auto") {
    auto a = PlanAutoForJob(inventory, job_options, rank_nodes, options);
    if (a.ok()) {
      shard = a->shard;
      replicate = a->replicate;
      plan = std::move(a->plan);
    } else {
      plan = a.status();
    }
  } else {
    plan = BuildPlan(inventory, options);
  }
  metrics_.PlanComputed(
      plan.ok(), std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
  // Compressed outside the lock (about 8 ms for DeepSeek-V3); stored and sent in this form.
  std::string bytes = plan.ok() ? CompressPlan(*plan) : "";
  Deferred deferred;
  {
    absl::MutexLock lock(&e->mu);
    PlanDone(&e->state, std::move(plan), std::move(bytes), shard, replicate, options.version,
             &deferred);
  }
  RunDeferred(&deferred);
}

void PlannerService::PlanDone(JobState* js, absl::StatusOr<v1::Plan> plan, std::string bytes,
                              int64_t shard, int64_t replicate, uint64_t version,
                              Deferred* deferred) {
  const std::string job_id = js->job.job_id();
  // Not planning: the job was deleted (and perhaps created again) meanwhile.
  if (!js->planning) return;
  js->planning = false;
  if (js->job.status() != v1::JOB_REGISTERING) return;  // failed while planning
  if (!plan.ok()) {
    FailJob(js, absl::StrCat("planning failed: ", plan.status().message()), deferred);
    return;
  }
  v1::Job ready = js->job;
  if (shard > 0) {
    // Policy auto chose the shard group: the mesh becomes replicate x shard.
    ready.mutable_mesh()->set_shard_size(shard);
    ready.mutable_mesh()->set_replicate_size(replicate);
  }
  ready.set_plan_version(version);
  if (absl::Status s = JobStatusMachine::Move(&ready, v1::JOB_READY); !s.ok()) {
    FailJob(js, std::string(s.message()), deferred);
    return;
  }
  ready.clear_error();
  // The plan and the job that names it are one transaction: a kill between two writes once left
  // a stored plan beside a job still registering, which no restart planned again.
  BeforeJobWrite(job_id);
  absl::Status s = store_->Atomically([&] {
    RAGSHARD_RETURN_IF_ERROR(store_->PutPlan(job_id, version, bytes));
    return store_->PutJob(ready);
  });
  if (!s.ok()) {
    FailJob(js, absl::StrCat("storing the plan failed: ", s.message()), deferred);
    return;
  }
  js->plan = std::move(*plan);
  js->plan_zstd = std::move(bytes);
  js->job = std::move(ready);
  if (shard > 0) {
    LOG(INFO) << "job " << job_id << " strategy " << js->plan->strategy().executed()
              << " (recommended " << js->plan->strategy().recommended() << ", predicted "
              << js->plan->strategy().predicted_step_seconds() << " s/step)";
  }
  NotifyWatchers(js, deferred);
  LOG(INFO) << "job " << job_id << " READY: plan v" << version << ", " << js->plan->units_size()
            << " unit plans, padding " << js->plan->metrics().padding_pct() << " %";
}

absl::StatusOr<AutoPlan> PlannerService::PlanAutoForJob(const Inventory& inventory,
                                                        const v1::JobOptions& o,
                                                        const std::vector<std::string>& rank_nodes,
                                                        const PlanOptions& options) const {
  // The data plane's shard groups are whole nodes of consecutive ranks: ranks must be numbered
  // node by node, the same number on every node.
  std::vector<std::string> nodes;
  for (const std::string& n : rank_nodes) {
    if (nodes.empty() || nodes.back() != n) nodes.push_back(n);
  }
  const int64_t world = static_cast<int64_t>(rank_nodes.size());
  const int64_t count = static_cast<int64_t>(nodes.size());
  std::set<std::string> distinct(nodes.begin(), nodes.end());
  if (static_cast<int64_t>(distinct.size()) != count || world % count != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "policy auto needs the same number of ranks on every node, numbered node by node; the "
        "ranks' nodes are ",
        absl::StrJoin(rank_nodes, ",")));
  }
  const int64_t per_node = world / count;
  for (int64_t r = 0; r < world; ++r) {
    if (rank_nodes[r] != nodes[r / per_node]) {
      return absl::FailedPreconditionError(
          absl::StrCat("policy auto needs ranks numbered node by node: rank ", r, " is on node '",
                       rank_nodes[r], "', expected '", nodes[r / per_node], "'"));
    }
  }
  CostOptions cost;
  if (!o.optimizer().empty()) cost.optimizer = *ParseOptimizerKind(o.optimizer());
  cost.memory_budget_bytes = o.memory_budget_bytes();
  if (o.tokens_per_step() > 0) cost.tokens_per_step = o.tokens_per_step();
  cost.align_bytes = options.align_bytes;
  return PlanAuto(inventory, "", *options_.cluster_profile, count, per_node, cost, o.strategy(),
                  options);
}

void PlannerService::ExpireRegistration(JobState* js, int64_t now_ms, Deferred* deferred) {
  if (js->job.status() != v1::JOB_REGISTERING || js->planning ||
      js->job.registration_deadline_unix_ms() > now_ms) {
    return;
  }
  if (js->job.inventory_sha256().empty()) {
    FailJob(js,
            absl::StrCat("no rank sent a full inventory within the registration deadline (",
                         js->job.options().registration_timeout_ms(), " ms)"),
            deferred);
    return;
  }
  std::vector<int64_t> missing;
  for (int64_t r = 0; r < js->job.world_size() && missing.size() < 9; ++r) {
    if (!js->ranks.count(r)) missing.push_back(r);
  }
  if (missing.size() > 8) missing.resize(8);
  FailJob(js,
          absl::StrCat("ranks [", absl::StrJoin(missing, ", "), missing.size() == 8 ? ", ..." : "",
                       "] did not register within the registration deadline (",
                       js->job.options().registration_timeout_ms(), " ms)"),
          deferred);
}

}  // namespace ragshard::planner
