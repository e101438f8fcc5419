"""Reliability under faults: the fault tests of tests/python/test_faults.py repeated as a
campaign, each trial on a fresh cluster on hosts of their own (ragshard.cluster.NamespacedCluster:
the planner and each daemon with its ranks in a network and mount namespace; needs root; the
trainings with a `ragshard.launch --nnodes N --node-rank K` per host), plus
the planner soak and kill bursts of bench/planner_soak where that tool is built. Writes the raw
per-trial results to docs/benchmarks/reliability.json, and docs/benchmarks/reliability.md and
a plot (reliability.png, or a hand-written reliability.svg without matplotlib) regenerated
from that JSON: a run of some faults replaces those faults' entries and keeps the others.

    RAGSHARD_BUILD=build PYTHONPATH=build/python:tests/python \\
        .venv/bin/python bench/chaos_report.py --build build [--trials 20] [--faults a,b]

Faults (`--faults`, comma-separated; default the seven below, `node-rebuild`, `node-shrink`
and `soak` only on request):
  rank-kill                  kill -9 of rank 3 at step 3 (4 ranks of examples/train_tiny.py,
                             2 per daemon, each started on its own, no launcher): every
                             survivor exits non-zero within 10 s, its error naming "rank 3".
  daemon-stop                SIGSTOP of daemon node-1 (for 60 s or until all 4 ranks exited,
                             then SIGCONT): every rank exits non-zero within 40 s naming
                             "node-1".
  daemon-kill                kill -9 of daemon node-1: every rank within 10 s naming "node-1".
  host-cut                   node-1's link down (no reset; everything on it alive), the ranks'
                             operation timeout 20 s: every rank within 40 s, ranks 0 and 1
                             naming "node-1", ranks 2 and 3 "node-0".
  planner-kill-registration  the job is created, the planner killed (-9), the 4-rank training
                             launched (a launcher per host), the planner restarted 1 s later:
                             the training exits 0 with the single-process reference's losses.
  planner-kill-ready         as above, but the planner is killed once rank 0 printed step 1
                             (the job READY, training under way) and restarted 1 s later.
  rank-recovery              kill -9 of a random rank of a 20-step training under
                             ragshard.launch --max-restarts 1 (recovery in place, issue 54;
                             AdamW, Muon, bf16, FP8 gathers, 8-bit Adam, Shampoo and NAdam in
                             turn, trial by trial), a
                             random fraction of a step after rank 0 printed a random step: the
                             training exits 0 within 90 s of the kill (the recovery deadline
                             60 s + 30 s), the job READY with one recovery, the final parameters
                             within 1e-6 of an uninterrupted run's (bench/chaos_recovery.py).
  node-rebuild               (on request; --trials default 10 for it alone) a whole node lost:
                             everything on a random daemon's host of 3 (the daemon, its
                             launcher and its 2 ranks; 6 ranks of an 8-step
                             training under ragshard.launch --max-restarts 1 --redundancy
                             parity:2 in odd trials, replica in even ones; AdamW, bf16 and
                             Shampoo in turn, two trials each) killed with SIGKILL at
                             a random step and phase, a replacement daemon with its node id
                             and a launcher for its node rank started on a spare host: the
                             training exits 0 within 90 s of the kill, the job
                             READY with one rebuild, the final parameters within 1e-6 of an
                             uninterrupted run's (bench/chaos_node.py).
  node-shrink                (on request; --trials default 10 for it alone) a whole node lost
                             for good: everything on a random daemon's host of 2 (4 ranks of a
                             6-step AdamW training under ragshard.launch --max-restarts 1
                             --on-node-loss shrink; 2 HSDP replica groups in trials 1-5, one
                             shard group with --redundancy replica, which re-cuts, in 6-10)
                             killed with SIGKILL at a random step and phase, no replacement:
                             the training exits 0 within 40 s of the kill, the job SHRUNK to
                             1 x 2, its losses after the shrink within 1e-5 of a reference
                             saved at 2 x 2 after that step and resumed at 1 x 2
                             (bench/chaos_shrink.py).
  soak                       BUILD/bench/planner_soak --mode soak, --mode kills and --mode
                             reject (a refused 200 MiB Put and 1,000,001-tensor registration:
                             the planner's RSS after them; about 5 s), if built.

Each trial kills everything it started (ranks, launcher and its ranks, the cluster) in a
`finally`, also on Ctrl-C or SIGTERM; a daemon stopped by the fault is continued first. A trial
that breaks the expectation is recorded as a failure with its error and the campaign goes on.
The logs of failed trials are kept under --keep-failures.
"""
import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests", "python")
DOCS = os.path.join(ROOT, "docs", "benchmarks")

