"""What a lost rank costs with recovery in place (issue 54), against checkpoint-and-restart, in
one run on this machine: examples/train_tiny.py at 2 daemons x 2 ranks, a rank killed with
SIGKILL at a random step and phase

* recovered in place under ragshard.launch --max-restarts 1: seconds lost against the median of
  uninterrupted runs with --max-restarts 1, and the final parameters against the uninterrupted
  run's (|delta| <= 1e-6);
* in a job that saves a checkpoint every N steps and has no restarts: the launch fails, and a
  second launch (a job of its own) resumes all ranks from the newest checkpoint; seconds lost
  against uninterrupted runs that save the same checkpoints;

one rank process's start and one step (the issue's target: median seconds lost <= 2 x (start
+ step)), and the step time with --max-restarts 1 (optimizer state in the pool, each step
journaled) against without, alternated. Then a lost node (issue 55; bench/recovery_node.py) at 3
daemons x 2 ranks: the memory of --redundancy parity:2 and replica against the state they
protect, their step time against --redundancy none, alternated, and the seconds a node's loss
costs rebuilt on a replacement daemon against checkpoint-and-restart. Writes
docs/benchmarks/recovery.md, recovery.png and recovery_node.png; the figures go to
WORK/runs.json, from which --from-json writes the report again.

    .venv/bin/python bench/recovery_report.py --build build     # ~12 min on a quiet machine
    .venv/bin/python bench/recovery_report.py --build build --trials 1 --reps 1 --steps 6 \\
        --allow-dirty --out /tmp/recovery.md                               # a smoke run
    .venv/bin/python bench/recovery_report.py --from-json WORK/runs.json
    .venv/bin/python bench/recovery_report.py --build build --sections node \
        --rank-from OLD/runs.json        # the node-loss runs only; the rank figures from OLD

The runs are bench/recovery_runs.py, the report and its plot bench/recovery_render.py.
"""
import argparse
import datetime
import json
import os
import platform
import random
import shlex
import shutil
import signal
import sys
import tempfile
import time

import provenance
from recovery_render import render
from recovery_node import REPLICAS, SCHEMES, SHRINK_DEADLINE, NodeRunner, node_kills
from recovery_runs import ROOT, Runner, RunFailed, max_abs_diff

# The report's model: a step of about 0.1 s at 2 daemons x 2 ranks on a 2-core machine.
MODEL = ["--layers", "4", "--dim", "128", "--seq", "64", "--batch", "4"]
PHASES = ["forward", "backward", "step", "between"]


def kills(trials, steps, seed):
    """Each trial's (rank, step, phase): the phases in shuffled blocks of four."""
    rng = random.Random(seed)
    out, phases = [], []
    for _ in range(trials):
        if not phases:
            phases = rng.sample(PHASES, len(PHASES))
        out.append((rng.randrange(4), rng.randint(1, steps), phases.pop()))
    return out


def machine():
    cpu = "unknown CPU"
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                   if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{os.cpu_count()} cores ({cpu}), {platform.platform()}"


def command():
    exe = os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(ROOT) \
        else sys.executable
    return " ".join(shlex.quote(a) for a in [exe, os.path.relpath(os.path.abspath(sys.argv[0]),
                                                                  ROOT)] + sys.argv[1:])


def attempt(results, kind, what, fn, *args):
    """results[kind] = fn(*args), or {"error": ...} where the run failed (the report lists it)."""
    print(f"+ {what}", file=sys.stderr, flush=True)
    try:
        results[kind] = fn(*args)
        r = results[kind]
        wall = sum(r["walls"]) if "walls" in r else r["wall"]
        print(f"  {wall:.2f} s; other processes {r['others_cores']:.2f} cores"
              + (f", after waiting {r['waited']:.0f} s for them" if r.get("waited", 0) > 3
                 else ""), file=sys.stderr, flush=True)
    except RunFailed as e:
        results[kind] = {"error": str(e)[-3000:]}
        print(f"  FAILED: {str(e)[-1500:]}", file=sys.stderr, flush=True)


def diff(results, kind, against, key="max_abs_diff"):
    a, b = results.get(kind, {}), results.get(against, {})
    if "out" in a and "out" in b:
        a[key] = max_abs_diff(a["out"], b["out"])


RANK_KEYS = ("save_every", "saves", "seed", "reps", "rounds", "commands", "quiet_wait",
             "quiet_cores", "quiet_total")


