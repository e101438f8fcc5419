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

Each run is on a fresh LocalCluster (3 GiB pools); the launches use --preload (forked ranks,
as ragshard-launch does for restarts). Writes OUT.json (the runs) and, with --report, the
markdown and its plot.

    .venv/bin/python bench/recovery_lost.py --build build --work /tmp/rl --rounds 3 \\
        --json /tmp/rl.json --report docs/benchmarks/recovery_lost
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
from recovery_runs import ROOT, Launch, sh  # noqa: E402

KINDS = ("ref-restarts", "in-place", "ref-checkpoint", "checkpoint")
NAMES = {"in-place": "recovered in place (`--max-restarts 1`)",
         "checkpoint": "checkpoint-and-restart (DCP after step C, a second launch)"}


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
    daemons, per_node = (int(x) for x in a.layout.split("x"))
    world = daemons * per_node
    job = f"rl{r}-{kind}-{int(time.time())}"
    out = os.path.join(a.work, job)
    ckpt = os.path.join(a.work, job + ".dcp")
    kill = ["--kill-at", f"1:{a.kill_step}:forward:{out}.killed"]
    save = ["--save-dcp", ckpt, "--save-after", str(a.checkpoint_step)]
    launches = []
    with LocalCluster(a.build, daemons=daemons, pool_bytes=a.pool_gib << 30) as c:
        if kind == "ref-restarts":
            launches.append(launch(a, c, job, world, ["--max-restarts", "1"], ["--out", out]))
        elif kind == "in-place":
            launches.append(launch(a, c, job, world, ["--max-restarts", "1"],
                                   ["--out", out] + kill))
        elif kind == "ref-checkpoint":
            launches.append(launch(a, c, job, world, [], ["--out", out] + save))
        else:  # the failed launch, then the resumed one
            launches.append(launch(a, c, job, world, [], ["--out", out + "-failed"] + save + kill))
            launches.append(launch(a, c, job + "-resumed", world, [],
                                   ["--out", out, "--load-dcp", ckpt]))
    codes = [run.code for run, _ in launches]
    want = [1 if kind == "checkpoint" else 0] + ([0] if kind == "checkpoint" else [])
    if [code != 0 for code in codes] != [w != 0 for w in want]:
        raise RuntimeError(f"{job}: exit codes {codes}, expected {want}:\n{launches[-1][0].tail()}")
    if kind in ("in-place", "checkpoint") and not os.path.exists(out + ".killed"):
        raise RuntimeError(f"{job}: rank 1 was not killed")
    main = json.load(open(out + ".json"))
    return {"kind": kind, "round": r, "job": job, "walls": [run.wall for run, _ in launches],
            "wall": sum(run.wall for run, _ in launches), "codes": codes,
            "commands": [cmd for _, cmd in launches], "first_step": main["first_step"],
            "losses": main["losses"], "checksums": main["checksums"],
            "median_step": statistics.median(main["step_seconds"])}


def figures(runs):
    by = {k: [r for r in runs if r["kind"] == k] for k in KINDS}
    out = {}
    for kind, ref in (("in-place", "ref-restarts"), ("checkpoint", "ref-checkpoint")):
        base = statistics.median(r["wall"] for r in by[ref])
        lost = [r["wall"] - base for r in by[kind]]
        out[kind] = {"reference_wall": base, "lost": lost, "median": statistics.median(lost),
                     "low": min(lost), "high": max(lost),
                     "reference_spread": max(r["wall"] for r in by[ref]) -
                     min(r["wall"] for r in by[ref]),
                     "step": statistics.median(r["median_step"] for r in by[ref])}
    return out


def report(doc, path):
    runs, a = doc["runs"], doc["args"]
    f = figures(runs)
    # The same final parameters: a recovery changes nothing of the training.
    same = {k: all(r["checksums"] == next(x for x in runs if x["kind"] == ref)["checksums"]
                   for r in runs if r["kind"] == k)
            for k, ref in (("in-place", "ref-restarts"), ("checkpoint", "ref-checkpoint"))}
    lines = [
        "# A lost rank on a 105 M-parameter model: recovered in place against "
        "checkpoint-and-restart", ""] + list(doc["provenance"]) + ["",
        "Run by `bench/recovery_lost.py`, every figure from that one run. Machine: "
        f"{doc['machine']}. The model: bench/recovery_cost.py's (examples/train_hf.py's Llama, "
        "hidden 768, 14 layers, about 105 M parameters, fp32 AdamW, 2 sequences of 128 per "
        f"rank), {a['layout']} (daemons x ranks), {a['steps']} steps; rank 1 SIGKILLed as step "
        f"{a['kill_step']} starts. The checkpoint is written after step {a['checkpoint_step']}. "
        f"{a['rounds']} alternated rounds of the four kinds of run, each on a fresh LocalCluster.",
        "", "Seconds lost: a run's wall time (both launches' for checkpoint-and-restart) less the "
        "median wall time of the uninterrupted runs of its kind (with `--max-restarts 1`; with "
        "the same checkpoint written).", "",
        "| failure handled by | seconds lost, median | min–max | runs | uninterrupted run (s) "
        "| its spread (s) | a step (s) | final parameters as uninterrupted |",
        "|---|---:|---:|---:|---:|---:|---:|---|"]
    for k in ("in-place", "checkpoint"):
        x = f[k]
        lines.append(f"| {NAMES[k]} | {x['median']:.1f} | {x['low']:.1f}–{x['high']:.1f} | "
                     f"{len(x['lost'])} | {x['reference_wall']:.1f} | "
                     f"{x['reference_spread']:.1f} | {x['step']:.2f} | "
                     f"{'yes (checksums equal)' if same[k] else 'NO'} |")
    ratio = f["checkpoint"]["median"] / f["in-place"]["median"] if f["in-place"]["median"] > 0 \
        else float("inf")
    lines += ["", f"Checkpoint-and-restart lost {ratio:.1f}x the seconds of the recovery in "
              "place (medians). What the checkpoint's run redoes: the steps after the "
              "checkpoint, a new launch (interpreters, the model's construction, registration) "
              "and the checkpoint's load; the recovery in place redoes the step the rank died "
              "in and restarts the ranks from forked spares.", "",
              "One command of each kind, as run:", ""]
    for k in KINDS:
        r = next(x for x in runs if x["kind"] == k)
        for cmd in r["commands"]:
            lines += ["```", cmd, "```", ""]
    lines += [f"![seconds lost per failure]({os.path.basename(path)}.png)", ""]
    with open(path + ".md", "w") as out:
        out.write("\n".join(lines))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for i, k in enumerate(("in-place", "checkpoint")):
        ax.bar(i, f[k]["median"], color=("tab:green", "tab:red")[i])
        ax.scatter([i] * len(f[k]["lost"]), f[k]["lost"], color="black", s=12, zorder=3)
    ax.set_xticks([0, 1], ["in place", "checkpoint-and-restart"])
    ax.set_ylabel("seconds lost per failure")
    ax.set_title(f"a lost rank, 105 M Llama, {a['layout']}")
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
    p.add_argument("--json", default="")
    p.add_argument("--report", default="", help="write REPORT.md and REPORT.png")
    p.add_argument("--from-json", default="", help="only the report, from these runs")
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
    doc = {"provenance": a.provenance, "machine": f"{os.cpu_count()} cores, "
           f"{platform.platform()}, Python {platform.python_version()}",
           "args": {k: getattr(a, k) for k in ("layout", "rounds", "steps", "kill_step",
                                               "checkpoint_step")}, "runs": []}
    for r in range(a.rounds):
        for kind in KINDS:
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
