#include "server/planner/validation.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/planner.h"
#include "engine/redundancy.h"
#include "engine/strategy.h"
#include "infra/status_macros.h"

namespace ragshard::planner {
namespace {

absl::Status Bad(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

absl::Status CheckText(absl::string_view field, const std::string& value, int64_t max_len) {
  if (static_cast<int64_t>(value.size()) > max_len) {
    return Bad(field, absl::StrCat("longer than ", max_len, " bytes"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateJobId(const std::string& job_id, const ServiceLimits& limits) {
  return ValidateId("job_id", job_id, limits.max_id_length);
}

absl::Status ValidateListJobs(const v1::ListJobsRequest& req, const ServiceLimits& limits) {
  if (req.page_size() < 0 || req.page_size() > kMaxJobsPage) {
    return Bad("page_size",
               absl::StrCat("must be in [0, ", kMaxJobsPage, "], got ", req.page_size()));
  }
  if (req.page_token().empty()) return absl::OkStatus();
  return ValidateId("page_token", req.page_token(), limits.max_id_length);
}

absl::Status ValidateListRanks(const v1::ListRanksRequest& req, const ServiceLimits& limits) {
  RAGSHARD_RETURN_IF_ERROR(ValidateJobId(req.job_id(), limits));
  if (req.start_rank() < 0) {
    return Bad("start_rank", absl::StrCat("must be >= 0, got ", req.start_rank()));
  }
  if (req.page_size() < 0 || req.page_size() > kMaxRanksPage) {
    return Bad("page_size",
               absl::StrCat("must be in [0, ", kMaxRanksPage, "], got ", req.page_size()));
  }
  return absl::OkStatus();
}

absl::Status ValidateCreateJob(const v1::CreateJobRequest& req, const ServiceLimits& limits) {
  RAGSHARD_RETURN_IF_ERROR(ValidateJobId(req.job_id(), limits));
  const int64_t shard = req.mesh().shard_size(), rep = req.mesh().replicate_size();
  if (shard < 1 || shard > limits.max_world) {
    return Bad("mesh.shard_size",
               absl::StrCat("must be in [1, ", limits.max_world, "], got ", shard));
  }
  if (rep < 1 || rep > limits.max_world) {
    return Bad("mesh.replicate_size",
               absl::StrCat("must be in [1, ", limits.max_world, "], got ", rep));
  }
  if (shard * rep > limits.max_world) {
    return Bad("mesh", absl::StrCat("shard_size * replicate_size = ", shard * rep, " exceeds ",
                                    limits.max_world));
  }
  const v1::JobOptions& o = req.options();
  if (o.policy() == "auto") {
    if (!o.strategy().empty()) {
      auto st = ParseStrategy(o.strategy());
      if (!st.ok()) return Bad("options.strategy", st.status().message());
    }
    if (!o.optimizer().empty()) {
      auto opt = ParseOptimizerKind(o.optimizer());
      if (!opt.ok()) return Bad("options.optimizer", opt.status().message());
    }
    if (o.memory_budget_bytes() < 0)
      return Bad("options.memory_budget_bytes", "must not be negative");
    if (o.tokens_per_step() < 0) return Bad("options.tokens_per_step", "must not be negative");
  } else if (!o.strategy().empty() || !o.optimizer().empty() || o.memory_budget_bytes() != 0 ||
             o.tokens_per_step() != 0) {
    return Bad("options",
               "strategy, optimizer, memory_budget_bytes and tokens_per_step are for "
               "policy auto only");
  } else if (!o.policy().empty()) {
    auto p = ParsePolicy(o.policy());
    if (!p.ok()) return Bad("options.policy", p.status().message());
    if (!IsRaggedPolicy(*p)) {
      return Bad(
          "options.policy",
          absl::StrCat("'", o.policy(), "' is a baseline; jobs use ragged, ragged-paper or auto"));
    }
  }
  if (!o.default_granule().empty()) {
    auto g = ParseGranule(o.default_granule());
    if (!g.ok()) return Bad("options.default_granule", g.status().message());
  }
  if (o.align_bytes() < 0 || o.align_bytes() > 4096) {
    return Bad("options.align_bytes", absl::StrCat("must be in [0, 4096], got ", o.align_bytes()));
  }
  if (o.registration_timeout_ms() < 0 ||
      o.registration_timeout_ms() > limits.max_registration_timeout_ms) {
    return Bad("options.registration_timeout_ms",
               absl::StrCat("must be in [0, ", limits.max_registration_timeout_ms, "], got ",
                            o.registration_timeout_ms()));
  }
  if (o.recovery_deadline_ms() < 0 || o.recovery_deadline_ms() > limits.max_recovery_deadline_ms) {
    return Bad("options.recovery_deadline_ms",
               absl::StrCat("must be in [0, ", limits.max_recovery_deadline_ms, "], got ",
                            o.recovery_deadline_ms()));
  }
  if (!o.on_node_loss().empty() && o.on_node_loss() != "fail" && o.on_node_loss() != "shrink") {
    return Bad("options.on_node_loss",
               absl::StrCat("'", o.on_node_loss(),
                            "' is not one of '' or 'fail' (the job turns DEGRADED) and 'shrink'"));
  }
  if (o.on_node_loss() == "shrink" && o.recovery_deadline_ms() <= 0) {
    return Bad("options.on_node_loss",
               "'shrink' needs options.recovery_deadline_ms > 0 (the job shrinks when a lost "
               "node is not back or rebuilt within the recovery deadline)");
  }
  return ValidateRedundancy(o, shard * rep, rep);
}

absl::Status ValidateRedundancy(const v1::JobOptions& o, int64_t world_size, int64_t replicas) {
  RAGSHARD_ASSIGN_OR_RETURN(const Redundancy r,
                            ParseRedundancy("options.redundancy", o.redundancy()));
  if (!r.enabled()) return absl::OkStatus();
  if (r.kind == Redundancy::Kind::kHsdp && replicas < 2) {
    return Bad("options.redundancy",
               absl::StrCat("'hsdp' rebuilds a lost node from another HSDP replica group; the "
                            "job has mesh.replicate_size ",
                            replicas, " (give at least 2, or another redundancy)"));
  }
  if (o.recovery_deadline_ms() <= 0) {
    return Bad("options.redundancy",
               absl::StrCat("'", o.redundancy(),
                            "' needs options.recovery_deadline_ms > 0 (a lost node is rebuilt on "
                            "a replacement daemon within the recovery deadline)"));
  }
  // Every node holds at least one rank: fewer ranks than nodes needed is certain to be refused.
  if (world_size < r.min_nodes()) {
    return Bad("options.redundancy",
               r.kind == Redundancy::Kind::kParity
                   ? absl::StrCat("'", o.redundancy(), "' needs at least K + 1 = ", r.min_nodes(),
                                  " nodes (K = ", r.k, "), but the job's world size is ",
                                  world_size, ": fewer ranks than nodes")
                   : absl::StrCat("'", o.redundancy(),
                                  "' needs at least 2 nodes, but the job's world size is ",
                                  world_size, ": fewer ranks than nodes"));
  }
  return absl::OkStatus();
}

namespace {

// A registration's inventory: the full one, or its SHA-256.
absl::Status ValidateInventoryOrHash(bool full, bool hash, const Inventory& inventory,
                                     const std::string& sha, const ServiceLimits& limits) {
  if (full) {
    absl::Status v = ValidateInventory(inventory, limits.inventory);
    if (!v.ok()) return Bad("inventory", v.message());
    return absl::OkStatus();
  }
  if (!hash) return Bad("inventory_or_hash", "send the inventory or its SHA-256");
  if (sha.size() != 32) {
    return Bad("inventory_sha256", absl::StrCat("must be 32 bytes, got ", sha.size()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateRegisterRank(const v1::RegisterRankRequest& req, const ServiceLimits& limits) {
  RAGSHARD_RETURN_IF_ERROR(ValidateJobId(req.job_id(), limits));
  if (req.rank() < 0 || req.rank() >= limits.max_world) {
    return Bad("rank", absl::StrCat("must be in [0, ", limits.max_world, "), got ", req.rank()));
  }
  RAGSHARD_RETURN_IF_ERROR(ValidateId("node_id", req.node_id(), limits.max_id_length));
  return ValidateInventoryOrHash(req.has_inventory(), req.has_inventory_sha256(), req.inventory(),
                                 req.inventory_sha256(), limits);
}

absl::Status ValidateRegisterNodeRanks(const v1::RegisterNodeRanksRequest& req,
                                       const ServiceLimits& limits) {
  RAGSHARD_RETURN_IF_ERROR(ValidateJobId(req.job_id(), limits));
  RAGSHARD_RETURN_IF_ERROR(ValidateId("node_id", req.node_id(), limits.max_id_length));
  if (req.ranks().empty() || req.ranks_size() > limits.max_node_ranks) {
    return Bad("ranks", absl::StrCat("must name 1 to ", limits.max_node_ranks, " ranks, got ",
                                     req.ranks_size()));
  }
  std::vector<int64_t> sorted(req.ranks().begin(), req.ranks().end());
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i < sorted.size(); ++i) {
    if (sorted[i] < 0 || sorted[i] >= limits.max_world) {
      return Bad("ranks",
                 absl::StrCat("each must be in [0, ", limits.max_world, "), got ", sorted[i]));
    }
    if (i > 0 && sorted[i] == sorted[i - 1]) {
      return Bad("ranks", absl::StrCat("rank ", sorted[i], " is named twice"));
    }
  }
  return ValidateInventoryOrHash(req.has_inventory(), req.has_inventory_sha256(), req.inventory(),
                                 req.inventory_sha256(), limits);
}

absl::Status ValidateRegisterNode(const v1::RegisterNodeRequest& req, const ServiceLimits& limits) {
  RAGSHARD_RETURN_IF_ERROR(ValidateId("node_id", req.node_id(), limits.max_id_length));
  RAGSHARD_RETURN_IF_ERROR(
      CheckText("data_address", req.data_address(), limits.max_address_length));
  if (req.capacity_bytes() < 0) {
    return Bad("capacity_bytes", absl::StrCat("must not be negative, got ", req.capacity_bytes()));
  }
  return absl::OkStatus();
}

absl::Status ValidateHeartbeat(const v1::HeartbeatRequest& req, const ServiceLimits& limits) {
  RAGSHARD_RETURN_IF_ERROR(ValidateId("node_id", req.node_id(), limits.max_id_length));
  if (req.jobs_size() > limits.max_heartbeat_jobs) {
    return Bad("jobs", absl::StrCat("more than ", limits.max_heartbeat_jobs, " jobs"));
  }
  for (int i = 0; i < req.jobs_size(); ++i) {
    RAGSHARD_RETURN_IF_ERROR(
        ValidateId(absl::StrCat("jobs[", i, "]"), req.jobs(i), limits.max_id_length));
  }
  const auto& f = req.figures();
  if (f.pool_capacity_bytes() < 0 || f.pool_used_bytes() < 0 || f.pool_peak_bytes() < 0 ||
      f.buffers() < 0 || f.operations_in_flight() < 0 || f.jobs() < 0 || f.operations() < 0 ||
      f.staging_bytes() < 0) {
    return Bad("figures", "counts must not be negative");
  }
  constexpr int kMaxKinds = 64;
  if (f.operations_by_kind_size() > kMaxKinds) {
    return Bad("figures.operations_by_kind", absl::StrCat("more than ", kMaxKinds, " kinds"));
  }
  for (int i = 0; i < f.operations_by_kind_size(); ++i) {
    const v1::KindCount& k = f.operations_by_kind(i);
    RAGSHARD_RETURN_IF_ERROR(ValidateId(absl::StrCat("figures.operations_by_kind[", i, "].kind"),
                                        k.kind(), limits.max_id_length));
    if (k.count() < 0) {
      return Bad(absl::StrCat("figures.operations_by_kind[", i, "].count"), "must not be negative");
    }
  }
  if (f.ranks_size() > limits.max_heartbeat_ranks) {
    return Bad("figures.ranks", absl::StrCat("more than ", limits.max_heartbeat_ranks, " ranks"));
  }
  constexpr size_t kMaxText = 512;
  for (int i = 0; i < f.ranks_size(); ++i) {
    const v1::RankProgress& r = f.ranks(i);
    const std::string field = absl::StrCat("figures.ranks[", i, "]");
    RAGSHARD_RETURN_IF_ERROR(ValidateId(field + ".job_id", r.job_id(), limits.max_id_length));
    if (r.rank() < 0 || r.pending_ms() < 0)
      return Bad(field, "rank and pending_ms must not be negative");
    for (const auto& [name, text] : {std::pair<const char*, const std::string*>{"done", &r.done()},
                                     {"pending", &r.pending()},
                                     {"waiting_on", &r.waiting_on()}}) {
      if (text->size() > kMaxText) {
        return Bad(absl::StrCat(field, ".", name),
                   absl::StrCat("longer than ", kMaxText, " bytes"));
      }
    }
  }
  return absl::OkStatus();
}

namespace {

// The job and key a rendezvous call names.
absl::Status ValidateJobKey(const std::string& job_id, const std::string& key,
                            const ServiceLimits& limits) {
  absl::Status s = ValidateJobId(job_id, limits);
  return s.ok() ? ValidateId("key", key, limits.max_key_length) : s;
}

}  // namespace

absl::Status ValidatePut(const v1::PutRequest& req, const ServiceLimits& limits) {
  RAGSHARD_RETURN_IF_ERROR(ValidateJobKey(req.job_id(), req.key(), limits));
  if (static_cast<int64_t>(req.value().size()) > limits.max_value_bytes) {
    return Bad("value", absl::StrCat("larger than ", limits.max_value_bytes, " bytes"));
  }
  return absl::OkStatus();
}

absl::Status ValidateGet(const v1::GetRequest& req, const ServiceLimits& limits) {
  RAGSHARD_RETURN_IF_ERROR(ValidateJobKey(req.job_id(), req.key(), limits));
  if (req.wait_ms() < 0 || req.wait_ms() > limits.max_wait_ms) {
    return Bad("wait_ms",
               absl::StrCat("must be in [0, ", limits.max_wait_ms, "], got ", req.wait_ms()));
  }
  return absl::OkStatus();
}

absl::Status ValidateGetKeys(const v1::GetKeysRequest& req, const ServiceLimits& limits) {
  if (req.keys().empty() || req.keys_size() > limits.max_get_keys) {
    return Bad("keys", absl::StrCat("must name 1 to ", limits.max_get_keys, " keys, got ",
                                    req.keys_size()));
  }
  for (const std::string& key : req.keys()) {
    RAGSHARD_RETURN_IF_ERROR(ValidateJobKey(req.job_id(), key, limits));
  }
  if (req.wait_ms() < 0 || req.wait_ms() > limits.max_wait_ms) {
    return Bad("wait_ms",
               absl::StrCat("must be in [0, ", limits.max_wait_ms, "], got ", req.wait_ms()));
  }
  return absl::OkStatus();
}

absl::Status ValidateReportFailure(const v1::ReportFailureRequest& req,
                                   const ServiceLimits& limits) {
  RAGSHARD_RETURN_IF_ERROR(ValidateJobId(req.job_id(), limits));
  RAGSHARD_RETURN_IF_ERROR(
      ValidateId("reporter_node_id", req.reporter_node_id(), limits.max_id_length));
  RAGSHARD_RETURN_IF_ERROR(CheckText("lost_peer", req.lost_peer(), limits.max_address_length));
  if (req.epoch() < 0) return Bad("epoch", absl::StrCat("must be >= 0, got ", req.epoch()));
  return CheckText("message", req.message(), limits.max_message_length);
}

absl::Status ValidateReportRecovered(const v1::ReportRecoveredRequest& req,
                                     const ServiceLimits& limits) {
  RAGSHARD_RETURN_IF_ERROR(ValidateJobId(req.job_id(), limits));
  RAGSHARD_RETURN_IF_ERROR(ValidateId("node_id", req.node_id(), limits.max_id_length));
  if (req.epoch() < 1) {
    return Bad("epoch", absl::StrCat("must be >= 1 (a recovery's epoch), got ", req.epoch()));
  }
  if (req.rebuilt_bytes() < 0) {
    return Bad("rebuilt_bytes", absl::StrCat("must not be negative, got ", req.rebuilt_bytes()));
  }
  if (req.rebuilt_bytes() > 0 && !req.replacement()) {
    return Bad("rebuilt_bytes",
               absl::StrCat("must be 0 from a node that kept its state (replacement false), got ",
                            req.rebuilt_bytes()));
  }
  return absl::OkStatus();
}

}  // namespace ragshard::planner