from chaos_render import (ALL_FAULTS, DEFAULT_FAULTS, HOST_CUT_OP_TIMEOUT_S,  # noqa: E402
                          LIMIT_TEXT, LIMITS, RANK_FAULTS, RECOVERY_FAULTS, TRAINING_FAULTS,
                          brief, expected_name, load_json, save)
from chaos_recovery import Uninterrupted, recovery_trial  # noqa: E402
import chaos_node  # noqa: E402
import chaos_shrink  # noqa: E402
import provenance  # noqa: E402
from chaos_procs import (HostLaunch, Interrupted, TrialRun, _live, _on_signal,  # noqa: E402
                         error_line, host_launchers, keep_logs, kill_session, read_from,
                         stop_cluster_checked, sweep)
WATCH = {"rank-kill": 60.0, "daemon-stop": 120.0, "daemon-kill": 60.0,  # give up after
         "host-cut": 120.0}
STOP_HOLD = 60.0  # how long daemon-stop keeps node-1 stopped at most
TRAINING_TIMEOUT = 600.0
POLL = 0.01


# ---------------------------------------------------------------------------------- helpers

def setup_imports(build):
    """The build's Python package and tests/python on the path, for this process and the
    processes it starts; RAGSHARD_BUILD for test_faults / test_training's BUILD."""
    os.environ["RAGSHARD_BUILD"] = build
    pp = [os.path.join(build, "python"), TESTS]
    old = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in pp]
    os.environ["PYTHONPATH"] = os.pathsep.join(pp + old)
    for p in reversed(pp):
        if p not in sys.path:
            sys.path.insert(0, p)


# ---------------------------------------------------------------------------- rank faults

def rank_fault_trial(fault, trial, build, keep_dir):
    """One trial of rank-kill, daemon-stop, daemon-kill or host-cut, as test_faults does it, on
    hosts of their own."""
    from ragshard.cluster import NamespacedCluster
    from test_faults import start_ranks, stop_all, text, wait_for_steps

    limit = LIMITS[fault]
    ranks = [0, 1, 2] if fault == "rank-kill" else [0, 1, 2, 3]
    res = {"trial": trial, "passed": False, "error": None, "ranks": [], "stuck_at_stop": []}
    logdir = tempfile.mkdtemp(prefix="ragshard-chaos-")
    procs, logs, stopped, c = [], [], None, None
    try:
        with NamespacedCluster(build, daemons=2, shared=[ROOT]) as c:
            _live["clusters"].append(c)
            try:
                more = {"RAGSHARD_OP_TIMEOUT_S": str(HOST_CUT_OP_TIMEOUT_S)} \
                    if fault == "host-cut" else {}
                procs, logs = start_ranks(c, f"{fault}-{trial}", logdir, **more)
                _live["procs"].extend(procs)
                wait_for_steps(procs, logs, steps=3)
                offsets = [os.path.getsize(lg.name) for lg in logs]
                daemon1 = c.daemon(1)
                t0 = time.monotonic()
                if fault == "rank-kill":
                    procs[3].kill()
                elif fault == "daemon-kill":
                    daemon1.kill()
                elif fault == "host-cut":
                    c.hosts.link_down("node-1")
                else:
                    os.kill(daemon1.pid, signal.SIGSTOP)
                    stopped = daemon1
                exits = {}
                while len(exits) < len(ranks):
                    now = time.monotonic()
                    for r in ranks:
                        if r not in exits and procs[r].poll() is not None:
                            exits[r] = (procs[r].returncode, now - t0)
                    if stopped is not None and (len(exits) == len(ranks) or
                                                now - t0 >= STOP_HOLD):
                        os.kill(stopped.pid, signal.SIGCONT)
                        res["sigcont_after_s"] = round(now - t0, 3)
                        stopped = None
                    if now - t0 > WATCH[fault]:
                        break
                    time.sleep(POLL)
                problems = []
                for r in ranks:
                    out, name = text(logs[r])[offsets[r]:], expected_name(fault, r)
                    row = {"rank": r, "exit_code": None, "seconds": None,
                           "names": name in out, "error_line": brief(error_line(out), 400)}
                    if r in exits:
                        row["exit_code"], row["seconds"] = exits[r][0], round(exits[r][1], 3)
                        if exits[r][0] == 0:
                            problems.append(f"rank {r} exited 0")
                        if exits[r][1] > limit:
                            problems.append(f"rank {r} took {exits[r][1]:.1f} s (> {limit:g} s)")
                    else:
                        problems.append(f"rank {r} still running {WATCH[fault]:g} s after the "
                                        f"fault")
                    if not row["names"]:
                        problems.append(f"rank {r}'s error does not name '{name}': "
                                        f"{row['error_line'][:200]!r}")
                    res["ranks"].append(row)
                res["passed"] = not problems
                res["error"] = "; ".join(problems) or None
            finally:
                if stopped is not None:
                    os.kill(stopped.pid, signal.SIGCONT)
                stop_all(procs)
                res["stuck_at_stop"] = stop_cluster_checked(c)
                if not res["passed"]:
                    res["logs"] = keep_logs(keep_dir, fault, trial, [logdir, c.dir])
    except Interrupted:
        raise
    except Exception as e:  # the trial fails; the campaign goes on
        res["passed"] = False
        res["error"] = brief(f"{type(e).__name__}: {e}", 1500)
        res["traceback"] = traceback.format_exc()[-3000:]
        if keep_dir and "logs" not in res:
            res["logs"] = keep_logs(keep_dir, fault, trial, [logdir] + ([c.dir] if c else []))
    finally:
        for lg in logs:
            lg.close()
        shutil.rmtree(logdir, ignore_errors=True)
    return res


