// ragshardctl's commands that talk to a planner: health, jobs, job show/create/delete/why, plan
// show/metrics and nodes. A job's status shows its recovery in place and its redundancy
// (ctl/ctl_recovery.h). Each
// connects with the global flags (--planner, the token and TLS flags, --retry-s), prints a table or
// (--json) the protobuf as JSON, and returns the exit code (ctl/ctl_format.h) with one-line errors
// on `err`.
#pragma once

#include <ostream>
#include <string>

#include "CLI/CLI.hpp"
#include "protocol/planner_client.h"

namespace ragshard {

struct Online {
  std::string planner;
  ClientSecurityOptions security;
  bool json = false;
  double retry_s = 5;  // a planner restart is ridden through for this long
};

// The global flags, with RAGSHARD_PLANNER, RAGSHARD_TOKEN_FILE and RAGSHARD_TLS_CA, _CERT, _KEY
// and _SERVER_NAME as their defaults.
void AddOnlineFlags(CLI::App* app, Online* o);

int RunHealth(const Online& o, std::ostream& out, std::ostream& err);
int RunJobs(const Online& o, std::ostream& out, std::ostream& err);
int RunJobShow(const Online& o, const std::string& id, std::ostream& out, std::ostream& err);
// The most --recovery-deadline accepts (the planner's own limit: 24 h).
inline constexpr double kMaxRecoveryDeadlineS = 24 * 3600;
// `job create`'s flags that are parsed here, so that a bad one names its flag.
struct JobCreateFlags {
  std::string memory_budget;      // a byte size ("80GiB"); empty: none
  std::string recovery_deadline;  // seconds ("120", "0.5"); empty: none
  // none, replica, hsdp or parity:K (engine/redundancy.h); anything but none needs a recovery
  // deadline.
  std::string redundancy;
};
int RunJobCreate(const Online& o, const JobSpec& spec, const JobCreateFlags& flags,
                 std::ostream& out, std::ostream& err);
int RunJobDelete(const Online& o, const std::string& id, std::ostream& out, std::ostream& err);
int RunPlanShow(const Online& o, const std::string& id, const std::string& unit,
                const std::string& factor, std::ostream& out, std::ostream& err);
int RunPlanMetrics(const Online& o, const std::string& id, std::ostream& out, std::ostream& err);
int RunNodes(const Online& o, std::ostream& out, std::ostream& err);
// Where each rank of a job stands, from its daemon's latest heartbeat: the last operation done,
// the one it waits on, for how long and on whom (a local rank, a peer node). Answers while the
// job hangs: the planner holds the figures. A RECOVERING job also says what was lost, which
// nodes have recovered, which are still rejoining, and the deadline.
int RunJobWhy(const Online& o, const std::string& id, std::ostream& out, std::ostream& err);
// One node's figures, from its daemon's latest heartbeat to the planner.
int RunNodeStats(const Online& o, const std::string& node_id, std::ostream& out, std::ostream& err);

}  // namespace ragshard
