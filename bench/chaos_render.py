"""The reliability report of bench/chaos_report.py: the faults' limits, and the Markdown, plot and
JSON written from the campaign's results (docs/benchmarks/reliability.{md,png,json}), so that a
report can be regenerated from the JSON alone (chaos_report.py --report-only)."""
import json
import os
import re
import statistics

import chaos_plot
import provenance
import report_sections
import chaos_node
import chaos_shrink
from chaos_recovery import DEADLINE, PARAM_ATOL, RECOVERY_LIMIT, STEPS

RANK_FAULTS = ["rank-kill", "daemon-stop", "daemon-kill", "host-cut"]
TRAINING_FAULTS = ["planner-kill-registration", "planner-kill-ready"]
# chaos_recovery.py, chaos_node.py, chaos_shrink.py
RECOVERY_FAULTS = ["rank-recovery", "node-rebuild", "node-shrink"]
TRIAL_FAULTS = RANK_FAULTS + TRAINING_FAULTS + RECOVERY_FAULTS
ALL_FAULTS = TRIAL_FAULTS + ["soak"]
DEFAULT_FAULTS = [f for f in TRIAL_FAULTS if f not in ("node-rebuild", "node-shrink")]

# The limits (seconds from the fault to each surviving rank's exit; rank-recovery: to
# the recovered training's exit, the recovery deadline plus 30 s).
LIMITS = {"rank-kill": 10.0, "daemon-stop": 40.0, "daemon-kill": 10.0, "host-cut": 40.0,
          "rank-recovery": RECOVERY_LIMIT, "node-rebuild": chaos_node.RECOVERY_LIMIT,
          "node-shrink": chaos_shrink.SHRINK_LIMIT}
NAMES = {"rank-kill": "rank 3", "daemon-stop": "node-1", "daemon-kill": "node-1",
         "host-cut": "node-1 (ranks 0, 1) or node-0 (ranks 2, 3)"}
# host-cut: the ranks of the node that lives on name the node cut off (the planner declared it
# lost); the cut-off node's ranks name the peer their transfer waited for.
HOST_CUT_OP_TIMEOUT_S = 20


def expected_name(fault, rank):
    """What rank `rank`'s error must name after `fault` (a rank fault)."""
    if fault == "host-cut":
        return "node-1" if rank < 2 else "node-0"
    return NAMES[fault]