# ------------------------------------------------------------------------- training faults

class Reference:
    """The single-process reference's output, computed once per campaign."""

    def __init__(self, steps):
        self.steps, self.dir, self.out, self.error = steps, None, None, None

    def get(self):
        if self.out is None and self.error is None:
            from test_training import run_reference
            self.dir = tempfile.mkdtemp(prefix="ragshard-chaos-ref-")
            try:
                self.out = run_reference(Path(self.dir), "chaos", ["--steps", str(self.steps)])
            except Exception as e:
                self.error = brief(f"reference run failed: {e}", 1500)
        if self.error:
            raise RuntimeError(self.error)
        return self.out

    def cleanup(self):
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)


def training_trial(fault, trial, build, ref, steps, keep_dir):
    from ragshard.cluster import NamespacedCluster
    from test_faults import create
    from test_training import EXAMPLE, SMALL, compare

    res = {"trial": trial, "passed": False, "error": None, "wall_seconds": None,
           "stuck_at_stop": [], "leftover_after_launcher": []}
    with TrialRun(res, fault, trial, keep_dir) as t:
        out, log_path = t.out, t.log_path
        args = ["--steps", str(steps)] + [a for a in SMALL if a != "--quiet"]  # rank 0 prints steps
        reference = ref.get()
        with t.cluster(NamespacedCluster(build, daemons=2, shared=[ROOT])) as c:
            job = f"{fault}-{trial}"
            create(c, job)
            if fault == "planner-kill-registration":
                c.kill_planner()
            log = t.open_log()
            t0 = time.monotonic()
            # A launcher per host, for the job made above.
            p = host_launchers(HostLaunch(), c, job,
                               [(k, node, k) for k, node in enumerate(c.nodes)], 2, 2,
                               [EXAMPLE, "--out", out] + args, log, create=False)
            t.launch = p
            if fault == "planner-kill-registration":
                time.sleep(1.0)  # the outage's length (the fault's definition)
                res["running_at_restart"] = p.poll() is None
                tr = time.monotonic()
                c.restart_planner()
                res["restart_seconds"] = round(time.monotonic() - tr, 3)
            else:
                while True:  # until rank 0 printed step 1: the job READY, training on
                    body = read_from(log_path)
                    if "step 1/" in body:
                        break
                    if p.poll() is not None or p.failed() is not None:
                        raise RuntimeError(f"a launcher exited ({p.failed() or p.returncode}) "
                                           f"before step 1: {body[-2000:]}")
                    if time.monotonic() - t0 > TRAINING_TIMEOUT:
                        raise TimeoutError(f"no step 1 in {TRAINING_TIMEOUT:g} s")
                    time.sleep(POLL)
                c.kill_planner()
                tk = time.monotonic()
                res["killed_at_seconds"] = round(tk - t0, 3)
                res["steps_before_kill"] = read_from(log_path).count(f"/{steps} loss")
                time.sleep(1.0)  # the outage's length (the fault's definition)
                res["running_at_restart"] = p.poll() is None
                tr = time.monotonic()
                c.restart_planner()
                res["restart_seconds"] = round(time.monotonic() - tr, 3)
            while p.poll() is None and p.failed() is None:
                if time.monotonic() - t0 > TRAINING_TIMEOUT:
                    raise TimeoutError(f"the training still running after "
                                       f"{TRAINING_TIMEOUT:g} s: "
                                       f"{read_from(log_path)[-2000:]}")
                time.sleep(POLL)
            res["wall_seconds"] = round(time.monotonic() - t0, 3)
            res["exit_code"] = p.failed() or p.returncode
            res["leftover_after_launcher"] = p.members()
            body = read_from(log_path)
            if fault == "planner-kill-ready":
                res["steps_after_restart"] = body.count(f"/{steps} loss") - \
                    res["steps_before_kill"]
            if res["exit_code"] != 0:
                raise RuntimeError(f"the training exited {res['exit_code']}: "
                                   f"{error_line(body)} | {body[-1500:]}")
            losses = compare(out, reference)
            res["final_loss"] = losses[-1]
            res["passed"] = True
    return res


