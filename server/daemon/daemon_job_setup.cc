// NodeDaemon's job setup: the first rank of a job on this node to attach sets the job up (its
// plan, its UCX worker and peers, its data plane); the node's other ranks wait for it.
#include <algorithm>
#include <optional>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "infra/secrets.h"
#include "infra/status_macros.h"
#include "server/daemon/daemon.h"
#include "server/daemon/job_runtime.h"
#include "server/daemon/ucx_comm.h"

namespace ragshard::daemon {

namespace {

std::string HostOf(const std::string& address) { return address.substr(0, address.rfind(':')); }

}  // namespace

absl::StatusOr<std::shared_ptr<JobRuntime>> NodeDaemon::GetOrCreateJob(const std::string& job_id,
                                                                       int64_t rank,
                                                                       absl::Time deadline) {
  // One setup per job at a time, and jobs independently: a job waiting for its plan or for its
  // peers' addresses holds only its own setup lock.
  std::shared_ptr<absl::Mutex> setup;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job_id);
    if (it != jobs_.end()) return it->second;
    std::shared_ptr<absl::Mutex>& slot = job_setups_[job_id];
    if (slot == nullptr) slot = std::make_shared<absl::Mutex>();
    setup = slot;
  }
  absl::StatusOr<std::shared_ptr<JobRuntime>> job;
  {
    absl::MutexLock job_setup(setup.get());
    job = SetUpJob(job_id, rank, deadline);
  }
  absl::MutexLock lock(&mu_);
  auto it = job_setups_.find(job_id);
  // Dropped once no other attach holds it: the job is set up (later attaches find it), or its
  // setup failed and nobody waits to try again.
  if (it != job_setups_.end() && it->second == setup && setup.use_count() == 2) {
    job_setups_.erase(it);
  }
  return job;
}

