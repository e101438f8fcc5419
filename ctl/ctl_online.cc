#include "ctl/ctl_online.h"

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "ctl/ctl_format.h"
#include "ctl/ctl_recovery.h"
#include "ctl/ctl_strategy.h"
#include "engine/dtype.h"
#include "engine/models.h"
#include "engine/plan_json.h"
#include "engine/planner.h"
#include "engine/redundancy.h"
#include "engine/sharding.h"
#include "engine/strategy.h"
#include "infra/proto_text.h"

namespace ragshard {
namespace {

absl::StatusOr<std::unique_ptr<PlannerClient>> Connect(const Online& o) {
  PlannerClientOptions opts;
  opts.address = o.planner;
  opts.security = o.security;
  opts.rpc_timeout = std::chrono::milliseconds(10000);
  opts.retry_window = std::chrono::milliseconds(static_cast<int64_t>(o.retry_s * 1000));
  return GrpcPlannerClient::Create(opts);
}

// Connects to the planner and makes one call on it: `call(client)`'s answer, or the connection's
// error.
template <typename Call>
auto Ask(const Online& o, Call call) -> decltype(call(std::declval<PlannerClient&>())) {
  auto client = Connect(o);
  if (!client.ok()) return client.status();
  return call(**client);
}

int Fail(std::ostream& err, const absl::Status& s) {
  err << "error: " << OneLine(s.message()) << "\n";
  return absl::IsInvalidArgument(s) ? kExitBadInput : kExitFailure;
}

std::string ToJson(const google::protobuf::Message& m) { return ProtoJson(m, false, true); }

// Prints `items` as the JSON of the list response whose repeated field `field` returns.
template <typename T, typename Response, typename Field>
int PrintList(const std::vector<T>& items, Field* (Response::*field)(), std::ostream& out) {
  Response response;
  (response.*field)()->Add(items.begin(), items.end());
  out << ToJson(response) << "\n";
  return kExitOk;
}

std::string StatusName(v1::JobStatus s) {
  std::string n = v1::JobStatus_Name(s);
  return n.rfind("JOB_", 0) == 0 ? n.substr(4) : n;
}

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// The nodes of the registered ranks, in the order of their first rank.
std::vector<std::string> NodesOf(const std::vector<v1::RankState>& ranks) {
  std::vector<std::string> nodes;
  std::set<std::string> seen;
  for (const auto& r : ranks) {
    if (r.registered() && seen.insert(r.node_id()).second) nodes.push_back(r.node_id());
  }
  return nodes;
}

}  // namespace

void AddOnlineFlags(CLI::App* app, Online* o) {
  const char* env = std::getenv("RAGSHARD_PLANNER");
  o->planner = env != nullptr ? env : "127.0.0.1:7070";
  app->add_option("--planner", o->planner, "planner address HOST:PORT (env RAGSHARD_PLANNER)");
  o->security = ClientSecurityFromEnv();  // the flags' defaults
  app->add_option("--token-file", o->security.token_file,
                  "bearer token file (env RAGSHARD_TOKEN_FILE)");
  app->add_option("--tls-ca", o->security.tls_ca_file,
                  "CA of the planner's certificate (enables TLS; env RAGSHARD_TLS_CA)");
  app->add_option("--tls-cert", o->security.tls_cert_file,
                  "client certificate (mutual TLS; env RAGSHARD_TLS_CERT)");
  app->add_option("--tls-key", o->security.tls_key_file,
                  "client key (mutual TLS; env RAGSHARD_TLS_KEY)");
  app->add_option("--tls-server-name", o->security.tls_server_name,
                  "name to check in the planner's certificate (env RAGSHARD_TLS_SERVER_NAME)");
  app->add_option("--retry-s", o->retry_s,
                  "seconds to keep retrying a planner that is unavailable (restarting)")
      ->check(CLI::Range(0.0, 3600.0))
      ->capture_default_str();
}

int RunHealth(const Online& o, std::ostream& out, std::ostream& err) {
  absl::Status s = Ask(o, [&](PlannerClient& c) { return c.Health(); });
  if (!s.ok()) return Fail(err, s);
  out << (o.json ? "{\"status\": \"SERVING\"}" : "SERVING") << "\n";
  return kExitOk;
}

int RunJobs(const Online& o, std::ostream& out, std::ostream& err) {
  auto jobs = Ask(o, [&](PlannerClient& c) { return c.ListJobs(); });
  if (!jobs.ok()) return Fail(err, jobs.status());
  if (o.json) return PrintList(*jobs, &v1::ListJobsResponse::mutable_jobs, out);
  out << absl::StrFormat("%-24s %-12s %12s %-13s %11s %5s  %s\n", "JOB", "STATUS", "WORLD",
                         "POLICY", "REGISTERED", "PLAN", "DETAIL");
  const int64_t now = NowMs();
  for (const auto& j : *jobs) {
    // The recovery (in progress, or those before) and the error.
    std::vector<std::string> detail;
    if (std::string note = ShrinkNote(j); !note.empty()) detail.push_back(note);
    if (std::string note = RedundancyNote(j); !note.empty()) detail.push_back(note);
    if (std::string note = RecoveryNote(j, now); !note.empty()) detail.push_back(note);
    if (!j.error().empty()) detail.push_back(OneLine(j.error()));
    out << absl::StrFormat(
        "%-24s %-12s %12s %-13s %11s %5s  %s\n", j.job_id(), StatusName(j.status()),
        absl::StrCat(j.mesh().replicate_size(), "x", j.mesh().shard_size()), j.options().policy(),
        absl::StrCat(j.registered_ranks(), "/", j.world_size()),
        j.plan_version() ? absl::StrCat("v", j.plan_version()) : "-", absl::StrJoin(detail, "; "));
  }
  return kExitOk;
}

int RunJobShow(const Online& o, const std::string& id, std::ostream& out, std::ostream& err) {
  auto job = Ask(o, [&](PlannerClient& c) { return c.GetJob(id); });
  if (!job.ok()) return Fail(err, job.status());
  if (o.json) {
    out << ToJson(*job) << "\n";
    return kExitOk;
  }
  auto ranks = Ask(o, [&](PlannerClient& c) { return c.ListRanks(id); });
  if (!ranks.ok()) return Fail(err, ranks.status());
  const v1::Job& j = *job;
  out << "job:          " << j.job_id() << "\n"
      << "status:       " << StatusName(j.status()) << "\n"
      << "mesh:         " << j.mesh().replicate_size() << " replica(s) x " << j.mesh().shard_size()
      << " ranks (world " << j.world_size() << ")\n"
      << "policy:       " << j.options().policy() << ", align " << j.options().align_bytes() << " B"
      << (j.options().default_granule().empty() ? "" : ", granule ")
      << j.options().default_granule()
      << (j.options().recovery_deadline_ms() > 0
              ? absl::StrFormat(", recovers in place within %g s",
                                static_cast<double>(j.options().recovery_deadline_ms()) / 1000.0)
              : "")
      << "\n"
      << "registered:   " << j.registered_ranks() << "/" << j.world_size() << "\n"
      << "inventory:    " << (j.inventory_sha256().empty() ? "-" : HexString(j.inventory_sha256()))
      << "\n"
      << "plan version: " << j.plan_version() << "\n"
      << "error:        " << (j.error().empty() ? "-" : OneLine(j.error())) << "\n"
      << ShrinkLines(j) << RedundancyLines(j) << RecoveryLines(j, NodesOf(*ranks), NowMs());
  std::map<std::string, int> per_node;
  for (const auto& r : *ranks) {
    if (r.registered()) ++per_node[r.node_id()];
  }
  for (const auto& [node, n] : per_node) out << "node " << node << ": " << n << " rank(s)\n";
  return kExitOk;
}

int RunPlanMetrics(const Online& o, const std::string& id, std::ostream& out, std::ostream& err) {
  auto plan = Ask(o, [&](PlannerClient& c) { return c.GetPlan(id); });
  if (!plan.ok()) return Fail(err, plan.status());
  if (o.json) {
    out << MetricsToJson(plan->metrics()).dump(1) << "\n";
    return kExitOk;
  }
  PolicyResult r;
  r.policy = *ParsePolicy(plan->policy());
  r.metrics = plan->metrics();
  r.plan = *plan;
  std::ostringstream table;
  PrintPlanTable(r, table);
  std::string text = table.str();
  out << text.substr(text.find("total:"));
  return kExitOk;
}

int RunPlanShow(const Online& o, const std::string& id, const std::string& unit,
                const std::string& factor, std::ostream& out, std::ostream& err) {
  auto stored = Ask(o, [&](PlannerClient& c) { return c.GetPlan(id); });
  if (!stored.ok()) return Fail(err, stored.status());
  const Factor f = factor == "g" ? Factor::kG : factor == "os" ? Factor::kOs : Factor::kP;
  auto plan = FactorPlanOf(*stored, f);
  if (!plan.ok()) {
    return Fail(err, absl::NotFoundError(
                         absl::StrCat("--factor: job '", id, "': ", plan.status().message())));
  }
  if (!unit.empty()) {
    const v1::UnitPlan* up = nullptr;
    for (const auto& u : plan->units()) {
      if (u.unit() == unit) up = &u;
    }
    if (up == nullptr) {
      return Fail(err, absl::NotFoundError(
                           absl::StrCat("--unit: job '", id, "' has no unit '", unit, "'")));
    }
    if (o.json) {
      out << ToJson(*up) << "\n";
      return kExitOk;
    }
    out << absl::StrFormat("unit %s (%s), factor %s over %d positions, shard_elems %d\n",
                           up->unit(), DTypeName(up->dtype()), factor, plan->world_size(),
                           up->shard_elems());
    out << absl::StrFormat("%-50s %14s %12s %10s %6s %6s %6s\n", "tensor", "offset", "numel",
                           "granule", "first", "ranks", "owner");
    for (const auto& t : up->tensors()) {
      out << absl::StrFormat("%-50s %14d %12d %10d %6d %6d %6s\n", t.name(), t.offset(), t.numel(),
                             t.granule_elems(), t.first_rank(), t.rank_elems_size(),
                             t.owner_rank() >= 0 ? absl::StrCat(t.owner_rank()) : "-");
    }
    return kExitOk;
  }
  if (o.json) {
    out << ToJson(factor == "p" ? *stored : *plan) << "\n";
    return kExitOk;
  }
  PolicyResult r;
  r.policy = *ParsePolicy(plan->policy());
  r.metrics = plan->metrics();
  r.plan = *plan;
  out << "job " << id << ", plan v" << plan->version() << ", factor " << factor
      << ", W=" << plan->world_size() << "\n";
  if (stored->has_strategy()) {
    const v1::PlanStrategy& st = stored->strategy();
    out << absl::StrFormat(
        "strategy %s (%s; the search's best: %s), predicted %.4f s/step, %s per device, padding "
        "%.3f%%\n",
        st.executed(), st.reason(), st.recommended(), st.predicted_step_seconds(),
        FormatBytes(st.predicted_memory_bytes()), st.predicted_padding_pct());
  }
  if (stored->has_sharding()) {
    const v1::ShardingSpec& sh = stored->sharding();
    out << absl::StrFormat(
        "sharding on %d nodes x %d: parameters p=%dx%d (%d positions), gradients g=%dx%d, "
        "optimizer state os=%dx%d; --factor g|os shows their plans\n",
        sh.nodes(), sh.devices_per_node(), sh.p().intra(), sh.p().inter(),
        sh.p().intra() * sh.p().inter(), sh.g().intra(), sh.g().inter(), sh.os().intra(),
        sh.os().inter());
  }
  PrintPlanTable(r, out);
  return kExitOk;
}

int RunJobCreate(const Online& o, const JobSpec& spec, const JobCreateFlags& flags,
                 std::ostream& out, std::ostream& err) {
  const std::string& memory_budget = flags.memory_budget;
  const std::string& recovery_deadline = flags.recovery_deadline;
  v1::CreateJobRequest create = MakeCreateJobRequest(spec);
  if (!recovery_deadline.empty()) {
    double seconds = 0;
    if (!absl::SimpleAtod(recovery_deadline, &seconds) || !std::isfinite(seconds) || seconds < 0 ||
        seconds > kMaxRecoveryDeadlineS) {
      err << "error: --recovery-deadline: '" << recovery_deadline
          << "' is not a number of seconds in [0, " << kMaxRecoveryDeadlineS << "]\n";
      return kExitBadInput;
    }
    create.mutable_options()->set_recovery_deadline_ms(std::llround(seconds * 1000));
  }
  if (!memory_budget.empty()) {
    int64_t b = 0;
    if (!ParseByteSize(memory_budget, &b)) {
      err << "error: --memory-budget: '" << memory_budget << "' is not a byte count\n";
      return kExitBadInput;
    }
    create.mutable_options()->set_memory_budget_bytes(b);
  }
  if (!flags.redundancy.empty()) {
    auto r = ParseRedundancy("--redundancy", flags.redundancy);
    if (!r.ok()) return Fail(err, r.status());
    if (r->enabled() && create.options().recovery_deadline_ms() <= 0) {
      err << "error: --redundancy " << r->name()
          << " needs --recovery-deadline SECONDS > 0 (a lost node is rebuilt on a replacement "
             "daemon within it)\n";
      return kExitBadInput;
    }
    if (r->enabled()) create.mutable_options()->set_redundancy(r->name());
  }
  auto created = Ask(o, [&](PlannerClient& c) { return c.CreateJob(create); });
  if (!created.ok()) return Fail(err, created.status());
  out << (o.json ? ToJson(*created) : absl::StrCat("job ", spec.job_id, " created")) << "\n";
  return kExitOk;
}

int RunJobDelete(const Online& o, const std::string& id, std::ostream& out, std::ostream& err) {
  absl::Status s = Ask(o, [&](PlannerClient& c) { return c.DeleteJob(id); });
  if (!s.ok()) return Fail(err, s);
  out << "job " << id << " deleted\n";
  return kExitOk;
}

int RunNodes(const Online& o, std::ostream& out, std::ostream& err) {
  auto nodes = Ask(o, [&](PlannerClient& c) { return c.ListNodes(); });
  if (!nodes.ok()) return Fail(err, nodes.status());
  if (o.json) return PrintList(*nodes, &v1::ListNodesResponse::mutable_nodes, out);
  const int64_t now = NowMs();
  out << absl::StrFormat("%-20s %-6s %-24s %12s %12s %12s %7s %8s %10s\n", "NODE", "STATUS",
                         "DATA ADDRESS", "POOL CAP", "POOL USED", "POOL PEAK", "FRAG", "BUFFERS",
                         "HEARTBEAT");
  for (const auto& n : *nodes) {
    const auto& f = n.figures();
    out << absl::StrFormat("%-20s %-6s %-24s %12s %12s %12s %6.1f%% %8d %9.1fs\n", n.node_id(),
                           n.status() == v1::NODE_UP ? "UP" : "LOST", n.data_address(),
                           Human(f.pool_capacity_bytes()), Human(f.pool_used_bytes()),
                           Human(f.pool_peak_bytes()), 100.0 * f.pool_fragmentation(), f.buffers(),
                           (now - n.last_heartbeat_unix_ms()) / 1000.0);
  }
  return kExitOk;
}

int RunNodeStats(const Online& o, const std::string& node_id, std::ostream& out,
                 std::ostream& err) {
  auto nodes = Ask(o, [&](PlannerClient& c) { return c.ListNodes(); });
  if (!nodes.ok()) return Fail(err, nodes.status());
  const v1::Node* node = nullptr;
  std::vector<std::string> known;
  for (const auto& n : *nodes) {
    if (n.node_id() == node_id) node = &n;
    known.push_back(n.node_id());
  }
  if (node == nullptr) {
    err << "error: no node '" << node_id << "' at the planner (it knows "
        << (known.empty() ? "none" : absl::StrJoin(known, ", ")) << ")\n";
    return kExitFailure;
  }
  if (o.json) {
    out << ToJson(*node) << "\n";
    return kExitOk;
  }
  const int64_t now = NowMs();
  const auto& f = node->figures();
  out << absl::StrFormat("node %s: %s, data address %s, last heartbeat %.1fs ago\n",
                         node->node_id(), node->status() == v1::NODE_UP ? "UP" : "LOST",
                         node->data_address(), (now - node->last_heartbeat_unix_ms()) / 1000.0);
  out << absl::StrFormat("pool: capacity %sB, used %sB, peak %sB, fragmentation %.1f%%\n",
                         Human(f.pool_capacity_bytes()), Human(f.pool_used_bytes()),
                         Human(f.pool_peak_bytes()), 100.0 * f.pool_fragmentation());
  out << absl::StrFormat("buffers %d, attachments %d, jobs %d, operations in flight %d\n",
                         f.buffers(), f.attachments(), f.jobs(), f.operations_in_flight());
  out << absl::StrFormat("operations run %d, staging bytes %sB\n", f.operations(),
                         Human(f.staging_bytes()));
  for (const auto& k : f.operations_by_kind()) {
    out << absl::StrFormat("  %-24s %d\n", k.kind(), k.count());
  }
  return kExitOk;
}

int RunJobWhy(const Online& o, const std::string& id, std::ostream& out, std::ostream& err) {
  auto client = Connect(o);
  if (!client.ok()) return Fail(err, client.status());
  auto job = (*client)->GetJob(id);
  if (!job.ok()) return Fail(err, job.status());
  auto ranks = (*client)->ListRanks(id);
  if (!ranks.ok()) return Fail(err, ranks.status());
  auto nodes = (*client)->ListNodes();
  if (!nodes.ok()) return Fail(err, nodes.status());
  std::map<std::string, const v1::Node*> by_id;
  std::map<int64_t, const v1::RankProgress*> progress;
  for (const auto& n : *nodes) {
    by_id[n.node_id()] = &n;
    for (const auto& r : n.figures().ranks()) {
      if (r.job_id() == id) progress[r.rank()] = &r;
    }
  }
  if (o.json) {
    std::vector<std::string> ranks;
    ranks.reserve(progress.size());
    for (const auto& [rank, p] : progress) ranks.push_back(ToJson(*p));
    out << "{\"job\": " << ToJson(*job) << ", \"ranks\": [" << absl::StrJoin(ranks, ", ") << "]}\n";
    return kExitOk;
  }
  const int64_t now = NowMs();
  out << "job " << id << ": " << StatusName(job->status())
      << (job->error().empty() ? "" : absl::StrCat(" (", job->error(), ")")) << "\n"
      << ShrinkLines(*job) << RedundancyLines(*job) << RecoveryLines(*job, NodesOf(*ranks), now)
      << StepLines(*job, progress);
  out << absl::StrFormat("%-5s %-16s %-12s %-36s %-36s %8s  %s\n", "RANK", "NODE", "HEARD",
                         "LAST DONE", "PENDING", "FOR", "WAITING ON");
  for (const auto& r : *ranks) {
    const auto n = by_id.find(r.node_id());
    std::string heard = "never";
    if (n != by_id.end()) {
      heard = absl::StrFormat("%s %.1fs", n->second->status() == v1::NODE_UP ? "UP" : "LOST",
                              (now - n->second->last_heartbeat_unix_ms()) / 1000.0);
    }
    const auto p = progress.find(r.rank());
    if (p == progress.end()) {
      out << absl::StrFormat("%-5d %-16s %-12s %s\n", r.rank(), r.node_id(), heard,
                             r.node_id().empty()
                                 ? "not registered"
                                 : "its daemon reports no such rank (not attached)");
      continue;
    }
    const v1::RankProgress& g = *p->second;
    const std::string done =
        g.done_seq() == 0 ? "-" : absl::StrCat("#", g.done_seq(), " ", g.done());
    const std::string pending = g.pending_seq() == 0
                                    ? "- (between operations)"
                                    : absl::StrCat("#", g.pending_seq(), " ", g.pending());
    out << absl::StrFormat(
        "%-5d %-16s %-12s %-36s %-36s %8s  %s\n", r.rank(), r.node_id(), heard, done, pending,
        g.pending_seq() == 0 ? "" : absl::StrFormat("%.1fs", g.pending_ms() / 1000.0),
        g.waiting_on());
  }
  return kExitOk;
}

}  // namespace ragshard