# ----------------------------------------------------------------------------------- soak

def run_soak(build, jobs=40000, kills=20, timeout=3600):
    """planner_soak's three modes, if the tool is built; each prints one JSON object."""
    tool = os.path.join(build, "bench", "planner_soak")
    planner = os.path.join(build, "server", "ragshard-planner")
    res = {"tool": tool, "present": os.access(tool, os.X_OK), "modes": {}}
    if not res["present"]:
        return res
    for mode, extra in (("soak", ["--jobs", str(jobs)]), ("kills", ["--kills", str(kills)]),
                        ("reject", [])):
        cmd = [tool, "--planner", planner, "--mode", mode] + extra + ["--json"]
        entry = {"command": " ".join(shlex.quote(a) for a in cmd)}
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
        t0 = time.monotonic()
        try:
            stdout, stderr = p.communicate(timeout=timeout)
            entry["exit_code"] = p.returncode
            entry["stderr_tail"] = stderr[-2000:]
            doc = None
            for line in reversed(stdout.strip().splitlines()):
                line = line.strip()
                if line.startswith("{"):
                    try:
                        doc = json.loads(line)
                        break
                    except ValueError:
                        pass
            if doc is None:
                try:
                    doc = json.loads(stdout)
                except ValueError:
                    entry["error"] = f"no JSON object on stdout: {stdout[-1000:]!r}"
            entry["result"] = doc
            if p.returncode != 0:
                entry["error"] = (entry.get("error", "") + f" exit code {p.returncode}: "
                                  f"{brief(stderr[-600:])}").strip()
        except subprocess.TimeoutExpired:
            entry["error"] = f"still running after {timeout} s"
        finally:
            kill_session(p.pid)
            p.wait()
            entry["wall_seconds"] = round(time.monotonic() - t0, 3)
        res["modes"][mode] = entry
    return res


# --------------------------------------------------------------------------------- report

def machine():
    model = ""
    try:
        for ln in open("/proc/cpuinfo"):
            if ln.startswith("model name"):
                model = ln.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        for ln in open("/proc/meminfo"):
            if ln.startswith("MemTotal"):
                mem = f"{int(ln.split()[1]) / 2**20:.0f} GiB RAM"
    except OSError:
        pass
    try:
        load = "load average %.1f %.1f %.1f at the start" % os.getloadavg()
    except OSError:
        load = ""
    return ", ".join(x for x in [f"{os.cpu_count()} cores ({model})" if model else
                                 f"{os.cpu_count()} cores", mem, platform.platform(), load] if x)


def run_meta(args):
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in args.env_snapshot.items())
    nice = os.nice(0)
    cmd = (f"nice -n {nice} " if nice else "") + (env + " " if env else "") + \
        " ".join(shlex.quote(a) for a in [os.path.relpath(sys.executable, ROOT)
                                          if sys.executable.startswith(ROOT) else
                                          sys.executable, os.path.relpath(
                                              os.path.abspath(sys.argv[0]), ROOT)] + sys.argv[1:])
    return {"command": cmd, "date": datetime.datetime.now().astimezone().isoformat(
        timespec="seconds"), "commit": provenance.state(), "machine": machine(),
        "build": args.build, "trials_requested": args.trials}