WHAT = {
    "rank-kill": "kill -9 of rank 3 at step 3",
    "daemon-stop": "SIGSTOP of daemon node-1 at step 3 (SIGCONT after 60 s or once every rank "
                   "exited)",
    "daemon-kill": "kill -9 of daemon node-1 at step 3",
    "host-cut": "node-1's link down at step 3 (its packets dropped both ways, no reset; its "
                "daemon and ranks alive), the ranks' operation timeout "
                f"{HOST_CUT_OP_TIMEOUT_S} s (RAGSHARD_OP_TIMEOUT_S)",
    "planner-kill-registration": "kill -9 of the planner after CreateJob, before the ranks "
                                 "register; the 4-rank training launched (a launcher per "
                                 "host); the planner restarted 1 s later",
    "planner-kill-ready": "kill -9 of the planner once the job is READY and rank 0 printed "
                          "step 1; restarted 1 s later",
    "rank-recovery": f"kill -9, from outside, of a random rank of a {STEPS}-step training under "
                     f"a ragshard.launch --nnodes 2 --max-restarts 1 --recovery-deadline "
                     f"{DEADLINE:g} per host (AdamW, "
                     "Muon, bf16 parameters, FP8 gathers, 8-bit Adam, Shampoo and NAdam in "
                     "turn, trial by trial), a random fraction of a step after rank "
                     f"0 printed a random one of steps 1 to {STEPS - 5}",
    "node-rebuild": f"a whole node lost: SIGKILL of everything on a random daemon's host (of "
                    f"3): the daemon, its launcher and its 2 ranks, "
                    f"held (--hold-at) at a random phase of a random one of steps 1 to "
                    f"{chaos_node.STEPS - 1} of a {chaos_node.STEPS}-step training of 6 "
                    f"ranks under a ragshard.launch --nnodes 3 --max-restarts 1 "
                    f"--recovery-deadline {chaos_node.DEADLINE:g} --redundancy R per host "
                    f"(parity:2 in odd trials, replica in even ones; AdamW, bf16 parameters "
                    f"and Shampoo in turn, two trials each), and a replacement daemon with the "
                    f"lost node's id and a launcher for its node rank started on a spare host",
    "node-shrink": f"a whole node lost for good: SIGKILL of everything on a random daemon's "
                   f"host (of 2): the daemon, its launcher and its 2 ranks, held (--hold-at) at a random phase of a random one of steps 1 to "
                   f"{chaos_shrink.STEPS - 1} of a {chaos_shrink.STEPS}-step AdamW training of 4 "
                   f"ranks (--global-batch 8; 2 HSDP replica groups in trials 1 to "
                   f"{chaos_shrink.HSDP_TRIALS}, one shard group with --redundancy replica, "
                   f"which re-cuts the shards, after) under a ragshard.launch --nnodes 2 "
                   f"per host, --max-restarts 1 --recovery-deadline {chaos_shrink.DEADLINE:g} "
                   f"--on-node-loss shrink, and no replacement",
    "soak": "bench/planner_soak: 40,000 jobs, then 20 planner kills under load, then large "
            "refused requests",
}
LIMIT_TEXT = {
    "rank-kill": "every survivor (ranks 0-2) exits non-zero within 10 s, naming \"rank 3\"",
    "daemon-stop": "every rank exits non-zero within 40 s, naming \"node-1\"",
    "daemon-kill": "every rank exits non-zero within 10 s, naming \"node-1\"",
    "host-cut": "every rank exits non-zero within 40 s, ranks 0 and 1 naming \"node-1\" (the "
                "planner declared it lost), ranks 2 and 3 naming \"node-0\" (the peer their "
                "transfer waited for, at the operation's deadline)",
    "planner-kill-registration": "every trial completes (exit 0) with the reference losses",
    "planner-kill-ready": "every trial completes (exit 0) with the reference losses",
    "rank-recovery": f"the training completes (exit 0) within {RECOVERY_LIMIT:g} s of the kill "
                     "(no hang), the killed rank restarted and the job READY with one recovery, "
                     f"every final parameter within {PARAM_ATOL:g} of an uninterrupted run's (no "
                     "divergence)",
    "node-rebuild": f"the training completes (exit 0) within {chaos_node.RECOVERY_LIMIT:g} s of "
                    "the daemon's kill (no hang), the job READY with `rebuilds:     1` in "
                    "`ragshardctl job show`, every final parameter within "
                    f"{chaos_node.PARAM_ATOL:g} of an uninterrupted run's with the same "
                    "redundancy (no divergence)",
    "node-shrink": f"the training completes (exit 0) within {chaos_shrink.SHRINK_LIMIT:g} s of "
                   "the daemon's kill (no hang), the job SHRUNK and its successor READY in "
                   "`ragshardctl job show`, `world_sizes` 4 up to the step it resumed from and 2 "
                   "after, its losses after the shrink and final parameters within "
                   f"{chaos_shrink.LOSS_ATOL:g} of a reference saved at 2 x 2 after that step "
                   "and resumed at 1 x 2 with the same global batch (no divergence)",
}


SOAK_LIMITS = {
    # key: (limit text, check(value, doc) -> bool or None)
    "jobs": ("40,000 jobs", lambda v, d: v >= 40000),
    "threads_max": ("bounded (not growing with the jobs)",
                    lambda v, d: None),
    "threads_end": ("bounded", lambda v, d: None),
    "maps_max": ("grows by < 2,000 maps over the start",
                 lambda v, d: v - d["maps_start"] < 2000 if "maps_start" in d else None),
    "maps_end": ("grows by < 2,000 maps over the start",
                 lambda v, d: v - d["maps_start"] < 2000 if "maps_start" in d else None),
    "rss_max_bytes": ("< 300 MB", lambda v, d: v < 300e6),
    "rss_end_bytes": ("< 300 MB", lambda v, d: v < 300e6),
    "create_response_bytes_max": ("< 64 KiB", lambda v, d: v < 64 * 1024),
    "list_jobs_bytes": ("< 1 MiB (10 jobs at max world)", lambda v, d: v < 1 << 20),
    "list_jobs_seconds": ("< 1 s", lambda v, d: v < 1.0),
    "kills": ("20 kills", lambda v, d: v >= 20),
    "lost_creates": ("0 acknowledged creations lost", lambda v, d: v == 0),
    "lost_registrations": ("0 acknowledged registrations lost", lambda v, d: v == 0),
}