absl::StatusOr<std::shared_ptr<JobRuntime>> NodeDaemon::SetUpJob(const std::string& job_id,
                                                                 int64_t rank,
                                                                 absl::Time deadline) {
  // Set up by the attach this one waited for.
  if (std::shared_ptr<JobRuntime> held = FindJob(job_id); held != nullptr) return held;
  auto plan = planner_->WaitForPlan(job_id, absl::ToChronoMilliseconds(deadline - absl::Now()));
  if (!plan.ok()) return plan.status();
  auto job = planner_->GetJob(job_id);
  if (!job.ok()) return job.status();
  if (job->status() == v1::JOB_SHRUNK) {
    // Never set up again (its buffers would be zeros, and a salvage attach would read them): its
    // survivors went on in the successor (docs/recovery.md, "Shrinking in place").
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", job_id, "' shrank to job '", job->successor_job_id(),
        "', and this daemon holds none of its state (released once its survivors took it over): "
        "rank ",
        rank, " goes on there or leaves"));
  }
  // The job's nodes with their ranks as runs: O(nodes), whatever the ranks per node.
  auto job_nodes = planner_->ListJobNodes(job_id);
  if (!job_nodes.ok()) return job_nodes.status();
  const std::vector<std::string> nodes(job_nodes->node_ids().begin(), job_nodes->node_ids().end());
  std::vector<int64_t> local;
  for (int i = 0; i < job_nodes->run_node_size(); ++i) {
    if (nodes[static_cast<size_t>(job_nodes->run_node(i))] != options_.node_id) continue;
    for (int64_t r = 0; r < job_nodes->run_count(i); ++r) {
      local.push_back(job_nodes->run_first(i) + r);
    }
  }
  if (std::find(local.begin(), local.end(), rank) == local.end()) {
    return absl::FailedPreconditionError(absl::StrCat("rank ", rank, " of job '", job_id,
                                                      "' is not on node '", options_.node_id, "'"));
  }
  if (local.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("job '", job_id, "' has no ranks on node '", options_.node_id, "'"));
  }
  auto redundancy = ParseRedundancy("redundancy", job->options().redundancy());
  if (!redundancy.ok()) return redundancy.status();
  RAGSHARD_RETURN_IF_ERROR(CheckRedundancyNodes(*redundancy, static_cast<int64_t>(nodes.size())));
  RedundancyScheme scheme = SchemeOf(*redundancy);
  if (scheme.hsdp) {
    // Node i holds ranks [i * k, (i + 1) * k) (NodeMesh): each rank needs a replica elsewhere.
    scheme.shard_ranks = job->mesh().shard_size();
    std::vector<std::string> rank_nodes;
    for (const std::string& n : nodes) rank_nodes.insert(rank_nodes.end(), local.size(), n);
    RAGSHARD_RETURN_IF_ERROR(CheckHsdpLayout(scheme.shard_ranks, rank_nodes));
  }
  int me = 0;
  for (size_t i = 0; i < nodes.size(); ++i) {
    if (nodes[i] == options_.node_id) me = static_cast<int>(i);
  }
  // A daemon setting up a job whose node it never had, while the job recovers (or before the
  // other nodes noticed that this node's daemon was lost), replaces the lost one: its ranks'
  // state is rebuilt from the job's redundancy.
  bool replacement = false;
  if (scheme.enabled()) {
    auto recovering = AwaitReplacementEpoch(*job, deadline);
    if (!recovering.ok()) return recovering.status();
    replacement = recovering->has_value();
    if (replacement) *job = **recovering;
  }
  std::unique_ptr<RelayComm> relay;
  if (nodes.size() > 1) {
    auto connected = ConnectNodes(job_id, nodes, job->recovery_epoch(), deadline);
    if (!connected.ok()) return connected.status();
    relay = std::make_unique<RelayComm>(std::move(connected->first), std::move(connected->second));
  }
  BackendContext context;
  context.plan = &*plan;
  context.local_ranks = local;
  context.replicas = std::max<int64_t>(job->mesh().replicate_size(), 1);
  context.host_pool = pool_.get();
  context.nodes = relay.get();
  context.node_count = static_cast<int>(nodes.size());
  context.put = [this, &job_id](const std::string& key, const std::string& value) {
    return planner_->Put(job_id, key, value);
  };
  context.get = [this, &job_id, deadline](const std::string& key) {
    return planner_->Get(
        job_id, key,
        absl::ToChronoMilliseconds(std::max(deadline - absl::Now(), absl::Milliseconds(1))));
  };
  context.deadline = deadline;
  context.gpu_pool_bytes = options_.gpu_pool_bytes;
  auto dp = CreateDataBackend(backend_, context);
  if (!dp.ok()) return dp.status();
  RelayComm* relay_ptr = relay.get();
  auto runtime =
      std::make_shared<JobRuntime>(job_id, options_.node_id, std::move(*plan), local, nullptr,
                                   std::move(relay), std::move(*dp), planner_, metrics_);
  runtime->set_incarnation(incarnation_);
  runtime->set_fenced_with_node(job->options().recovery_deadline_ms() > 0 ||
                                job->options().on_node_loss() == "shrink");
  if (job->options().recovery_deadline_ms() > 0) {
    JobRuntime::Reconnect reconnect;
    if (relay_ptr != nullptr) {
      reconnect = [this, job_id, nodes](int64_t epoch, absl::Time until) {
        return ConnectNodes(job_id, nodes, epoch, until);
      };
    }
    runtime->EnableRecovery(job->recovery_epoch(),
                            absl::Milliseconds(job->options().recovery_deadline_ms()),
                            std::move(reconnect), relay_ptr);
    if (scheme.enabled()) {
      runtime->EnableRedundancy(scheme, job->options().redundancy(), me, nodes, replacement,
                                pool_.get());
    }
  }
  absl::MutexLock lock(&mu_);
  jobs_[job_id] = runtime;
  LOG(INFO) << "job " << job_id << ": " << local.size() << " local rank(s), " << nodes.size()
            << " node(s), " << runtime->dp().name() << " backend, buffers allocated";
  return runtime;
}

