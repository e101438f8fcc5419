// How ragshardctl shows a job's recovery in place (planner.proto Job.recovery_epoch, recovery,
// recoveries, recovery_seconds; docs/recovery.md) and its redundancy (JobOptions.redundancy,
// Job.rebuilds, rebuilt_bytes, JobRecovery.lost_node_id): pure formatting, tested without a
// planner.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "ragshard/v1/planner.pb.h"

namespace ragshard {

// One line for a table cell: for a RECOVERING job its epoch, the lost node being rebuilt, the
// nodes recovered so far and the seconds left ("epoch 2, rebuilding node 'n1' on a replacement
// daemon, 1 node(s) recovered, 95.3 s left"); for a job that recovered before, how often and the
// seconds lost ("2 recoveries, 3.4 s lost"); else empty. `now_ms`: the wall clock, in Unix ms.
std::string RecoveryNote(const v1::Job& job, int64_t now_ms);

// The lines `job show` and `job why` print, labels padded to 14 columns, each ending in '\n'. A
// RECOVERING job: its epoch and who reported the loss, what was lost, the lost node being
// rebuilt, the nodes recovered and those still rejoining (of `nodes`, the nodes of its ranks),
// and the deadline. A job that recovered before: the count, the seconds lost, and the last
// recovery. Else empty.
std::string RecoveryLines(const v1::Job& job, const std::vector<std::string>& nodes,
                          int64_t now_ms);

// One cell for the jobs table: the job's redundancy and, once it rebuilt a node, its totals
// ("parity:2, rebuilds: 1 (4096 bytes)"); empty for a job without redundancy that rebuilt none.
std::string RedundancyNote(const v1::Job& job);

// The lines `job show` and `job why` print on the job's redundancy: what it is, and the totals
// ("rebuilds:     N (B bytes)"). Empty for a job without redundancy that rebuilt none.
std::string RedundancyLines(const v1::Job& job);

// The lines `job show` and `job why` print on a shrink (JobOptions.on_node_loss "shrink"): on a
// SHRUNK job its successor and the ranks that go on there ("shrunk to:    tiny/shrink-1 (ranks
// 0, 1 go on)"), on a successor the job it came from ("shrunk from:  tiny (shrinks: 1)"); each
// ending in '\n'. Empty for a job that never shrank.
std::string ShrinkLines(const v1::Job& job);

// One cell for the jobs table on a successor: "shrunk from tiny (shrinks: 1)"; else empty (a
// SHRUNK job's error names its successor).
std::string ShrinkNote(const v1::Job& job);

// `job why`'s lines on the ranks' optimizer steps, from their daemons' heartbeats (`progress`
// by rank; their step journals, docs/recovery.md): for a RECOVERING job, the step being redone
// (one past the least committed) and the ranks not attached again yet; else, where the ranks
// keep a journal, the steps committed. Empty where no rank reports a journal.
std::string StepLines(const v1::Job& job,
                      const std::map<int64_t, const v1::RankProgress*>& progress);

}  // namespace ragshard