def brief(s, n=300):
    s = " ".join(str(s).split())
    return s if len(s) <= n else s[:n - 3] + "..."


def pct(xs):
    xs = sorted(xs)
    if not xs:
        return None
    return {"min": xs[0], "median": statistics.median(xs), "max": xs[-1], "n": len(xs)}


def figures(fault, entry):
    """The seconds the fault's spread is over: every survivor's time to exit over all trials
    (rank faults), or each trial's wall time (training faults)."""
    if fault in RANK_FAULTS:
        return [row["seconds"] for t in entry["trials"] for row in t.get("ranks", [])
                if row.get("seconds") is not None]
    if fault in RECOVERY_FAULTS:
        return [t["seconds"] for t in entry["trials"] if t.get("seconds") is not None]
    return [t["wall_seconds"] for t in entry["trials"] if t.get("wall_seconds") is not None]


def bad_points(fault, entry):
    """Parallel to figures(): True where that point broke the expectation (over the limit, an
    error not naming the node or rank, exit 0; a failed training)."""
    if fault in RANK_FAULTS:
        return [row["seconds"] > LIMITS[fault] or not row.get("names") or
                row.get("exit_code") == 0
                for t in entry["trials"] for row in t.get("ranks", [])
                if row.get("seconds") is not None]
    if fault in RECOVERY_FAULTS:
        return [not t["passed"] for t in entry["trials"] if t.get("seconds") is not None]
    return [not t["passed"] for t in entry["trials"] if t.get("wall_seconds") is not None]


def fmt(x, d=2):
    return "—" if x is None else f"{x:.{d}f}"


def verdict(fault, entry):
    trials = entry["trials"]
    n, ok = len(trials), sum(t["passed"] for t in trials)
    if fault in RANK_FAULTS:
        within = f"within the limit ({LIMITS[fault]:g} s, naming \"{NAMES[fault]}\")"
    elif fault == "node-rebuild":
        within = (f"rebuilt on the replacement and completed within {LIMITS[fault]:g} s of "
                  f"the kill, final parameters within {PARAM_ATOL:g}")
    elif fault == "node-shrink":
        within = (f"shrunk to 1 x 2 (HSDP kept, or re-cut) and completed within "
                  f"{LIMITS[fault]:g} s of the kill, losses and final parameters within "
                  f"{chaos_shrink.LOSS_ATOL:g} of the reference")
    elif fault in RECOVERY_FAULTS:
        within = (f"recovered in place within {LIMITS[fault]:g} s of the kill, final "
                  f"parameters within {PARAM_ATOL:g}")
    else:
        within = "completed with the reference losses"
    if ok == n:
        return f"{ok} of {n} {within}."
    return f"{ok} of {n} {within}; {n - ok} failed (below)."


