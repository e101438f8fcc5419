#include "client/ctl.h"

#include <cstdio>
#include <cstdlib>
#include <iomanip>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/ctl_checkpoint.h"
#include "client/ctl_format.h"
#include "client/ctl_strategy.h"
#include "common/dtype.h"
#include "common/inventory.h"
#include "common/models.h"
#include "common/plan_json.h"
#include "common/planner.h"
#include "common/planner_client.h"
#include "common/proto_text.h"
#include "common/strategy.h"

namespace ragshard {
namespace {

constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;
constexpr int kExitBadInput = 2;

struct Source {
  std::string model;
  std::string inventory;
  int64_t world = 0;
  std::string granule;
  int64_t align_bytes = 16;
};

void AddSourceFlags(CLI::App* cmd, Source* src) {
  auto* model = cmd->add_option(
      "--model", src->model, "zoo model (llama3-8b, deepseek-v3, ...; NAME:grouped, NAME:fused)");
  auto* inv = cmd->add_option("--inventory", src->inventory, "inventory JSON file");
  model->excludes(inv);
  cmd->add_option("--world", src->world, "world size W (1..1048576)");
  cmd->add_option("--granule", src->granule,
                  "granule for every tensor of 2+ dimensions: element, rows:K or whole");
  cmd->add_option("--align-bytes", src->align_bytes, "alignment in bytes (16; 1 turns it off)");
}

// Loads the inventory and options; on failure writes the error and returns the exit code.
std::optional<int> Prepare(const Source& src, Inventory* inventory, PlanOptions* options,
                           std::ostream& err) {
  auto fail = [&](const absl::Status& s) {
    err << "error: " << s.message() << "\n";
    return kExitBadInput;
  };
  if (src.model.empty() == src.inventory.empty()) {
    return fail(absl::InvalidArgumentError("give exactly one of --model and --inventory"));
  }
  if (src.world < 1 || src.world > kMaxWorld) {
    return fail(absl::InvalidArgumentError(
        absl::StrCat("--world: must be in [1, ", kMaxWorld, "], got ", src.world)));
  }
  if (src.align_bytes < 1 || src.align_bytes > 4096) {
    return fail(absl::InvalidArgumentError(
        absl::StrCat("--align-bytes: must be in [1, 4096], got ", src.align_bytes)));
  }
  auto inv = src.model.empty() ? LoadInventoryFile(src.inventory) : GenerateModel(src.model);
  if (!inv.ok()) {
    return fail(absl::Status(
        inv.status().code(),
        absl::StrCat(src.model.empty() ? "--inventory " : "--model: ", inv.status().message())));
  }
  *inventory = std::move(*inv);
  if (!src.granule.empty()) {
    auto g = ParseGranule(src.granule);
    if (!g.ok()) return fail(absl::InvalidArgumentError(absl::StrCat("--", g.status().message())));
    ApplyGranule(inventory, *g);
  }
  options->world = src.world;
  options->align_bytes = static_cast<int32_t>(src.align_bytes);
  return std::nullopt;
}

double Pct(int64_t part, int64_t whole) {
  return whole > 0 ? 100.0 * static_cast<double>(part) / static_cast<double>(whole) : 0.0;
}

void PrintPlanTable(const PolicyResult& r, std::ostream& out) {
  const v1::LayoutMetrics& m = r.metrics;
  out << absl::StrFormat("policy %s\n", PolicyName(r.policy));
  if (r.plan) {
    out << absl::StrFormat("%-22s %-6s %8s %14s %10s %10s %9s %9s\n", "unit", "dtype", "tensors",
                           "shard_elems", "padding%", "imbalance", "blk128", "LB2gap%");
    for (const v1::UnitPlan& up : r.plan->units()) {
      const auto& um = up.metrics();
      out << absl::StrFormat("%-22s %-6s %8d %14d %10.3f %10.3f %9d %9.3f\n", up.unit(),
                             DTypeName(up.dtype()), up.tensors_size(), up.shard_elems(),
                             um.padding_pct(), um.imbalance(), um.blocks128_split(),
                             um.lb2_gap_pct());
    }
  } else {
    out << absl::StrFormat("%-22s %-6s %14s %8s\n", "group", "dtype", "per_rank_elems", "tensors");
    for (const GroupLayout& g : r.layout.groups) {
      out << absl::StrFormat("%-22s %-6s %14d %8d\n", g.name, DTypeName(g.dtype), g.per_rank_elems,
                             g.tensors.size());
    }
  }
  out << absl::StrFormat(
      "total: %s elements, padding %s (%.3f%%), imbalance %.4f, 128x128 blocks split %d/%d "
      "(%.2f%%), 32x32 blocks split %d/%d (%.2f%%), matrices split %d/%d, copy %s B/step/rank, "
      "gap to LB1 %.3f%%, gap to LB2 %.3f%%",
      Human(m.total_elems()), Human(m.padding_elems()), m.padding_pct(), m.imbalance(),
      m.blocks128_split(), m.blocks128_total(), Pct(m.blocks128_split(), m.blocks128_total()),
      m.blocks32_split(), m.blocks32_total(), Pct(m.blocks32_split(), m.blocks32_total()),
      m.matrices_split(), m.matrices_total(), Human(m.copy_bytes_per_step()), m.lb1_gap_pct(),
      m.lb2_gap_pct());
  if (m.owner_load_max_over_mean() > 0) {
    out << absl::StrFormat(", owner load max/mean %.3f (locality %.1f%%)",
                           m.owner_load_max_over_mean(), 100.0 * m.owner_locality());
  }
  out << absl::StrFormat("\nplan time %.3f s\n", r.plan_seconds);
}

int RunPlan(const Source& src, const std::string& policy, bool as_json, int64_t max_segments,
            std::ostream& out, std::ostream& err) {
  Inventory inventory;
  PlanOptions options;
  if (auto rc = Prepare(src, &inventory, &options, err)) return *rc;
  auto p = ParsePolicy(policy);
  if (!p.ok()) {
    err << "error: --policy: " << p.status().message() << "\n";
    return kExitBadInput;
  }
  options.policy = *p;
  auto result = RunPolicy(inventory, options);
  if (!result.ok()) {
    err << "error: " << result.status().message() << "\n";
    return absl::IsInvalidArgument(result.status()) || absl::IsOutOfRange(result.status())
               ? kExitBadInput
               : kExitFailure;
  }
  if (as_json) {
    out << PolicyResultToJson(*result, max_segments).dump(1) << "\n";
  } else {
    PrintPlanTable(*result, out);
  }
  return kExitOk;
}

int RunCompare(const Source& src, bool as_json, std::ostream& out, std::ostream& err) {
  Inventory inventory;
  PlanOptions options;
  if (auto rc = Prepare(src, &inventory, &options, err)) return *rc;
  nlohmann::json rows = nlohmann::json::array();
  if (!as_json) {
    out << absl::StrFormat("%s, W=%d, granule %s, align %d B\n",
                           src.model.empty() ? src.inventory : src.model, src.world,
                           src.granule.empty() ? "element" : src.granule, src.align_bytes);
    out << absl::StrFormat("%-14s %10s %10s %10s %10s %12s %14s %10s %10s %9s\n", "policy",
                           "padding%", "imbalance", "blk128%", "blk32%", "mat_split", "copy_B/step",
                           "LB1gap%", "LB2gap%", "plan_s");
  }
  for (Policy policy : AllPolicies()) {
    options.policy = policy;
    auto r = RunPolicy(inventory, options);
    if (!r.ok()) {
      err << "error: policy " << PolicyName(policy) << ": " << r.status().message() << "\n";
      return kExitFailure;
    }
    const v1::LayoutMetrics& m = r->metrics;
    if (as_json) {
      rows.push_back({{"policy", std::string(PolicyName(policy))},
                      {"metrics", MetricsToJson(m)},
                      {"timing", {{"plan_seconds", r->plan_seconds}}}});
    } else {
      out << absl::StrFormat(
          "%-14s %10.3f %10.4f %10.3f %10.3f %12s %14s %10.3f %10.3f %9.3f\n", PolicyName(policy),
          m.padding_pct(), m.imbalance(), Pct(m.blocks128_split(), m.blocks128_total()),
          Pct(m.blocks32_split(), m.blocks32_total()),
          absl::StrCat(m.matrices_split(), "/", m.matrices_total()), Human(m.copy_bytes_per_step()),
          m.lb1_gap_pct(), m.lb2_gap_pct(), r->plan_seconds);
    }
  }
  if (as_json) out << nlohmann::json{{"world", src.world}, {"policies", rows}}.dump(1) << "\n";
  return kExitOk;
}

struct Online {
  std::string planner;
  ClientSecurityOptions security;
  bool json = false;
  double retry_s = 5;  // a planner restart is ridden through for this long
};

PlannerClientOptions ClientOptions(const Online& o) {
  PlannerClientOptions opts;
  opts.address = o.planner;
  opts.security = o.security;
  opts.rpc_timeout = std::chrono::milliseconds(10000);
  opts.retry_window = std::chrono::milliseconds(static_cast<int64_t>(o.retry_s * 1000));
  return opts;
}

void AddOnlineFlags(CLI::App* app, Online* o) {
  const char* env = std::getenv("RAGSHARD_PLANNER");
  o->planner = env != nullptr ? env : "127.0.0.1:7070";
  app->add_option("--planner", o->planner, "planner address HOST:PORT (env RAGSHARD_PLANNER)");
  if (const char* t = std::getenv("RAGSHARD_TOKEN_FILE"); t != nullptr) o->security.token_file = t;
  app->add_option("--token-file", o->security.token_file,
                  "bearer token file (env RAGSHARD_TOKEN_FILE)");
  app->add_option("--tls-ca", o->security.tls_ca_file,
                  "CA of the planner's certificate (enables TLS)");
  app->add_option("--tls-cert", o->security.tls_cert_file, "client certificate (mutual TLS)");
  app->add_option("--tls-key", o->security.tls_key_file, "client key (mutual TLS)");
  app->add_option("--tls-server-name", o->security.tls_server_name,
                  "name to check in the planner's certificate");
  app->add_option("--retry-s", o->retry_s,
                  "seconds to keep retrying a planner that is unavailable (restarting)")
      ->check(CLI::Range(0.0, 3600.0))
      ->capture_default_str();
}

std::string OneLine(absl::string_view msg) {
  std::string out(msg);
  for (char& c : out) {
    if (c == '\n') c = ' ';
  }
  return out;
}

int Fail(std::ostream& err, const absl::Status& s) {
  err << "error: " << OneLine(s.message()) << "\n";
  return absl::IsInvalidArgument(s) ? kExitBadInput : kExitFailure;
}

std::string ToJson(const google::protobuf::Message& m) { return ProtoJson(m, false, true); }

std::string StatusName(v1::JobStatus s) {
  std::string n = v1::JobStatus_Name(s);
  return n.rfind("JOB_", 0) == 0 ? n.substr(4) : n;
}

int Registered(const v1::Job& job) {
  int n = 0;
  for (const auto& r : job.ranks()) n += r.registered() ? 1 : 0;
  return n;
}

int RunOnline(const std::string& command, const Online& o, const std::string& id,
              const std::string& unit, std::ostream& out, std::ostream& err) {
  const PlannerClientOptions opts = ClientOptions(o);
  auto client_or = GrpcPlannerClient::Create(opts);
  if (!client_or.ok()) return Fail(err, client_or.status());
  PlannerClient& client = **client_or;
  if (command == "health") {
    absl::Status s = client.Health();
    if (!s.ok()) return Fail(err, s);
    out << (o.json ? "{\"status\": \"SERVING\"}" : "SERVING") << "\n";
    return kExitOk;
  }
  if (command == "jobs") {
    auto jobs = client.ListJobs();
    if (!jobs.ok()) return Fail(err, jobs.status());
    if (o.json) {
      v1::ListJobsResponse resp;
      for (auto& j : *jobs) *resp.add_jobs() = j;
      out << ToJson(resp) << "\n";
      return kExitOk;
    }
    out << absl::StrFormat("%-24s %-12s %12s %-13s %11s %5s  %s\n", "JOB", "STATUS", "WORLD",
                           "POLICY", "REGISTERED", "PLAN", "ERROR");
    for (const auto& j : *jobs) {
      out << absl::StrFormat(
          "%-24s %-12s %12s %-13s %11s %5s  %s\n", j.job_id(), StatusName(j.status()),
          absl::StrCat(j.mesh().replicate_size(), "x", j.mesh().shard_size()), j.options().policy(),
          absl::StrCat(Registered(j), "/", j.world_size()),
          j.plan_version() ? absl::StrCat("v", j.plan_version()) : "-", OneLine(j.error()));
    }
    return kExitOk;
  }
  if (command == "job show") {
    auto job = client.GetJob(id);
    if (!job.ok()) return Fail(err, job.status());
    if (o.json) {
      out << ToJson(*job) << "\n";
      return kExitOk;
    }
    const v1::Job& j = *job;
    out << "job:          " << j.job_id() << "\n"
        << "status:       " << StatusName(j.status()) << "\n"
        << "mesh:         " << j.mesh().replicate_size() << " replica(s) x "
        << j.mesh().shard_size() << " ranks (world " << j.world_size() << ")\n"
        << "policy:       " << j.options().policy() << ", align " << j.options().align_bytes()
        << " B" << (j.options().default_granule().empty() ? "" : ", granule ")
        << j.options().default_granule() << "\n"
        << "registered:   " << Registered(j) << "/" << j.world_size() << "\n"
        << "inventory:    "
        << (j.inventory_sha256().empty() ? "-" : HexString(j.inventory_sha256())) << "\n"
        << "plan version: " << j.plan_version() << "\n"
        << "error:        " << (j.error().empty() ? "-" : OneLine(j.error())) << "\n";
    std::map<std::string, int> per_node;
    for (const auto& r : j.ranks()) {
      if (r.registered()) ++per_node[r.node_id()];
    }
    for (const auto& [node, n] : per_node) out << "node " << node << ": " << n << " rank(s)\n";
    return kExitOk;
  }
  // plan show / plan metrics
  auto plan = client.GetPlan(id);
  if (!plan.ok()) return Fail(err, plan.status());
  if (command == "plan metrics") {
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
    out << absl::StrFormat("unit %s (%s), shard_elems %d\n", up->unit(), DTypeName(up->dtype()),
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
    out << ToJson(*plan) << "\n";
    return kExitOk;
  }
  PolicyResult r;
  r.policy = *ParsePolicy(plan->policy());
  r.metrics = plan->metrics();
  r.plan = *plan;
  out << "job " << id << ", plan v" << plan->version() << ", W=" << plan->world_size() << "\n";
  if (plan->has_strategy()) {
    const v1::PlanStrategy& st = plan->strategy();
    out << absl::StrFormat(
        "strategy %s (%s; recommended with separate factors: %s), predicted %.4f s/step, %s "
        "per device, padding %.3f%%\n",
        st.executed(), st.reason(), st.recommended(), st.predicted_step_seconds(),
        FormatBytes(st.predicted_memory_bytes()), st.predicted_padding_pct());
  }
  PrintPlanTable(r, out);
  return kExitOk;
}

int RunNodes(const Online& o, std::ostream& out, std::ostream& err) {
  const PlannerClientOptions opts = ClientOptions(o);
  auto client = GrpcPlannerClient::Create(opts);
  if (!client.ok()) return Fail(err, client.status());
  auto nodes = (*client)->ListNodes();
  if (!nodes.ok()) return Fail(err, nodes.status());
  if (o.json) {
    v1::ListNodesResponse resp;
    for (auto& n : *nodes) *resp.add_nodes() = n;
    out << ToJson(resp) << "\n";
    return kExitOk;
  }
  const int64_t now = std::chrono::duration_cast<std::chrono::milliseconds>(
                          std::chrono::system_clock::now().time_since_epoch())
                          .count();
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

}  // namespace

int RunCtl(int argc, const char* const* argv, std::ostream& out, std::ostream& err) {
  CLI::App app{"ragshardctl: the ragshard admin CLI"};
  app.require_subcommand(1);
  Source plan_src, cmp_src;
  std::string policy = "ragged";
  bool plan_json = false, cmp_json = false;
  int64_t max_segments = 200000;

  CLI::App* plan = app.add_subcommand("plan", "plan a model offline and print its figures");
  AddSourceFlags(plan, &plan_src);
  plan->add_option("--policy", policy,
                   "ragged, ragged-paper, fsdp2, fsdp1, zero3, megatron-do or megatron-fsdp");
  plan->add_flag("--json", plan_json, "print the plan (or baseline segments) as JSON");
  plan->add_option("--max-segments", max_segments,
                   "baselines: print segment lists only when there are at most this many");

  CLI::App* cmp = app.add_subcommand("compare", "compare every policy side by side");
  AddSourceFlags(cmp, &cmp_src);
  cmp->add_flag("--json", cmp_json, "print JSON");

  StrategyFlags advise_flags, simulate_flags;
  CLI::App* advise = app.add_subcommand(
      "advise", "search sharding strategies (factors, unit grouping, HSDP) for a model");
  AddAdviseFlags(advise, &advise_flags);
  CLI::App* simulate =
      app.add_subcommand("simulate", "cost one strategy: per-unit breakdown and a timeline");
  AddSimulateFlags(simulate, &simulate_flags);

  // Commands that talk to a planner; their flags are global.
  Online online;
  AddOnlineFlags(&app, &online);
  std::string job_id, unit;
  auto add_online = [&](CLI::App* parent, const std::string& name, const std::string& help,
                        bool with_id) {
    CLI::App* c = parent->add_subcommand(name, help);
    c->fallthrough();  // --planner and the security flags may come before or after the command
    c->add_flag("--json", online.json, "print JSON");
    if (with_id) c->add_option("ID", job_id, "job id")->required();
    return c;
  };
  CLI::App* jobs = add_online(&app, "jobs", "list jobs", false);
  CLI::App* job = app.add_subcommand("job", "create, show or delete a job");
  job->require_subcommand(1);
  job->fallthrough();
  CLI::App* job_show = add_online(job, "show", "show one job", true);
  v1::CreateJobRequest create;
  int64_t shard = 0, replicate = 1, align = 0, reg_timeout = 0;
  std::string job_policy, job_granule;
  CLI::App* job_create = add_online(job, "create", "create a job", true);
  job_create->add_option("--shard", shard, "ranks per shard group")->required();
  job_create->add_option("--replicate", replicate, "replicas of the shard group (HSDP)");
  job_create->add_option("--policy", job_policy, "ragged (default), ragged-paper or auto");
  job_create->add_option("--granule", job_granule, "default granule of 2-D+ tensors");
  job_create->add_option("--align-bytes", align, "alignment in bytes (default 16)");
  job_create->add_option("--registration-timeout-ms", reg_timeout, "registration deadline");
  std::string job_strategy, job_optimizer, job_budget;
  int64_t job_tokens = 0;
  job_create->add_option("--strategy", job_strategy,
                         "policy auto: use k=K,shard=AxB instead of searching");
  job_create->add_option("--memory-budget", job_budget, "policy auto: bytes per device (80GiB)");
  job_create->add_option("--optimizer", job_optimizer, "policy auto: adam or muon");
  job_create->add_option("--tokens-per-step", job_tokens, "policy auto: global batch in tokens");
  CLI::App* job_delete = add_online(job, "delete", "delete a job (admin token)", true);
  plan->require_subcommand(0, 1);
  plan->fallthrough();
  CLI::App* plan_show = add_online(plan, "show", "show a job's stored plan", true);
  plan_show->add_option("--unit", unit, "show the tensors of one unit");
  CLI::App* plan_metrics = add_online(plan, "metrics", "show a job's plan metrics", true);
  CLI::App* nodes = add_online(&app, "nodes", "list nodes with their pool figures", false);
  CLI::App* ckpt = app.add_subcommand("checkpoint", "inspect a checkpoint (offline)");
  ckpt->require_subcommand(1);
  std::string ckpt_dir;
  bool ckpt_json = false;
  CLI::App* ckpt_inspect = ckpt->add_subcommand(
      "inspect", "a checkpoint's tensors, the plan it came from, and its integrity");
  ckpt_inspect->add_option("DIR", ckpt_dir, "checkpoint root (its latest) or one checkpoint")
      ->required();
  ckpt_inspect->add_flag("--json", ckpt_json, "print JSON");
  CLI::App* health = add_online(&app, "health", "check the planner's health service", false);

  if (argc > 1 && argv[1][0] != '-') {
    auto known = app.get_subcommands([&](CLI::App* sub) { return sub->check_name(argv[1]); });
    if (known.empty()) {
      err << "error: unknown command '" << argv[1] << "' (run ragshardctl --help for the list)\n";
      return kExitBadInput;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    out << app.help();
    return kExitOk;
  } catch (const CLI::CallForAllHelp&) {
    out << app.help("", CLI::AppFormatMode::All);
    return kExitOk;
  } catch (const CLI::ParseError& e) {
    std::string msg = e.what();
    for (char& c : msg) {
      if (c == '\n') c = ' ';
    }
    err << "error: " << msg << "\n";
    return kExitBadInput;
  }
  if (jobs->parsed()) return RunOnline("jobs", online, "", "", out, err);
  if (job_show->parsed()) return RunOnline("job show", online, job_id, "", out, err);
  if (job_create->parsed() || job_delete->parsed()) {
    const PlannerClientOptions opts = ClientOptions(online);
    auto client = GrpcPlannerClient::Create(opts);
    if (!client.ok()) return Fail(err, client.status());
    if (job_delete->parsed()) {
      absl::Status s = (*client)->DeleteJob(job_id);
      if (!s.ok()) return Fail(err, s);
      out << "job " << job_id << " deleted\n";
      return kExitOk;
    }
    create.set_job_id(job_id);
    create.mutable_mesh()->set_shard_size(shard);
    create.mutable_mesh()->set_replicate_size(replicate);
    create.mutable_options()->set_policy(job_policy);
    create.mutable_options()->set_default_granule(job_granule);
    create.mutable_options()->set_align_bytes(static_cast<int32_t>(align));
    create.mutable_options()->set_registration_timeout_ms(reg_timeout);
    create.mutable_options()->set_strategy(job_strategy);
    create.mutable_options()->set_optimizer(job_optimizer);
    create.mutable_options()->set_tokens_per_step(job_tokens);
    if (!job_budget.empty()) {
      int64_t b = 0;
      if (!ParseByteSize(job_budget, &b)) {
        err << "error: --memory-budget: '" << job_budget << "' is not a byte count\n";
        return kExitBadInput;
      }
      create.mutable_options()->set_memory_budget_bytes(b);
    }
    auto created = (*client)->CreateJob(create);
    if (!created.ok()) return Fail(err, created.status());
    out << (online.json ? ToJson(*created) : absl::StrCat("job ", job_id, " created")) << "\n";
    return kExitOk;
  }
  if (plan_show->parsed()) return RunOnline("plan show", online, job_id, unit, out, err);
  if (plan_metrics->parsed()) return RunOnline("plan metrics", online, job_id, "", out, err);
  if (nodes->parsed()) return RunNodes(online, out, err);
  if (ckpt_inspect->parsed()) return RunCheckpointInspect(ckpt_dir, ckpt_json, out, err);
  if (health->parsed()) return RunOnline("health", online, "", "", out, err);
  if (plan->parsed()) return RunPlan(plan_src, policy, plan_json, max_segments, out, err);
  if (cmp->parsed()) return RunCompare(cmp_src, cmp_json, out, err);
  if (advise->parsed()) return RunAdvise(advise_flags, out, err);
  if (simulate->parsed()) return RunSimulate(simulate_flags, out, err);
  err << "error: no command\n";
  return kExitBadInput;
}

}  // namespace ragshard
