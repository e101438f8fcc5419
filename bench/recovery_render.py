"""The writing side of bench/recovery_report.py: from the run's figures (a run's, or its
runs.json's with --from-json), the figures the report states (`summarize`), the plot
docs/benchmarks/recovery.png (`plot`) and the report docs/benchmarks/recovery.md (`render`)."""
import os
import statistics

import provenance
import report_sections
import recovery_node_render
from recovery_runs import WATCH_S

PARAM_ATOL = 1e-6  # the issue's bound on |final parameters - the uninterrupted run's|
NOISE_FLOOR = 0.05  # "within noise": moved by less than max(5 %, the runs' spread)
PHASE_COLORS = {"forward": "tab:blue", "backward": "tab:orange", "step": "tab:red",
                "between": "tab:green"}


def med(xs):
    return statistics.median(xs) if xs else None


def span(xs, fmt="{:.2f}"):
    return f"{fmt.format(min(xs))}–{fmt.format(max(xs))}" if xs else "—"


def ok(rounds, kind):
    """The rounds' runs of `kind` that completed (a failed run holds "error")."""
    return [r[kind] for r in rounds if kind in r and "error" not in r[kind]]


def failures(rounds):
    return [(i + 1, kind, r[kind]["error"]) for i, r in enumerate(rounds)
            for kind in r if "error" in r[kind]]


def summarize(doc):
    """The report's figures, from the rounds."""
    rounds, reps = doc["rounds"], doc["reps"]
    s = {}
    u1, saved = ok(rounds, "restarts"), ok(rounds, "saved")
    s["base_restarts"] = med([u["wall"] for u in u1])
    s["base_saved"] = med([u["wall"] for u in saved])
    s["recovered"] = ok(rounds, "recovered")
    for k in s["recovered"]:
        k["lost"] = k["wall"] - s["base_restarts"]
        if k.get("resumed_step_line_at") is not None and k.get("first_step_seconds") is not None:
            # From the kill to the restarted ranks starting their first step.
            k["back_in"] = k["resumed_step_line_at"] - k["first_step_seconds"] - k["killed_at"]
    s["checkpointed"] = ok(rounds, "checkpointed")
    for c in s["checkpointed"]:
        c["lost"] = sum(c["walls"]) - s["base_saved"]
    s["back_in"] = med([k["back_in"] for k in s["recovered"] if "back_in" in k])
    s["lost"] = med([k["lost"] for k in s["recovered"]])
    s["lost_checkpoint"] = med([c["lost"] for c in s["checkpointed"]])
    starts = [u["start"] for u in u1 if u["start"] is not None]
    s["starts"], s["start"] = starts, med(starts)
    s["step"] = med([med(u["slowest_steps"]) for u in u1])
    s["teardown"] = med([u["wall"] - u["start"] - sum(u["steps"]) for u in u1
                         if u["start"] is not None])
    if s["start"] is not None and s["step"] is not None:
        s["target"] = 2 * (s["start"] + s["step"])
        s["met"] = s["lost"] is not None and s["lost"] <= s["target"]
    # The step time with and without recovery: the first `reps` rounds' alternated runs.
    first = rounds[:reps]
    s["with"] = [med(u["slowest_steps"]) for u in ok(first, "restarts")]
    s["without"] = [med(u["slowest_steps"]) for u in ok(first, "plain")]
    if s["with"] and s["without"]:
        m1, m0 = med(s["with"]), med(s["without"])
        s["spread"] = max(max(x) - min(x) for x in (s["with"], s["without"]))
        s["noise"] = max(NOISE_FLOOR * m0, s["spread"])
        s["ratio"], s["moved"] = m1 / m0, m1 - m0
        s["within_noise"] = abs(m1 - m0) < s["noise"]
    return s