def fault_section(fault, entry):
    L = []
    trials = entry["trials"]
    meta = entry["run"]
    L.append(f"## {fault}\n")
    L.append(f"Fault: {WHAT[fault]}. Limit: {LIMIT_TEXT[fault]}. Run {meta['date']} at "
             f"commit {meta['commit']}.\n")
    xs = figures(fault, entry)
    s = pct(xs)
    what = "seconds from the fault to each surviving rank's exit, all trials" \
        if fault in RANK_FAULTS else "seconds from the kill to the training's exit" \
        if fault in RECOVERY_FAULTS else "the training's wall time in seconds (launch to exit)"
    if s:
        L.append(f"Spread of {what}: min {s['min']:.2f}, median {s['median']:.2f}, max "
                 f"{s['max']:.2f} (n = {s['n']}).\n")
    else:
        L.append(f"No figures ({what}) were recorded.\n")
    if fault in RANK_FAULTS:
        rows = [row for t in trials for row in t.get("ranks", [])]
        named = sum(1 for r in rows if r.get("names"))
        L.append(f"Ranks whose error named \"{NAMES[fault]}\": {named} of {len(rows)}.\n")
        by_rank = {}
        for row in rows:
            if row.get("seconds") is not None:
                by_rank.setdefault(row["rank"], []).append(row["seconds"])
        if by_rank:
            L.append("| rank | n | min s | median s | max s |")
            L.append("|---:|---:|---:|---:|---:|")
            for r in sorted(by_rank):
                q = pct(by_rank[r])
                L.append(f"| {r} | {q['n']} | {q['min']:.2f} | {q['median']:.2f} | "
                         f"{q['max']:.2f} |")
            L.append("")
        if fault == "daemon-stop":
            sc = [t["sigcont_after_s"] for t in trials if "sigcont_after_s" in t]
            if sc:
                L.append(f"node-1 was continued (SIGCONT) after {min(sc):.1f} to "
                         f"{max(sc):.1f} s.\n")
        lines = {}
        for row in rows:
            # The same error from different trials, steps and ranks: the trial's temporary
            # directory and the digits grouped.
            key = re.sub(r"ragshard-[A-Za-z0-9_]+", "ragshard-*", row.get("error_line", ""))
            key = re.sub(r"[0-9]+", "#", key)
            lines.setdefault(key, [0, row.get("error_line", ""), set()])
            lines[key][0] += 1
            lines[key][2].add(row["rank"])
        if lines:
            L.append("The ranks' errors (the last error line of each rank; lines that differ "
                     "only in digits or the trial's temporary directory are counted together, "
                     "one example quoted):\n")
            for key, (count, example, rks) in sorted(lines.items(), key=lambda kv: -kv[1][0]):
                L.append(f"- {count} x (ranks {', '.join(map(str, sorted(rks)))}): "
                         f"`{brief(example, 260).replace('`', chr(39))}`")
            L.append("")
    elif fault == "node-rebuild":
        L.extend(chaos_node.node_text(trials))
    elif fault == "node-shrink":
        L.extend(chaos_shrink.shrink_text(trials))
    elif fault in RECOVERY_FAULTS:
        L.extend(recovery_text(trials))
    else:
        extra = []
        run = [t for t in trials if "running_at_restart" in t]
        if run:
            extra.append(f"the training was still running when the planner came back in "
                         f"{sum(t['running_at_restart'] for t in run)} of {len(run)} trials")
        rs = [t["restart_seconds"] for t in trials if "restart_seconds" in t]
        if rs:
            extra.append(f"the planner's restart (to its port file) took {min(rs):.2f} to "
                         f"{max(rs):.2f} s after the 1 s outage")
        kb = [t["steps_before_kill"] for t in trials if "steps_before_kill" in t]
        if kb:
            extra.append(f"rank 0 had printed {min(kb)}"
                         f"{'' if min(kb) == max(kb) else f' to {max(kb)}'} of "
                         f"{entry.get('steps', '?')} steps when the planner was killed")
        if extra:
            L.append("; ".join(extra).capitalize() + ".\n")
    stuck = [(t["trial"], x) for t in trials for x in t.get("stuck_at_stop", [])]
    left = [(t["trial"], t["leftover_after_launcher"]) for t in trials
            if t.get("leftover_after_launcher")]
    if stuck:
        L.append("Servers that did not exit within 10 s of SIGTERM at the trial's end (killed): " +
                 ", ".join(f"trial {i}: {x}" for i, x in stuck) + ".\n")
    if left:
        L.append("Processes of the launcher's session still alive after the launcher exited "
                 "(killed): " + ", ".join(f"trial {i}: pids {p}" for i, p in left) + ".\n")
    L.append(f"**Verdict: {verdict(fault, entry)}**\n")
    failed = [t for t in trials if not t["passed"]]
    if failed:
        L.append("Failed trials:\n")
        for t in failed:
            L.append(f"- trial {t['trial']}: {brief(t.get('error') or '?', 600)}")
        L.append("")
    # Per-trial table.
    L.append("<details><summary>Per trial</summary>\n")
    if fault in RANK_FAULTS:
        L.append("| trial | result | seconds to exit (rank: s, named?) |")
        L.append("|---:|---|---|")
        for t in trials:
            cells = ", ".join(f"{r['rank']}: {fmt(r.get('seconds'))}"
                              f"{'' if r.get('names') else ' (not named)'}"
                              for r in t.get("ranks", []))
            L.append(f"| {t['trial']} | {'pass' if t['passed'] else 'FAIL'} | {cells or '—'} |")
    elif fault == "node-rebuild":
        L.extend(chaos_node.node_table(trials))
    elif fault == "node-shrink":
        L.extend(chaos_shrink.shrink_table(trials))
    elif fault in RECOVERY_FAULTS:
        L.append("| trial | result | configuration | rank killed | after step | resumed at step | "
                 "s from the kill to the exit | max abs Δ |")
        L.append("|---:|---|---|---:|---:|---:|---:|---:|")
        for t in trials:
            d = t.get("max_abs_diff")
            L.append(f"| {t['trial']} | {'pass' if t['passed'] else 'FAIL'} | {t['optimizer']} | "
                     f"{t['rank']} | {t['after_step']} | {t.get('resumed_at_step', '—')} | "
                     f"{fmt(t.get('seconds'))} | {'—' if d is None else f'{d:.1e}'} |")
    else:
        L.append("| trial | result | wall s | running at restart | final loss |")
        L.append("|---:|---|---:|---|---:|")
        for t in trials:
            L.append(f"| {t['trial']} | {'pass' if t['passed'] else 'FAIL'} | "
                     f"{fmt(t.get('wall_seconds'))} | {t.get('running_at_restart', '—')} | "
                     f"{fmt(t.get('final_loss'), 6)} |")
    L.append("\n</details>\n")
    return L


