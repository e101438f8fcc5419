#include "ctl/ctl.h"

#include <string>

#include "CLI/CLI.hpp"
#include "ctl/ctl_checkpoint.h"
#include "ctl/ctl_format.h"
#include "ctl/ctl_offline.h"
#include "ctl/ctl_online.h"
#include "ctl/ctl_strategy.h"

namespace ragshard {

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
  std::string job_id, unit, factor = "p";
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
  JobSpec spec;
  JobCreateFlags create_flags;
  CLI::App* job_create = add_online(job, "create", "create a job", true);
  job_create->add_option("--shard", spec.shard_size, "ranks per shard group")->required();
  job_create->add_option("--replicate", spec.replicate_size, "replicas of the shard group (HSDP)");
  job_create->add_option("--policy", spec.policy, "ragged (default), ragged-paper or auto");
  job_create->add_option("--granule", spec.default_granule, "default granule of 2-D+ tensors");
  job_create->add_option("--align-bytes", spec.align_bytes, "alignment in bytes (default 16)");
  job_create->add_option("--registration-timeout-ms", spec.registration_timeout_ms,
                         "registration deadline");
  job_create->add_option("--strategy", spec.strategy,
                         "policy auto: use k=K,shard=AxB instead of searching");
  job_create->add_option("--memory-budget", create_flags.memory_budget,
                         "policy auto: bytes per device (80GiB)");
  job_create->add_option("--recovery-deadline", create_flags.recovery_deadline,
                         "SECONDS: a lost rank is recovered in place if every node's ranks "
                         "re-attach within this long (0 or absent: a lost rank degrades the job)");
  job_create->add_option("--redundancy", create_flags.redundancy,
                         "parity:K, replica, hsdp or none: a lost node is rebuilt on a "
                         "replacement daemon with its node id (needs --recovery-deadline); "
                         "parity:K needs a multiple of K+1 nodes, replica at least 2, hsdp "
                         "--replicate 2 or more (its default there, where the replicas are on "
                         "other nodes; else none)");
  job_create
      ->add_option("--on-node-loss", spec.on_node_loss,
                   "fail (default) or shrink: a lost node without a replacement within the "
                   "recovery deadline shrinks the job to its surviving HSDP replica groups "
                   "(needs --recovery-deadline; docs/recovery.md)")
      ->check(CLI::IsMember({"fail", "shrink"}));
  job_create->add_option("--optimizer", spec.optimizer, "policy auto: adam or muon");
  job_create->add_option("--tokens-per-step", spec.tokens_per_step,
                         "policy auto: global batch in tokens");
  CLI::App* job_delete = add_online(job, "delete", "delete a job (admin token)", true);
  CLI::App* job_why = add_online(
      job, "why", "where each rank stands: last done, pending, and what it waits on", true);
  plan->require_subcommand(0, 1);
  plan->fallthrough();
  CLI::App* plan_show = add_online(plan, "show", "show a job's stored plan", true);
  plan_show->add_option("--unit", unit, "show the tensors of one unit");
  plan_show
      ->add_option("--factor", factor,
                   "the factor's plan to show: p (parameters, default), g (gradients) or os "
                   "(optimizer state); they differ under AMSP strategies")
      ->check(CLI::IsMember({"p", "g", "os"}));
  CLI::App* plan_metrics = add_online(plan, "metrics", "show a job's plan metrics", true);
  CLI::App* nodes = add_online(&app, "nodes", "list nodes with their pool figures", false);
  CLI::App* node = app.add_subcommand("node", "one node");
  node->require_subcommand(1);
  node->fallthrough();
  std::string node_id;
  CLI::App* node_stats = add_online(
      node, "stats", "a node daemon's figures, from its latest heartbeat to the planner", false);
  node_stats->add_option("NODE", node_id, "node id")->required();
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
  if (jobs->parsed()) return RunJobs(online, out, err);
  if (job_show->parsed()) return RunJobShow(online, job_id, out, err);
  if (job_delete->parsed()) return RunJobDelete(online, job_id, out, err);
  if (job_why->parsed()) return RunJobWhy(online, job_id, out, err);
  if (job_create->parsed()) {
    spec.job_id = job_id;
    return RunJobCreate(online, spec, create_flags, out, err);
  }
  if (plan_show->parsed()) return RunPlanShow(online, job_id, unit, factor, out, err);
  if (plan_metrics->parsed()) return RunPlanMetrics(online, job_id, out, err);
  if (nodes->parsed()) return RunNodes(online, out, err);
  if (node_stats->parsed()) return RunNodeStats(online, node_id, out, err);
  if (ckpt_inspect->parsed()) return RunCheckpointInspect(ckpt_dir, ckpt_json, out, err);
  if (health->parsed()) return RunHealth(online, out, err);
  if (plan->parsed()) return RunPlan(plan_src, policy, plan_json, max_segments, out, err);
  if (cmp->parsed()) return RunCompare(cmp_src, cmp_json, out, err);
  if (advise->parsed()) return RunAdvise(advise_flags, out, err);
  if (simulate->parsed()) return RunSimulate(simulate_flags, out, err);
  err << "error: no command\n";
  return kExitBadInput;
}

}  // namespace ragshard