def plot(doc, s, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.4),
                                 gridspec_kw={"width_ratios": [1.4, 1]})
    for x, runs in ((0, s["recovered"]), (1, s["checkpointed"])):
        for i, r in enumerate(runs):
            jit = x + 0.25 * ((i * 0.37) % 1 - 0.5)
            ax.scatter(jit, r["lost"], color=PHASE_COLORS[r["phase"]], s=28, zorder=3)
        if runs:
            ax.hlines(med([r["lost"] for r in runs]), x - 0.3, x + 0.3, color="black")
    if s.get("target") is not None:
        ax.axhline(s["target"], color="red", ls="--", lw=1)
        ax.text(1.55, s["target"], "target: 2 × (start + step)", color="red", ha="right",
                va="bottom", fontsize=8)
        ax.axhline(s["start"], color="grey", ls=":", lw=1)
        ax.text(1.55, s["start"], "one start (launch to the first step)", color="grey",
                ha="right", va="bottom", fontsize=8)
    top = max([r["lost"] for r in s["recovered"] + s["checkpointed"]] +
              [s.get("target") or 0, 1.0])
    ax.set_ylim(0, top * 1.15)
    for phase, color in PHASE_COLORS.items():
        ax.scatter([], [], color=color, s=28, label=f"killed in {phase}")
    ax.legend(fontsize=7, loc="upper left")
    ax.set_xticks([0, 1], ["recovery in place\n(--max-restarts 1)",
                           f"checkpoint every {doc['save_every']} steps,\nrestart all, load"])
    ax.set_xlim(-0.6, 1.6)
    ax.set_ylabel("seconds lost per rank failure\n(wall time − uninterrupted median)")
    ax.set_title("a rank killed (SIGKILL) at a random step", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    for x, xs in enumerate((s["with"], s["without"])):
        bx.scatter([x] * len(xs), [v * 1e3 for v in xs], color="tab:blue", s=20, zorder=3)
        if xs:
            bx.hlines(med(xs) * 1e3, x - 0.3, x + 0.3, color="black")
    bx.set_xticks([0, 1], ["--max-restarts 1\n(state in the pool,\njournaled)", "no restarts"])
    bx.set_xlim(-0.6, 1.6)
    bx.set_ylim(0, max(s["with"] + s["without"] + [0.001]) * 1e3 * 1.15)
    bx.set_ylabel("median step (ms), slowest rank")
    bx.set_title(f"step time: {doc['reps']} alternated runs each", fontsize=10)
    bx.grid(axis="y", alpha=0.3)
    fig.suptitle(f"examples/train_tiny.py {' '.join(doc['model'])}, {doc['steps']} steps; "
                 "2 daemons × 2 ranks", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def others_text(doc):
    """The other processes on the machine: the waits for quiet, and what ran beside the runs."""
    runs = [(i + 1, kind, r[kind]) for i, r in enumerate(doc["rounds"]) for kind in r
            if "others_cores" in r[kind]]
    if not runs:
        return []
    cores = [x["others_cores"] for _, _, x in runs]
    worst = max(runs, key=lambda t: t[2]["others_cores"])
    text = ("Other processes: during the measured launches, the processes other than the "
            "report's (the machine's busy CPU time, /proc/stat, less the report's and its "
            f"children's) used a median of {med(cores):.2f} cores, at most "
            f"{worst[2]['others_cores']:.2f} (round {worst[0]}, {worst[1]}); the column "
            "\"others\" below gives each trial's.")
    if doc.get("quiet_wait"):
        waits = [x.get("waited", 0) for _, _, x in runs]
        text += (f" Before each measured launch the report watched the machine for 2 s and "
                 f"waited on until the others used less than {doc['quiet_cores']:g} cores over "
                 f"2 s, or {doc['quiet_wait']:g} s passed ({doc.get('quiet_total', 0):g} s of "
                 f"waiting at most over the run): {sum(waits):.0f} s in all over "
                 f"{len(waits)} launches; {sum(w > 3 for w in waits)} of them waited more than "
                 "the first 2 s.")
    return [text + "\n"]


def _f(x, fmt="{:.2f}"):
    return "—" if x is None else fmt.format(x)


def render(doc, out):
    """Writes the report to `out` and its plot beside it."""
    s = summarize(doc)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    png = os.path.join(os.path.dirname(os.path.abspath(out)), "recovery.png")
    plot(doc, s, png)
    model = " ".join(doc["model"])
    n_with, n_without = len(s["with"]), len(s["without"])
    L = ["# Recovery in place: what a lost rank costs" +
         (", and a lost node\n" if "node" in doc else "\n"),
         f"Run by `bench/recovery_report.py` on {doc['started'][:10]} in {doc['elapsed'] / 60:.1f} "
         f"minutes, every figure from that one run. Command (in the repository root):\n",
         f"```\n{doc['command']}\n```\n",
         f"Machine: {doc['machine']}. Load average (1, 5, 15 min) "
         f"{' '.join(f'{x:.2f}' for x in doc['load_start'])} at the start, "
         f"{' '.join(f'{x:.2f}' for x in doc['load_end'])} at the end. Python "
         f"{doc['python']}, torch {doc['torch']}.\n",
         f"Configuration: `examples/train_tiny.py {model} --steps {doc['steps']}` (a decoder-only "
         "transformer, AdamW, fp32), W = 4 ranks through `ragshard.launch` over 2 daemons × 2 "
         "ranks, each launch on a fresh `LocalCluster` (a planner and 2 daemons on this "
         "machine), with `--preload torch` (as the tests launch): the ranks are forked from the "
         "launcher's one torch import, and under `--max-restarts` a restarted rank is one of "
         "the spare processes forked with them; a whole-job restart is a new launcher, which "
         "imports torch once again. Every round runs, in this order: an uninterrupted run with `--max-restarts 1`, "
         "a trial of recovery in place, an uninterrupted run without restarts (the first "
         f"{doc['reps']} rounds), an uninterrupted run that saves a checkpoint every "
         f"{doc['save_every']} steps, and a trial of checkpoint-and-restart. "
         f"{len(doc['rounds'])} rounds. Wall times are the launcher's, from its start to its "
         "exit, so a run's start and its end (the final parameters gathered and written) are in "
         "them.\n"]
    L += others_text(doc)
    L += ["## Summary\n",
         "| | seconds lost per rank failure, median | min–max | trials |",
         "|---|---:|---:|---:|",
         f"| recovery in place (`--max-restarts 1`) | {_f(s['lost'])} | "
         f"{span([k['lost'] for k in s['recovered']])} | {len(s['recovered'])} |",
         f"| checkpoint every {doc['save_every']} steps, the job fails, all ranks started again "
         f"with `--resume` | {_f(s['lost_checkpoint'])} | "
         f"{span([c['lost'] for c in s['checkpointed']])} | {len(s['checkpointed'])} |",
         ""]
    if s.get("target") is not None:
        L.append(f"**Target: median seconds lost ≤ 2 × (one rank process's start + one step) = "
                 f"2 × ({s['start']:.2f} + {s['step']:.3f}) = {s['target']:.2f} s: "
                 f"{'met' if s['met'] else 'missed'}** ({_f(s['lost'])} s, "
                 f"{s['lost'] / s['target']:.2f}× the target).\n")
    if s["back_in"] is not None and s["start"] is not None:
        gone = med([k["old_gone_at"] - k["killed_at"] for k in s["recovered"]
                    if k.get("old_gone_at") is not None])
        L.append(f"Where the seconds go: from the kill to the restarted ranks' first step "
                 f"{s['back_in']:.2f} s (median), the step being redone after it. The other "
                 "ranks leave on the recovery notice"
                 + (f" (the last of the old processes gone {gone:.2f} s after the kill)"
                    if gone is not None else "")
                 + ", and all four start again (spares forked with the ranks) and attach to the "
                 f"state their daemons kept; a start of the whole job is {s['start']:.2f} s (below: it "
                 "also holds the launcher's start and the job's creation).")
        if s["lost_checkpoint"] is not None:
            loads = [c["load_seconds"] for c in s["checkpointed"] if c["resumed_from"]]
            L[-1] += (" Checkpoint-and-restart starts every rank again too, and adds the load "
                      + (f"({med(loads):.3f} s, median) " if loads else "")
                      + f"and the steps since the checkpoint ({s['step']:.3f} s each): its "
                      f"median is {abs(s['lost_checkpoint'] - s['lost']):.2f} s "
                      f"{'more' if s['lost_checkpoint'] > s['lost'] else 'less'} than "
                      "recovery in place's.")
        L[-1] += "\n"
    if s.get("ratio") is not None:
        L.append(f"**Step time with the optimizer state in the pool and each step journaled "
                 f"(`--max-restarts 1`): {s['ratio']:.3f}× the step without restarts "
                 f"({s['moved'] * 1e3:+.1f} ms); "
                 f"{'within noise' if s['within_noise'] else 'not within noise'}** (noise: the "
                 f"larger of 5 % of the step, {NOISE_FLOOR * med(s['without']) * 1e3:.1f} ms, "
                 f"and the runs' spread, {s['spread'] * 1e3:.1f} ms).\n")
    L.append("![seconds lost per failure, and the step time](recovery.png)\n")
    L += ["## Recovery in place\n",
          "Each trial kills one rank with SIGKILL (`train_tiny.py --kill-at "
          "RANK:STEP:PHASE:MARK`: the rank kills itself in the forward, in the backward, "
          "inside the optimizer step after its first update, or after `zero_grad`), rank, step "
          "and phase drawn from a "
          f"seeded RNG (seed {doc['seed']}; the phases in shuffled blocks of four, so that every "
          "phase comes up). The launcher restarts the killed rank, the other three exit on "
          "their daemons' recovery notice and are restarted too, every rank attaches again to "
          "the state its daemon kept and the job goes on from the last step every rank "
          "completed. Noticed: from the kill to the last of the launcher's line that the rank "
          "exited with -9 and the other ranks' lines that they leave on the recovery notice. All "
          "gone: from the kill to the exit of the last of the rank processes from before it "
          f"(the launcher's children, sampled every {WATCH_S * 1e3:.0f} ms). "
          "Seconds lost: the trial's wall time minus the median wall time of the "
          f"uninterrupted runs with `--max-restarts 1` ({_f(s['base_restarts'])} s, "
          f"{span([u['wall'] for u in ok(doc['rounds'], 'restarts')])} over "
          f"{len(ok(doc['rounds'], 'restarts'))} runs). Back in training: from the kill to the "
          "restarted ranks starting their first step (rank 0's line for that step, printed "
          "after it, less its seconds). Δ: the largest |difference| of any final parameter "
          f"against the same round's uninterrupted run (bound {PARAM_ATOL:g}).\n",
          "| trial | rank | step | phase | resumed at step | noticed (s) | all gone (s) "
          "| back in training (s) | wall (s) | seconds lost | max abs Δ | others (cores) |",
          "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for i, r in enumerate(doc["rounds"]):
        k = r.get("recovered", {})
        if "error" in k or not k:
            continue
        noticed = max([k["noticed_at"]] + k.get("notices_at", [])) - k["killed_at"] \
            if k.get("noticed_at") is not None else None
        gone = k["old_gone_at"] - k["killed_at"] if k.get("old_gone_at") is not None else None
        L.append(f"| {i + 1} | {k['rank']} | {k['step']} | {k['phase']} | {k['first_step']} | "
                 f"{_f(noticed)} | {_f(gone)} | {_f(k.get('back_in'))} | {k['wall']:.2f} | "
                 f"{k['lost']:.2f} | {k['max_abs_diff']:.1e} | {_f(k.get('others_cores'))} |")
    phases = {p: [k for k in s["recovered"] if k["phase"] == p] for p in PHASE_COLORS}
    if any(phases.values()):
        L.append("\nBy the phase of the kill, medians: " + "; ".join(
            f"{p} ({len(ks)}): {med([k['lost'] for k in ks]):.2f} s lost, back in training "
            f"{_f(med([k['back_in'] for k in ks if 'back_in' in k]))} s"
            for p, ks in phases.items() if ks) + ".")
    worst = max([k["max_abs_diff"] for k in s["recovered"]], default=None)
    if worst is not None:
        L.append(f"\nLargest |Δ| over the trials: {worst:.1e} "
                 f"({'within' if worst <= PARAM_ATOL else '**over**'} {PARAM_ATOL:g}).\n")
    L += ["## Checkpoint and restart\n",
          f"The same kills (round by round the same rank, step and phase) in a job that saves a "
          f"checkpoint after every {doc['save_every']}th step (`--save DIR --save-step "
          f"{doc['saves']}`, ragshard's own format) and has no restarts: the launcher stops the "
          "other ranks and fails. A second launch, a job of its own created again, starts all "
          "four ranks with `--resume DIR` (the newest checkpoint; from the start where none was "
          "saved yet), loads, redoes the steps since the checkpoint and saves on. Seconds lost: "
          "both launches' wall times minus the median wall time of the uninterrupted runs that "
          f"save the same checkpoints ({_f(s['base_saved'])} s, "
          f"{span([u['wall'] for u in ok(doc['rounds'], 'saved')])} over "
          f"{len(ok(doc['rounds'], 'saved'))} runs), so that the saves are not counted as lost. "
          "Δ against the same round's uninterrupted run that saves.\n",
          "| trial | rank | step | phase | resumed from checkpoint of step | failed launch (s) "
          "| of it after the kill (s) | second launch (s) | load (s) | seconds lost "
          "| max abs Δ | others (cores) |",
          "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for i, r in enumerate(doc["rounds"]):
        c = r.get("checkpointed", {})
        if "error" in c or not c:
            continue
        L.append(f"| {i + 1} | {c['rank']} | {c['step']} | {c['phase']} | "
                 f"{c['resumed_from'] or '— (none yet)'} | {c['walls'][0]:.2f} | "
                 f"{c['walls'][0] - c['killed_at']:.2f} | "
                 f"{c['walls'][1]:.2f} | {c['load_seconds']:.3f} | {c['lost']:.2f} | "
                 f"{c['max_abs_diff']:.1e} | {_f(c.get('others_cores'))} |")
    saves = [x for u in ok(doc["rounds"], "saved") for x in u["save_seconds"]]
    if saves:
        L.append(f"\nA save took {med(saves):.3f} s (median of {len(saves)}, "
                 f"{span(saves, '{:.3f}')}) in the uninterrupted runs that save.\n")
    L += ["## The cost of a start and of a step\n",
          "One rank process's start: in each uninterrupted run with `--max-restarts 1`, from "
          "the launch to rank 0's first step: the time of rank 0's line `step 1/N` (printed "
          "once step 1 is done) less that step's own seconds. It holds the launcher's start and "
          "the job's creation (the launcher's torch import included), and 4 ranks starting at "
          "once on the machine's cores (each forked from it, connecting, attaching and "
          "sharding the model). A step: the median, over those runs, "
          "of each run's median step (slowest rank, the first two steps left out).\n",
          "| | median (s) | min–max (s) | runs |", "|---|---:|---:|---:|",
          f"| start (launch to the first step) | {_f(s['start'])} | {span(s['starts'])} | "
          f"{len(s['starts'])} |",
          f"| one step | {_f(s['step'], '{:.3f}')} | "
          f"{span([med(u['slowest_steps']) for u in ok(doc['rounds'], 'restarts')], '{:.3f}')}"
          f" | {len(ok(doc['rounds'], 'restarts'))} |",
          f"| target: 2 × (start + step) | {_f(s.get('target'))} | | |",
          "",
          f"The rest of an uninterrupted run's wall time, after its last step (gathering the "
          f"final parameters, writing them, the ranks' and the launcher's exit), is "
          f"{_f(s['teardown'])} s (median).\n",
          "## Step time: optimizer state in the pool, each step journaled\n",
          f"The first {doc['reps']} rounds' uninterrupted runs with `--max-restarts 1` (optimizer "
          "state in the daemons' pools, each step journaled: undo copies, begin and commit "
          "marks) against those without restarts, alternated. Each run's figure: its median "
          "step (slowest rank), the first two steps left out.\n",
          "| | median of the runs' medians (s) | min–max (s) | runs |",
          "|---|---:|---:|---:|",
          f"| `--max-restarts 1` | {_f(med(s['with']), '{:.4f}')} | "
          f"{span(s['with'], '{:.4f}')} | {n_with} |",
          f"| no restarts | {_f(med(s['without']), '{:.4f}')} | "
          f"{span(s['without'], '{:.4f}')} | {n_without} |",
          ""]
    if s.get("ratio") is not None:
        L.append(f"Within noise means: the median moved by less than the larger of "
                 f"{NOISE_FLOOR:.0%} and the repetitions' spread (the larger max − min of the "
                 f"two sets). It moved {abs(s['moved']) * 1e3:.1f} ms "
                 f"({abs(s['ratio'] - 1):.1%}) against {s['noise'] * 1e3:.1f} ms: "
                 f"{'within noise' if s['within_noise'] else 'not within noise'}.\n")
    same = [r["plain"]["max_abs_diff_restarts"] for r in doc["rounds"]
            if "plain" in r and "max_abs_diff_restarts" in r["plain"]]
    if same:
        L.append(f"The runs without restarts end with the same parameters as those with "
                 f"(largest |Δ| {max(same):.1e}).\n")
    bad = failures(doc["rounds"])
    if bad:
        L.append("## Failed runs\n")
        for i, kind, err in bad:
            L.append(f"- round {i}, {kind}: `{' '.join(err.split())[:600]}`")
        L.append("")
    if doc.get("rank_from"):
        old = doc["rank_from"]
        L.append(f"The sections above (a lost rank) are from an earlier run, `{old['command']}`, "
                 f"started {old['started']} ({' '.join(old.get('provenance') or [])}); the "
                 "node-loss section below is this run's.\n")
    if "node" in doc:
        node_lines, s["node"] = recovery_node_render.lines(doc, out)
        L += node_lines
    commands = dict(doc["commands"], **{f"node {k}": v for k, v in
                                         doc.get("node", {}).get("commands", {}).items()})
    L += ["## Reproduce\n",
          "```\n" + "\n".join(f"{k}: {v}" for k, v in commands.items()) + "\n```\n",
          "(one command of each kind as run; the planner address, the sockets and the paths are "
          "those of that run.) The whole report:\n",
          "```\n.venv/bin/python bench/recovery_report.py --build build\n```\n"]
    kept = report_sections.carried(out)  # another script's sections (bench/chaos_hosts.py)
    provenance.write(out, "\n".join(L).rstrip() + "\n" + ("\n" + kept if kept else ""),
                     doc.get("provenance"))
    return s