def recovery_text(trials):
    """rank-recovery's figures beyond the spread: the kills, and the parameters' distance."""
    L = []
    killed = [t for t in trials if "killed_at_seconds" in t]
    if killed:
        ranks = sorted({t["rank"] for t in killed})
        steps = [t["after_step"] for t in killed]
        after = f"step {min(steps)}" if min(steps) == max(steps) else \
            f"steps {min(steps)} to {max(steps)}"
        L.append(f"Killed: rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}, "
                 f"after {after} (" + ", ".join(
                     f"{sum(t['optimizer'] == c for t in killed)} {c}"
                     for c in sorted({t['optimizer'] for t in killed})) + " trials).\n")
    diffs = [t["max_abs_diff"] for t in trials if "max_abs_diff" in t]
    if diffs:
        L.append(f"Largest |final parameter − the uninterrupted run's| over the trials: "
                 f"{max(diffs):.1e} (limit {PARAM_ATOL:g}).\n")
    return L


def reject_text(doc):
    """planner_soak --mode reject's figures as a sentence."""
    def mb(k):
        return f"{doc[k] / 1e6:,.1f} MB" if isinstance(doc.get(k), (int, float)) else "—"

    def refused(k):
        return "refused" if doc.get(k) else "**not refused**"

    return (f"Large refused requests: a {doc.get('put_bytes', 0) / 2**20:,.0f} MiB `Put` "
            f"({refused('put_refused')}: `{doc.get('put_error', '')}`) and a "
            f"{doc.get('register_tensors', 0):,}-tensor `RegisterRank` "
            f"({refused('register_refused')}: `{doc.get('register_error', '')}`). The planner's "
            f"RSS was {mb('rss_start_bytes')} before them, {mb('rss_after_put_bytes')} a second "
            f"after the refused Put and {mb('rss_after_register_bytes')} a second after the "
            f"refused RegisterRank (a refused request makes the planner return freed memory "
            f"with malloc_trim at its next tick); the peak, while gRPC buffers the "
            f"{doc.get('put_bytes', 0) / 2**20:,.0f} MiB request, is {mb('rss_peak_bytes')}. "
            f"It answered afterwards: {'yes' if doc.get('healthy_after') else '**no**'}.\n")


