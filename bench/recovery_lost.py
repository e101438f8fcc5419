"""What a lost rank costs on a real model (issue: recovery where people train, item 5), recovered
in place against checkpoint-and-restart, in alternated rounds of one run on this machine:
examples/train_hf.py's Llama of bench/recovery_cost.py (about 105 M parameters) at D daemons x R
ranks, --steps N, rank 1 SIGKILLed as step K starts (train_hf.py --kill-at).

* in place: `ragshard-launch --max-restarts 1`; the launcher restarts the rank, the others leave
  on their daemons' notice and are restarted too, and the job goes on from step K - 1 with the
  state the daemons kept. Seconds lost: the run's wall time less the median of uninterrupted
  runs with --max-restarts 1, alternated with it.
* checkpoint-and-restart: a job that writes a DCP checkpoint after step C (< K) and has no
  restarts: the launch fails when the rank dies, and a second launch (a job of its own, on the
  same daemons) resumes every rank from the checkpoint (--load-dcp) and redoes the steps after
  C. Seconds lost: both launches' wall time less the median of uninterrupted runs that write
  the same checkpoint, alternated with them.

With --sections node, the same for a lost node at 3 daemons x 2 ranks: node 1's daemon and both
its ranks killed (SIGKILL) as step K starts (train_hf.py --hold-at), and a replacement daemon
with its id started at once (the planner's node timeout 2 s):

* in place: `--max-restarts 1 --redundancy replica`; the replacement rebuilds the node's state
  from the other nodes' copies and the job goes on from step K - 1. Against uninterrupted runs
  with the same flags.
* checkpoint-and-restart: the launch fails; a second launch resumes from the checkpoint on the
  replacement and the others. Against uninterrupted runs that write the same checkpoint.

Each run is on a fresh LocalCluster (3 GiB pools); the launches use --preload (forked ranks,
as ragshard-launch does for restarts). Writes OUT.json (the runs; --merge OLD.json keeps OLD's
runs of the sections not run now) and, with --report, the markdown and its plot.

    .venv/bin/python bench/recovery_lost.py --build build --work /tmp/rl --rounds 3 \\
        --json /tmp/rl.json --report docs/benchmarks/recovery_lost
    .venv/bin/python bench/recovery_lost.py --build build --work /tmp/rn --sections node \\
        --merge /tmp/rl.json --json /tmp/rn.json --report docs/benchmarks/recovery_lost
    .venv/bin/python bench/recovery_lost.py --from-json /tmp/rl.json \\
        --report docs/benchmarks/recovery_lost
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import provenance  # noqa: E402
from recovery_cost import EXAMPLE, MODEL, PRELOAD, SEQUENCES_PER_RANK  # noqa: E402
from recovery_node import _NodeKiller  # noqa: E402
from recovery_runs import ROOT, Launch, sh  # noqa: E402

SECTIONS = {"rank": ("ref-restarts", "in-place", "ref-checkpoint", "checkpoint"),
            "node": ("node-ref-replica", "node-in-place", "node-ref-checkpoint",
                     "node-checkpoint")}
KINDS = SECTIONS["rank"] + SECTIONS["node"]
# Each fault's kind and the uninterrupted runs it is measured against.
PAIRS = {"in-place": "ref-restarts", "checkpoint": "ref-checkpoint",
         "node-in-place": "node-ref-replica", "node-checkpoint": "node-ref-checkpoint"}
NAMES = {"in-place": "a rank, recovered in place (`--max-restarts 1`)",
         "checkpoint": "a rank, checkpoint-and-restart (DCP after step C, a second launch)",
         "node-in-place": "a node, rebuilt in place on a replacement "
                          "(`--max-restarts 1 --redundancy replica`)",
         "node-checkpoint": "a node, checkpoint-and-restart on a replacement (DCP after step C, "
                            "a second launch)"}
NODE_LAYOUT = "3x2"
NODE_TIMEOUT_MS = 2000  # the planner's heartbeat timeout (as bench/recovery_node.py)


def launch(a, c, job, world, extra_launch, extra_train):
    env = dict(os.environ, PYTHONPATH=os.path.join(a.build, "python"))
    env.pop("OMP_NUM_THREADS", None)
    cmd = [sys.executable, "-m", "ragshard.launch", "--preload", PRELOAD, "--planner",
           c.planner, "--job", job, "--nproc", str(world), "--sockets", ",".join(c.sockets),
           "--create-job"] + extra_launch + [
           EXAMPLE, "--backend", "ragshard", "--steps", str(a.steps),
           "--global-batch", str(SEQUENCES_PER_RANK * world)] + MODEL + extra_train
    run = Launch(cmd, env, a.timeout)
    with open(os.path.join(a.work, job + ".log"), "w") as f:
        f.writelines(f"{t:9.3f} {text}\n" for t, text in run.lines)
    return run, sh(cmd).replace(ROOT + os.sep, "")


def one(a, kind, r):
    from ragshard.cluster import LocalCluster
    node = kind.startswith("node-")
    daemons, per_node = (int(x) for x in (NODE_LAYOUT if node else a.layout).split("x"))
    world = daemons * per_node
    job = f"rl{r}-{kind}-{int(time.time())}"
    out = os.path.join(a.work, job)
    ckpt = os.path.join(a.work, job + ".dcp")
    save = ["--save-dcp", ckpt, "--save-after", str(a.checkpoint_step)]
    if node:  # node 1's ranks held as step K starts, killed with their daemon
        marks = [f"{out}.hold{per_node + i}" for i in range(per_node)]
        fault = [f"--hold-at={per_node + i}:{a.kill_step}:forward:{m}"
                 for i, m in enumerate(marks)]
        restarts = ["--max-restarts", "1", "--recovery-deadline", "60", "--redundancy",
                    "replica"]
    else:
        fault = ["--kill-at", f"1:{a.kill_step}:forward:{out}.killed"]
        restarts = ["--max-restarts", "1"]
    if a.steps_per_commit > 1:  # (docs/recovery.md, "Steps per commit")
        restarts += ["--steps-per-commit", str(a.steps_per_commit)]
    faulty = kind in ("in-place", "checkpoint", "node-in-place", "node-checkpoint")
    launches, killer = [], None
    extra = {"node_timeout_ms": NODE_TIMEOUT_MS} if node else {}
    with LocalCluster(a.build, daemons=daemons, pool_bytes=a.pool_gib << 30, **extra) as c:
        if node and faulty:
            killer = _NodeKiller(c, 1, marks, a.timeout, f"-{job}")
            killer.start()
        if kind in ("ref-restarts", "node-ref-replica"):
            launches.append(launch(a, c, job, world, restarts, ["--out", out]))
        elif kind in ("in-place", "node-in-place"):
            launches.append(launch(a, c, job, world, restarts, ["--out", out] + fault))
        elif kind in ("ref-checkpoint", "node-ref-checkpoint"):
            launches.append(launch(a, c, job, world, [], ["--out", out] + save))
        else:  # the failed launch, then the resumed one
            launches.append(launch(a, c, job, world, [], ["--out", out + "-failed"] + save +
                                   fault))
            if killer is not None:  # the replacement is up before the second launch
                killer.join(timeout=60)
            launches.append(launch(a, c, job + "-resumed", world, [],
                                   ["--out", out, "--load-dcp", ckpt]))
        if killer is not None:
            killer.stop.set()
            killer.join(timeout=60)
    codes = [run.code for run, _ in launches]
    failing = kind in ("checkpoint", "node-checkpoint")
    want = [1, 0] if failing else [0]
    if [code != 0 for code in codes] != [w != 0 for w in want]:
        raise RuntimeError(f"{job}: exit codes {codes}, expected {want}:\n{launches[-1][0].tail()}")
    if faulty and (killer.killed is None if killer is not None else
                   not os.path.exists(out + ".killed")):
        raise RuntimeError(f"{job}: the fault did not happen"
                           f"{': ' + str(killer.error) if killer is not None else ''}")
    main = json.load(open(out + ".json"))
    return {"kind": kind, "round": r, "job": job, "walls": [run.wall for run, _ in launches],
            "wall": sum(run.wall for run, _ in launches), "codes": codes,
            "commands": [cmd for _, cmd in launches], "first_step": main["first_step"],
            "losses": main["losses"], "checksums": main["checksums"],
            "median_step": statistics.median(main["step_seconds"])}


def figures(runs):
    by = {k: [r for r in runs if r["kind"] == k] for k in KINDS}
    out = {}
    for kind, ref in PAIRS.items():
        if not by[kind] or not by[ref]:
            continue
        base = statistics.median(r["wall"] for r in by[ref])
        lost = [r["wall"] - base for r in by[kind]]
        out[kind] = {"reference_wall": base, "lost": lost, "median": statistics.median(lost),
                     "low": min(lost), "high": max(lost),
                     "reference_spread": max(r["wall"] for r in by[ref]) -
                     min(r["wall"] for r in by[ref]),
                     "step": statistics.median(r["median_step"] for r in by[ref])}
    return out


def sectioned(doc):
    """A document of this script's: {"sections": {name: {"provenance", "machine", "args"}},
    "runs"}; one written before the node section (its fields at the top) is the rank section."""
    if "sections" in doc:
        return doc
    return {"sections": {"rank": {k: doc[k] for k in ("provenance", "machine", "args")}},
            "runs": doc["runs"]}


def _section_lines(name, sec, f, same):
    a = sec["args"]
    if name == "rank":
        what = (f"{a['layout']} (daemons x ranks), {a['steps']} steps; rank 1 SIGKILLed as step "
                f"{a['kill_step']} starts")
        faults = ("in-place", "checkpoint")
    else:
        what = (f"{NODE_LAYOUT} (daemons x ranks), {a['steps']} steps; node 1 lost as step "
                f"{a['kill_step']} starts (its daemon and both its ranks SIGKILLed, a "
                f"replacement daemon with its id started at once; the planner's node timeout "
                f"{NODE_TIMEOUT_MS / 1000:g} s)")
        faults = ("node-in-place", "node-checkpoint")
    lines = [f"## A lost {name}", ""] + list(sec["provenance"]) + ["",
             f"Machine: {sec['machine']}. {what}. The checkpoint is written after step "
             f"{a['checkpoint_step']}."
             + (f" The runs recovering in place journal and protect once every "
                f"{a['steps_per_commit']} steps (`--steps-per-commit "
                f"{a['steps_per_commit']}`): a loss goes back to the start of the "
                f"{a['steps_per_commit']} under way." if a.get("steps_per_commit", 1) > 1
                else "")
             + f" {a['rounds']} alternated rounds of the four kinds of run, "
             "each on a fresh LocalCluster.", "",
             "| failure handled by | seconds lost, median | min–max | runs | uninterrupted run "
             "(s) | its spread (s) | a step (s) | final parameters as uninterrupted |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for k in faults:
        if k not in f:
            continue
        x = f[k]
        lines.append(f"| {NAMES[k]} | {x['median']:.1f} | {x['low']:.1f}–{x['high']:.1f} | "
                     f"{len(x['lost'])} | {x['reference_wall']:.1f} | "
                     f"{x['reference_spread']:.1f} | {x['step']:.2f} | "
                     f"{'yes (checksums equal)' if same[k] else 'NO'} |")
    if all(k in f for k in faults) and f[faults[0]]["median"] > 0:
        ratio = f[faults[1]]["median"] / f[faults[0]]["median"]
        lines += ["", f"Checkpoint-and-restart lost {ratio:.1f}x the seconds of the recovery "
                  "in place (medians)."]
    return lines + [""]


def report(doc, path):
    doc = sectioned(doc)
    runs = doc["runs"]
    f = figures(runs)
    # The same final parameters: a recovery changes nothing of the training.
    same = {k: all(r["checksums"] == next(x for x in runs if x["kind"] == ref)["checksums"]
                   for r in runs if r["kind"] == k)
            for k, ref in PAIRS.items() if k in f}
    lines = ["# Seconds lost per failure on a 105 M-parameter model: recovered in place against "
             "checkpoint-and-restart", "",
             "Run by `bench/recovery_lost.py`; every figure of a section from one run of it. The "
             "model: bench/recovery_cost.py's (examples/train_hf.py's Llama, hidden 768, 14 "
             "layers, about 105 M parameters, fp32 AdamW, 2 sequences of 128 per rank).", "",
             "Seconds lost: a run's wall time (both launches' for checkpoint-and-restart) less "
             "the median wall time of the uninterrupted runs of its kind (with the same "
             "recovery flags; with the same checkpoint written). What the checkpoint's run "
             "redoes: the steps after the checkpoint, a new launch (interpreters, the model's "
             "construction, registration) and the checkpoint's load; the recovery in place "
             "redoes the step the failure fell in, restarts the ranks from forked spares and, "
             "for a node, rebuilds its state on the replacement from the other nodes' copies.",
             ""]
    for name in ("rank", "node"):
        if name in doc["sections"]:
            lines += _section_lines(name, doc["sections"][name], f, same)
    lines += ["One command of each kind, as run:", ""]
    for k in KINDS:
        r = next((x for x in runs if x["kind"] == k), None)
        for cmd in (r["commands"] if r else []):
            lines += ["```", cmd, "```", ""]
    lines += [f"![seconds lost per failure]({os.path.basename(path)}.png)", ""]
    with open(path + ".md", "w") as out:
        out.write("\n".join(lines))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shown = [k for k in PAIRS if k in f]
    fig, ax = plt.subplots(figsize=(7, 3.4))
    for i, k in enumerate(shown):
        ax.bar(i, f[k]["median"], color="tab:red" if "checkpoint" in k else "tab:green")
        ax.scatter([i] * len(f[k]["lost"]), f[k]["lost"], color="black", s=12, zorder=3)
    labels = {"in-place": "rank: in place", "checkpoint": "rank: checkpoint",
              "node-in-place": "node: in place", "node-checkpoint": "node: checkpoint"}
    ax.set_xticks(range(len(shown)), [labels[k] for k in shown])
    ax.set_ylabel("seconds lost per failure")
    ax.set_title("105 M Llama: a lost rank (2x2), a lost node (3x2)")
    fig.tight_layout()
    fig.savefig(path + ".png", dpi=120)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build")
    p.add_argument("--work")
    p.add_argument("--layout", default="2x2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--kill-step", type=int, default=5)
    p.add_argument("--checkpoint-step", type=int, default=2)
    p.add_argument("--pool-gib", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--steps-per-commit", type=int, default=1,
                   help="the in-place runs' ragshard-launch --steps-per-commit")
    p.add_argument("--json", default="")
    p.add_argument("--report", default="", help="write REPORT.md and REPORT.png")
    p.add_argument("--from-json", default="", help="only the report, from these runs")
    p.add_argument("--sections", default="rank", help="rank, node or rank,node")
    p.add_argument("--merge", default="", help="keep this JSON's runs of the other sections")
    provenance.add_flag(p)
    a = p.parse_args()
    if a.from_json:
        doc = json.load(open(a.from_json))
        if a.report:
            report(doc, a.report)
        return
    if not (a.build and a.work):
        p.error("--build and --work are needed (or --from-json)")
    if not 0 < a.checkpoint_step < a.kill_step <= a.steps:
        p.error("need 0 < --checkpoint-step < --kill-step <= --steps")
    provenance.require(a)
    sys.path.insert(0, os.path.join(os.path.abspath(a.build), "python"))
    os.makedirs(a.work, exist_ok=True)
    sections = a.sections.split(",")
    if any(x not in SECTIONS for x in sections):
        p.error(f"--sections {a.sections}: each one of {', '.join(SECTIONS)}")
    doc = {"sections": {}, "runs": []}
    if a.merge:
        old = sectioned(json.load(open(a.merge)))
        doc["sections"] = {k: v for k, v in old["sections"].items() if k not in sections}
        doc["runs"] = [r for r in old["runs"] if r["kind"] not in
                       sum((SECTIONS[x] for x in sections), ())]
    for name in sections:
        doc["sections"][name] = {
            "provenance": a.provenance, "machine": f"{os.cpu_count()} cores, "
            f"{platform.platform()}, Python {platform.python_version()}",
            "args": {k: getattr(a, k) for k in ("layout", "rounds", "steps", "kill_step",
                                                "checkpoint_step", "steps_per_commit")}}
    for r in range(a.rounds):
        for name in sections:
            for kind in SECTIONS[name]:
                run = one(a, kind, r)
                doc["runs"].append(run)
                print(json.dumps({k: run[k] for k in ("kind", "round", "walls", "first_step")}),
                      flush=True)
                if a.json:
                    with open(a.json, "w") as f:
                        json.dump(doc, f, indent=1)
    if a.report:
        report(doc, a.report)


if __name__ == "__main__":
    main()