# ----------------------------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__)
    ap.add_argument("--build", default=os.path.join(ROOT, "build"),
                    help="CMake build folder (server/, client/, python/, bench/)")
    ap.add_argument("--trials", type=int, default=None,
                    help="trials per fault (default 20; 10 where node-rebuild or node-shrink is "
                         "the only fault)")
    ap.add_argument("--faults", default=",".join(DEFAULT_FAULTS),
                    help=f"comma-separated, of {', '.join(ALL_FAULTS)}")
    ap.add_argument("--steps", type=int, default=6,
                    help="training steps of the planner faults (and of the reference)")
    ap.add_argument("--docs", default=DOCS, help="where reliability.{md,json,png} go")
    ap.add_argument("--keep-failures", default=os.path.join(tempfile.gettempdir(),
                                                            "ragshard-chaos-failures"),
                    help="copy the logs of failed trials here ('' to keep none)")
    ap.add_argument("--soak-jobs", type=int, default=40000)
    ap.add_argument("--soak-kills", type=int, default=20)
    ap.add_argument("--report-only", action="store_true",
                    help="regenerate the report from reliability.json and exit")
    ap.add_argument("--note", action="append", default=[],
                    help="with --report-only: a note for the report's \"How it was run\" "
                         "(kept in reliability.json; repeatable)")
    ap.add_argument("--clear-notes", action="store_true",
                    help="with --report-only: drop the notes kept so far")
    provenance.add_flag(ap)
    args = ap.parse_args()
    args.build = os.path.abspath(args.build)
    args.env_snapshot = {k: os.environ[k] for k in ("RAGSHARD_BUILD", "PYTHONPATH")
                         if k in os.environ}
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    if args.trials is None:
        args.trials = {("node-rebuild",): 10, ("node-shrink",): 10}.get(tuple(faults), 20)
    bad = [f for f in faults if f not in ALL_FAULTS]
    if bad:
        ap.error(f"unknown fault(s) {bad}; known: {ALL_FAULTS}")
    os.makedirs(args.docs, exist_ok=True)
    json_path = os.path.join(args.docs, "reliability.json")
    if args.report_only:
        doc = load_json(json_path)
        if args.clear_notes:
            doc.pop("notes", None)
        for note in args.note:
            if note not in doc.setdefault("notes", []):
                doc["notes"].append(note)
        save(args.docs, doc)
        return 0

    provenance.require(args)
    setup_imports(args.build)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    meta = run_meta(args)
    print(f"chaos_report: {meta['command']}\n  {meta['machine']}\n  commit {meta['commit']}",
          flush=True)
    ref = Reference(args.steps)
    uninterrupted = Uninterrupted(args.build)  # rank-recovery's
    node_refs = chaos_node.Uninterrupted(args.build)  # node-rebuild's
    shrink_refs = chaos_shrink.References(args.build)  # node-shrink's
    try:
        for fault in faults:
            if fault == "soak":
                print("soak: running planner_soak", flush=True)
                res = run_soak(args.build, args.soak_jobs, args.soak_kills)
                print(f"soak: {json.dumps(res)[:2000]}", flush=True)
                entry = {"run": meta, "result": res}
            else:
                entry = {"run": meta, "trials": [], "limit": LIMIT_TEXT[fault]}
                if fault in TRAINING_FAULTS:
                    entry["steps"] = args.steps
                for i in range(1, args.trials + 1):
                    t = time.monotonic()
                    if fault in RANK_FAULTS:
                        res = rank_fault_trial(fault, i, args.build, args.keep_failures)
                    elif fault == "node-rebuild":
                        res = chaos_node.node_trial(i, args.build, node_refs,
                                                    args.keep_failures)
                    elif fault == "node-shrink":
                        res = chaos_shrink.shrink_trial(i, args.build, shrink_refs,
                                                        args.keep_failures)
                    elif fault in RECOVERY_FAULTS:
                        res = recovery_trial(i, args.build, uninterrupted, args.keep_failures)
                    else:
                        res = training_trial(fault, i, args.build, ref, args.steps,
                                             args.keep_failures)
                    res["trial_seconds"] = round(time.monotonic() - t, 1)
                    sweep()  # the trial's own finally did it; this forgets them
                    entry["trials"].append(res)
                    figs = [r["seconds"] for r in res.get("ranks", [])] if fault in RANK_FAULTS \
                        else [res.get("seconds")] if fault in RECOVERY_FAULTS \
                        else [res.get("wall_seconds")]
                    print(f"{fault} {i}/{args.trials}: {'pass' if res['passed'] else 'FAIL'} "
                          f"{figs} ({res['trial_seconds']} s)"
                          + (f" -- {res['error'][:500]}" if res["error"] else ""), flush=True)
            doc = load_json(json_path)  # merge: someone may have run other faults meanwhile
            doc["faults"][fault] = entry
            if fault == "soak" and "notes" in doc:  # it measures what this note once told
                doc["notes"] = [n for n in doc["notes"]
                                if not n.startswith("Large refused requests (bench/planner_soak")]
            save(args.docs, doc)
            print(f"{fault}: written to {json_path}", flush=True)
    except KeyboardInterrupt:
        print("chaos_report: interrupted; the faults completed so far are in the report "
              "(the one under way is discarded)", file=sys.stderr, flush=True)
        return 130
    finally:
        sweep()
        ref.cleanup()
        uninterrupted.cleanup()
        node_refs.cleanup()
        shrink_refs.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