def soak_section(entry):
    L = ["## Planner soak, kill bursts and large refused requests (bench/planner_soak)\n"]
    meta = entry["run"]
    res = entry["result"]
    if not res.get("present"):
        L.append(f"Not run: `{res.get('tool')}` is not built in the build directory used "
                 f"({meta['date']}, commit {meta['commit']}). Re-run "
                 f"`bench/chaos_report.py --faults soak` once it exists; this section is "
                 f"replaced and the rest of the report kept.\n")
        return L
    L.append(f"Run {meta['date']} at commit {meta['commit']}.\n")
    for mode in ("soak", "kills", "reject"):
        e = res["modes"].get(mode)
        if not e:
            continue
        L.append(f"### --mode {mode}\n")
        L.append(f"`{e['command']}` (exit code {e.get('exit_code', '—')}, "
                 f"{e.get('wall_seconds', 0):.1f} s)\n")
        if e.get("error"):
            L.append(f"Error: {brief(e['error'], 600)}\n")
        doc = e.get("result") or {}
        if doc and mode == "reject":
            L.append(reject_text(doc))
        elif doc:
            L.append("| key | value | limit | within |")
            L.append("|---|---:|---|---|")
            for k, v in doc.items():
                lim, chk = SOAK_LIMITS.get(k, ("—", None))
                ok = "—"
                if chk is not None and isinstance(v, (int, float)):
                    try:
                        r = chk(v, doc)
                        ok = "—" if r is None else ("yes" if r else "**NO**")
                    except Exception:
                        ok = "—"
                if k.startswith("threads") and {"threads_start", "threads_max"} <= doc.keys():
                    lim = f"bounded (max − start = {doc['threads_max'] - doc['threads_start']})"
                if isinstance(v, float):
                    v = f"{v:.4g}"
                elif isinstance(v, int) and abs(v) >= 10000:
                    v = f"{v:,}"
                L.append(f"| {k} | {v} | {lim} | {ok} |")
            L.append("")
    return L


def plot(docs, doc):
    data = []
    for fault in TRIAL_FAULTS:
        e = doc["faults"].get(fault)
        if e:
            data.append((fault, figures(fault, e), LIMITS.get(fault),
                         sum(not t["passed"] for t in e["trials"]), bad_points(fault, e)))
    if not data:
        return None
    return chaos_plot.draw(docs, data, recovery_faults=RECOVERY_FAULTS,
                           node_rebuild="node-rebuild" in doc["faults"])