def run_node(args, build, work):
    """The node-loss runs (bench/recovery_node.py): `reps` alternated rounds of uninterrupted
    runs per redundancy, then `trials` rounds of a node lost under parity:2 and replica, an
    uninterrupted run that saves, and the same loss under checkpoints."""
    run = NodeRunner(build, work, MODEL, args.steps, args.save_every, args.recovery_deadline,
                     args.timeout, args.quiet_wait, args.quiet_cores, args.quiet_total)
    node = {"reps": args.node_reps, "trials": args.node_trials,
            "uninterrupted": {k: [] for k in SCHEMES},
            "rebuilt": {k: [] for k in ("parity:2", "replica")}, "saved": [],
            "checkpointed": [], "hsdp": [], "shrunk": [], "recut": [], "seed": args.seed,
            "commands": run.commands, "shrink_deadline": SHRINK_DEADLINE}
    t0 = time.time()

    def one(what, fn, *a):
        r = {}
        attempt(r, "x", f"node ({(time.time() - t0) / 60:.1f} min): {what}", fn, *a)
        return r["x"]

    for i in range(args.node_reps):
        for k in SCHEMES[i % 3:] + SCHEMES[:i % 3]:  # each scheme first in turn
            node["uninterrupted"][k].append(one(f"rep {i + 1}: uninterrupted, --redundancy {k}",
                                                run.uninterrupted, f"n{i}-{k[:6]}", k))
    refs = {k: next((u for u in v if "error" not in u), None)
            for k, v in node["uninterrupted"].items()}
    for i, (n, step, phase) in enumerate(node_kills(args.node_trials, args.steps, args.seed)):
        for k in ("parity:2", "replica"):
            r = one(f"trial {i + 1}: node {n} lost at step {step}, {phase}; rebuilt from {k}",
                    run.rebuilt, f"n{i}-lost-{k[:6]}", k, n, step, phase)
            if "out" in r and refs[k]:
                r["max_abs_diff"] = max_abs_diff(r["out"], refs[k]["out"])
            node["rebuilt"][k].append(r)
        saved = one(f"trial {i + 1}: uninterrupted, checkpoints every {args.save_every} steps",
                    run.uninterrupted, f"n{i}-saved", None, True)
        node["saved"].append(saved)
        c = one(f"trial {i + 1}: the same loss under checkpoints; restart, load",
                run.checkpoint_restart, f"n{i}-checkpointed", n, step, phase)
        if "out" in c and "out" in saved:
            c["max_abs_diff"] = max_abs_diff(c["out"], saved["out"])
        node["checkpointed"].append(c)
        node["hsdp"].append(one(f"trial {i + 1}: uninterrupted, --replicate {REPLICAS}",
                                run.uninterrupted, f"n{i}-hsdp", "hsdp"))
        node["shrunk"].append(one(f"trial {i + 1}: the same loss, no replacement: shrunk",
                                  run.shrunk, f"n{i}-shrunk", n, step, phase))
        node["recut"].append(one(f"trial {i + 1}: the same loss, replica, no replacement: "
                                 "re-cut", run.shrunk, f"n{i}-recut", n, step, phase, "recut"))
        for name in os.listdir(work):
            if name.endswith(".ckpt"):
                shutil.rmtree(os.path.join(work, name), ignore_errors=True)
    node["elapsed"] = time.time() - t0
    return node


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.environ.get("RAGSHARD_BUILD", "build"))
    ap.add_argument("--trials", type=int, default=8,
                    help="rounds, each with a recovery trial and a checkpoint-restart trial")
    ap.add_argument("--reps", type=int, default=5,
                    help="the first rounds that also run without restarts (the step time)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0, help="the kills' RNG")
    ap.add_argument("--recovery-deadline", type=float, default=60.0)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    ap.add_argument("--quiet-wait", type=float, default=60.0,
                    help="before each measured launch, wait up to this many seconds for the "
                         "other processes on the machine to use less than --quiet-cores (0: "
                         "do not wait)")
    ap.add_argument("--quiet-cores", type=float, default=0.3)
    ap.add_argument("--quiet-total", type=float, default=600.0,
                    help="seconds of such waiting over the whole run, at most")
    ap.add_argument("--work", default="", help="scratch directory (default: a new one in /tmp)")
    ap.add_argument("--from-json", default="", metavar="RUNS",
                    help="write the report again from an earlier run's runs.json, running "
                         "nothing")
    ap.add_argument("--sections", default="rank,node",
                    help="rank (a lost rank), node (a lost node), or both (default)")
    ap.add_argument("--rank-from", default="", metavar="RUNS",
                    help="with --sections node: the rank figures from an earlier runs.json")
    ap.add_argument("--node-reps", type=int, default=5,
                    help="alternated rounds of uninterrupted runs per redundancy")
    ap.add_argument("--node-trials", type=int, default=3,
                    help="rounds of a node lost (parity:2, replica, checkpoint-and-restart)")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "benchmarks", "recovery.md"))
    provenance.add_flag(ap)
    args = ap.parse_args()
    if args.from_json:
        doc = json.load(open(args.from_json))
        s = render(doc, args.out)
        print("wrote", args.out, file=sys.stderr)
        return 0 if s["recovered"] else 1
    if args.trials < 1 or not 1 <= args.reps <= args.trials:
        ap.error("--trials must be at least 1 and --reps between 1 and --trials")
    if args.steps < 4 or args.save_every < 1 or args.save_every > args.steps:
        ap.error("--steps: at least 4 (the step times leave out the first two); --save-every "
                 "between 1 and --steps")
    sections = set(args.sections.split(","))
    if not sections or sections - {"rank", "node"}:
        ap.error("--sections: rank, node or rank,node")
    if "rank" not in sections and not args.rank_from:
        ap.error("--sections node needs --rank-from RUNS (the report keeps the rank figures)")
    provenance.require(args)
    # SIGTERM as Ctrl-C: the launch under way and its cluster are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda signum, frame: (_ for _ in ()).throw(
        KeyboardInterrupt(f"signal {signum}")))
    build = os.path.abspath(args.build)
    sys.path.insert(0, os.path.join(build, "python"))
    import torch  # here, so that a missing one fails before the runs
    work = args.work or tempfile.mkdtemp(prefix="ragshard-recovery-")
    os.makedirs(work, exist_ok=True)
    run = Runner(build, work, MODEL, args.steps, args.save_every, args.recovery_deadline,
                 args.timeout, args.quiet_wait, args.quiet_cores, args.quiet_total)
    started, t0, load_start = datetime.datetime.now().astimezone(), time.time(), os.getloadavg()
    rounds = []
    for i, (rank, step, phase) in enumerate(kills(args.trials, args.steps, args.seed)
                                            if "rank" in sections else []):
        r = {}
        rounds.append(r)
        at = f"round {i + 1}/{args.trials} ({(time.time() - t0) / 60:.1f} min)"
        attempt(r, "restarts", f"{at}: uninterrupted, --max-restarts 1", run.uninterrupted,
                f"r{i}-restarts", True)
        attempt(r, "recovered", f"{at}: rank {rank} killed at step {step}, {phase}; "
                f"recovered in place", run.recovered, f"r{i}-recovered", rank, step, phase)
        diff(r, "recovered", "restarts")
        if i < args.reps:
            attempt(r, "plain", f"{at}: uninterrupted, no restarts", run.uninterrupted,
                    f"r{i}-plain", False)
            diff(r, "plain", "restarts", "max_abs_diff_restarts")
        attempt(r, "saved", f"{at}: uninterrupted, checkpoints every {args.save_every} steps",
                run.uninterrupted, f"r{i}-saved", False, True)
        attempt(r, "checkpointed", f"{at}: the same kill under checkpoints; restart, load",
                run.checkpoint_restart, f"r{i}-checkpointed", rank, step, phase)
        diff(r, "checkpointed", "saved")
        for name in os.listdir(work):  # the checkpoints (the parameters stay, for --work)
            if name.endswith(".ckpt"):
                shutil.rmtree(os.path.join(work, name), ignore_errors=True)
    doc = {"command": command(), "argv": sys.argv, "provenance": args.provenance,
           "started": started.isoformat(timespec="seconds"), "elapsed": time.time() - t0,
           "load_start": load_start, "load_end": os.getloadavg(), "machine": machine(),
           "python": sys.version.split()[0], "torch": torch.__version__, "model": MODEL,
           "steps": args.steps, "save_every": args.save_every, "saves": run.saves,
           "seed": args.seed, "reps": args.reps, "commands": run.commands,
           "quiet_wait": args.quiet_wait, "quiet_cores": args.quiet_cores,
           "quiet_total": args.quiet_total, "rounds": rounds}
    if "rank" not in sections:
        old = json.load(open(args.rank_from))
        doc.update({k: old[k] for k in RANK_KEYS})
        doc["rank_from"] = {k: old.get(k) for k in ("command", "started", "provenance",
                                                    "load_start", "load_end", "elapsed")}
    if "node" in sections:
        doc["node"] = run_node(args, build, work)
        doc["load_end"] = os.getloadavg()
        doc["elapsed"] = time.time() - t0
    path = os.path.join(work, "runs.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print("figures in", path, file=sys.stderr)
    s = render(doc, args.out)
    print("wrote", args.out, file=sys.stderr)
    node_failed = any("error" in r for v in doc.get("node", {}).get("uninterrupted", {}).values()
                      for r in v) or any("error" in r for k in ("rebuilt",)
                                         for v in doc.get("node", {}).get(k, {}).values()
                                         for r in v)
    return 0 if not any("error" in x for r in rounds for x in r.values()) and s["recovered"] \
        and not node_failed else 1


if __name__ == "__main__":
    sys.exit(main())
