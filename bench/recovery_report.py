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
journaled) against without, alternated. Writes docs/benchmarks/recovery.md and recovery.png;
the figures go to WORK/runs.json, from which --from-json writes the report again.

    .venv/bin/python bench/recovery_report.py --build build     # ~12 min on a quiet machine
    .venv/bin/python bench/recovery_report.py --build build --trials 1 --reps 1 --steps 6 \\
        --allow-dirty --out /tmp/recovery.md                               # a smoke run
    .venv/bin/python bench/recovery_report.py --from-json WORK/runs.json

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
    for i, (rank, step, phase) in enumerate(kills(args.trials, args.steps, args.seed)):
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
    path = os.path.join(work, "runs.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print("figures in", path, file=sys.stderr)
    s = render(doc, args.out)
    print("wrote", args.out, file=sys.stderr)
    return 0 if not any("error" in x for r in rounds for x in r.values()) and s["recovered"] \
        else 1


if __name__ == "__main__":
    sys.exit(main())