def write_report(docs, doc):
    pic = plot(docs, doc)
    L = ["# Reliability under faults\n",
         "Generated by `bench/chaos_report.py` from `reliability.json` (the raw per-trial "
         "results; a run of some faults replaces those faults' entries and keeps the others). "
         "Each trial starts its own planner and 2 daemons and 4 ranks of "
         "`examples/train_tiny.py`, 2 per daemon, on hosts of their own "
         "(`ragshard.cluster.NamespacedCluster`: the planner and each daemon with its ranks in "
         "a network and mount namespace of its own, with a private /tmp, on a private bridge); "
         "the rank faults (rank-kill, daemon-stop, daemon-kill, host-cut) start each rank on "
         "its own (no launcher to stop the others), as `tests/python/test_faults.py` does; the "
         "others launch the training with a `ragshard.launch --nnodes N --node-rank K` per host "
         "(bench/chaos_procs.py, `host_launchers`). The planner faults "
         "compare its losses and final parameters with the "
         "single-process reference (`test_training.compare`, relative 1e-5), computed once "
         "per campaign.\n",
         "## How it was run\n"]
    if any(f in doc["faults"] for f in RECOVERY_FAULTS):
        L[1] = L[1][:-2] + ("; rank-recovery runs the training under `--max-restarts 1`, "
                            "kills a rank from outside and compares the final "
                            "parameters with an uninterrupted run's (bench/chaos_recovery.py), "
                            "one per configuration per campaign (AdamW, Muon, bf16, FP8 "
                            "gathers, 8-bit Adam, Shampoo, NAdam in turn).\n")
    if "node-rebuild" in doc["faults"]:
        L[1] = L[1][:-2] + ("; node-rebuild starts 3 daemons and 6 ranks (2 per daemon) under "
                            "`--max-restarts 1 --redundancy R`, kills everything on a daemon's "
                            "host (its daemon, launcher and ranks: their connections reset), "
                            "starts a replacement daemon with the node's id and a launcher for "
                            "its node rank on a spare host, and compares the final parameters with an uninterrupted run's "
                            "(bench/chaos_node.py), one per redundancy and configuration per "
                            "campaign (AdamW, bf16, Shampoo in turn, two trials each).\n")
    if "node-shrink" in doc["faults"]:
        L[1] = L[1][:-2] + ("; node-shrink runs 4 ranks over 2 daemons (2 HSDP replica groups "
                            f"in trials 1 to {chaos_shrink.HSDP_TRIALS}, one shard group with "
                            "`--redundancy replica`, which re-cuts, after) "
                            "under `--max-restarts 1 --on-node-loss shrink`, "
                            "kills everything on a daemon's host with no replacement, and compares the "
                            "losses after the shrink and the final parameters with a reference "
                            "saved at 2 x 2 after the step the shrink resumed from and resumed "
                            "at 1 x 2 (bench/chaos_shrink.py), one per step and layout per "
                            "campaign.\n")
    runs = {}
    for fault in ALL_FAULTS:
        e = doc["faults"].get(fault)
        if e:
            key = (e["run"]["command"], e["run"]["date"])
            runs.setdefault(key, (e["run"], []))[1].append(fault)
    for (cmd, _), (meta, faults) in sorted(runs.items(), key=lambda kv: kv[0][1]):
        L.append(f"- Faults {', '.join(faults)}:")
        L.append(f"  - command: `{cmd}` (in the repository root)")
        L.append(f"  - date: {meta['date']}; commit: `{meta['commit']}`; build: "
                 f"`{meta['build']}`")
        L.append(f"  - machine: {meta['machine']}")
    L.append("")
    for note in doc.get("notes", []):
        L.append(f"Note: {note}\n")
    L.append("## Summary\n")
    L.append("| fault | trials | passes | min s | median s | max s | limit | verdict |")
    L.append("|---|---:|---:|---:|---:|---:|---|---|")
    for fault in TRIAL_FAULTS:
        e = doc["faults"].get(fault)
        if not e:
            continue
        s = pct(figures(fault, e)) or {}
        n, ok = len(e["trials"]), sum(t["passed"] for t in e["trials"])
        lim = f"{LIMITS[fault]:g} s, names \"{NAMES[fault]}\"" if fault in NAMES else \
            f"{LIMITS[fault]:g} s, Δ ≤ {chaos_shrink.LOSS_ATOL if fault == 'node-shrink' else PARAM_ATOL:g}" if fault in RECOVERY_FAULTS else \
            "completes with reference losses"
        L.append(f"| {fault} | {n} | {ok} | {fmt(s.get('min'))} | {fmt(s.get('median'))} | "
                 f"{fmt(s.get('max'))} | {lim} | "
                 f"{'all within' if ok == n else f'{n - ok} FAILED'} |")
    L.append("")
    L.append("Seconds: for the rank and daemon faults, from the fault to each surviving rank's "
             "exit, over all survivors of all trials; for the planner faults, the training's "
             "wall time from launch to exit"
             + ("; for rank-recovery, node-rebuild and node-shrink, from the kill to the "
               "recovered training's exit" if any(f in doc["faults"] for f in RECOVERY_FAULTS) else "")
             + ".\n")
    if pic:
        L.append(f"![seconds per fault against the limit]({os.path.basename(pic)})\n")
    for fault in TRIAL_FAULTS:
        if fault in doc["faults"]:
            L.extend(fault_section(fault, doc["faults"][fault]))
    if "soak" in doc["faults"]:
        L.extend(soak_section(doc["faults"]["soak"]))
    # The header: each run's commit (its date is under "How it was run"); runs from before
    # the commit was recorded in full (40 hex digits) leave the report's header as it is.
    commits = sorted({m["commit"] for m, _ in runs.values()})
    header = [x for c in commits for x in ("", f"commit: {c}")][1:] \
        if all(re.match(r"[0-9a-f]{40} \(", c) for c in commits) else None
    path = os.path.join(docs, "reliability.md")
    kept = report_sections.carried(path)  # another script's sections (bench/chaos_hosts.py)
    provenance.write(path, "\n".join(L).rstrip() + "\n" + ("\n" + kept if kept else ""), header)


def load_json(path):
    try:
        with open(path) as f:
            doc = json.load(f)
        doc.setdefault("faults", {})
        return doc
    except (OSError, ValueError):
        return {"faults": {}}


def save(docs, doc):
    path = os.path.join(docs, "reliability.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)
    write_report(docs, doc)