absl::StatusOr<std::optional<v1::Job>> NodeDaemon::AwaitReplacementEpoch(const v1::Job& job,
                                                                         absl::Time deadline) {
  auto key = [&](int64_t epoch) {
    return epoch > 0 ? absl::StrCat("data/epoch-", epoch, "/", options_.node_id)
                     : absl::StrCat("data/", options_.node_id);
  };
  if (job.status() != v1::JOB_RECOVERING) {
    // This node's data address in the job's epoch: published by a daemon of this node before,
    // so this one replaces it (else it is the node's first setup).
    auto before =
        planner_->Get(job.job_id(), key(job.recovery_epoch()), std::chrono::milliseconds(1));
    if (!before.ok()) return std::optional<v1::Job>();
  }
  // Until the job recovers in an epoch this node has not published in: the other nodes notice
  // the lost daemon at their next collective with it, or the planner at its node timeout.
  while (true) {
    auto now = planner_->GetJob(job.job_id());
    if (!now.ok()) return now.status();
    if (now->status() == v1::JOB_RECOVERING) {
      auto published =
          planner_->Get(job.job_id(), key(now->recovery_epoch()), std::chrono::milliseconds(1));
      if (!published.ok()) return std::optional<v1::Job>(*now);
    } else if (now->status() != v1::JOB_READY && now->status() != v1::JOB_REGISTERING) {
      return absl::FailedPreconditionError(
          absl::StrCat("node '", options_.node_id, "' replaces a lost node of job '", job.job_id(),
                       "', which is ", v1::JobStatus_Name(now->status()),
                       now->error().empty() ? "" : absl::StrCat(": ", now->error())));
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "node '", options_.node_id, "' replaces a lost node of job '", job.job_id(),
          "' (a daemon of this node had joined it), but the job did not start recovering "
          "before the attach's deadline"));
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
}

absl::StatusOr<std::pair<std::unique_ptr<UcxWorker>, std::unique_ptr<Comm>>>
NodeDaemon::ConnectNodes(const std::string& job_id, const std::vector<std::string>& nodes,
                         int64_t epoch, absl::Time deadline) {
  // The data port accepts only daemons that present the job's credential, derived from the
  // secret the planner hands its daemons over the authenticated control channel.
  auto secret = planner_->GetDataSecret(job_id);
  if (!secret.ok()) return secret.status();
  auto w = UcxWorker::Create(options_.data_host, 0, DataPlaneCredential(*secret, job_id),
                             options_.ucx_spin);
  if (!w.ok()) return w.status();
  std::unique_ptr<UcxWorker> worker = std::move(*w);
  worker->set_on_reject([metrics = metrics_](const absl::Status& why) { metrics->Error(why); });
  auto key = [epoch](const std::string& node) {
    return epoch > 0 ? absl::StrCat("data/epoch-", epoch, "/", node) : absl::StrCat("data/", node);
  };
  absl::Status s = planner_->Put(job_id, key(options_.node_id), worker->address());
  if (!s.ok()) return s;
  // Every node's address in one call: a rendezvous of N nodes costs the planner N calls.
  std::vector<std::string> keys;
  int me = 0;
  for (size_t i = 0; i < nodes.size(); ++i) {
    if (nodes[i] == options_.node_id) me = static_cast<int>(i);
    keys.push_back(key(nodes[i]));
  }
  auto addresses = planner_->GetKeys(
      job_id, keys,
      absl::ToChronoMilliseconds(std::max(deadline - absl::Now(), absl::Milliseconds(1))));
  if (!addresses.ok()) {
    return absl::Status(addresses.status().code(),
                        absl::StrCat("waiting for the job's nodes to publish their data "
                                     "addresses: ",
                                     addresses.status().message()));
  }
  std::set<std::string> hosts;
  for (const std::string& a : *addresses) hosts.insert(HostOf(a));
  worker->AllowPeerHosts(hosts);  // only the job's peers may connect
  auto c = worker->Connect(me, *addresses, deadline, job_id, nodes);
  if (!c.ok()) return c.status();
  return std::make_pair(std::move(worker), std::move(*c));
}

}  // namespace ragshard::daemon
