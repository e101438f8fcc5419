"""The rank-recovery fault of bench/chaos_report.py: a rank of a recovering training (4 ranks of
examples/train_tiny.py over 2 hosts of their own, a `ragshard.launch --nnodes 2 --node-rank K
--max-restarts 1` and a daemon on each) killed with SIGKILL from outside at a random moment of
its training, and the job recovered in place (issue 54).

A trial (its own NamespacedCluster) passes when both launchers exit 0 within RECOVERY_LIMIT
seconds of the kill (the recovery deadline plus 30 s; past it the trial is a hang, and everything it
started is killed), the killed rank's launcher restarted it, the planner shows the job READY
with one recovery, and every final parameter is within PARAM_ATOL of an uninterrupted run's
with the same seed (no divergence). The configuration cycles trial by trial through AdamW,
Muon, bf16 parameters, FP8 gathers, 8-bit Adam, Shampoo and NAdam (`CONFIGS`); the uninterrupted runs (one per configuration, with --max-restarts 1) are made
once per campaign (`Uninterrupted`)."""
import json
import os
import random
import shutil
import signal
import tempfile
import time

from chaos_procs import (WORK_ROOT, HostLaunch, TrialRun, await_launcher, brief_tail,
                         host_launchers, job_show, read_from, run_to_end)
from recovery_runs import STEP_LINE, max_abs_diff

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_tiny.py")
# The tests' small model (tests/python/test_recovery.py), with steps enough that a kill after
# a random one of the first STEPS - 5 lands in training.
MODEL = ["--layers", "2", "--dim", "64", "--heads", "4", "--seq", "16", "--batch", "2",
         "--vocab", "32"]
STEPS = 20
DEADLINE = 60.0  # the job's recovery deadline (s)
RECOVERY_LIMIT = DEADLINE + 30.0  # from the kill to the launcher's exit
PARAM_ATOL = 1e-6
POLL = 0.01


# The training configurations the trials cycle through: each one's arguments of train_tiny.py
# (docs/recovery.md, "What the daemon keeps").
CONFIGS = {"adamw": ["--optimizer", "adamw"], "muon": ["--optimizer", "muon"],
           "bf16": ["--param-dtype", "bf16"], "fp8": ["--quantize", "fp8"],
           "adam8bit": ["--optimizer", "adam8bit"],
           "shampoo": ["--optimizer", "shampoo", "--precondition-every", "2"],
           "nadam": ["--optimizer", "nadam"]}


def optimizer(trial):
    """The trial's configuration (a key of CONFIGS): AdamW and Muon first, as before."""
    return list(CONFIGS)[(trial - 1) % len(CONFIGS)]


def _cluster(build):
    from ragshard.cluster import NamespacedCluster
    return NamespacedCluster(build, daemons=2, shared=[ROOT])


def _launch(cluster, job, out, opt, log):
    """A launcher per host, ranks 2k and 2k + 1 on host k (each an interpreter of its own)."""
    return host_launchers(
        HostLaunch(), cluster, job, [(k, node, k) for k, node in enumerate(cluster.nodes)], 2, 2,
        ["--max-restarts", "1", "--recovery-deadline", f"{DEADLINE:g}", EXAMPLE, "--out", out,
         "--steps", str(STEPS)] + CONFIGS[opt] + MODEL, log)


def _rank_pid(launch, rank):
    """The pid of the launchers' child that runs rank `rank` (RAGSHARD_RANK in its
    environment: ranks without --preload are interpreters of their own), or None."""
    kids = []
    for p in launch.procs:
        try:
            kids += [int(x) for t in os.listdir(f"/proc/{p.pid}/task")
                     for x in open(f"/proc/{p.pid}/task/{t}/children").read().split()]
        except OSError:
            pass
    for pid in kids:
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if f"RAGSHARD_RANK={rank}".encode() in env:
            return pid
    return None


class Uninterrupted:
    """Each configuration's uninterrupted run (--max-restarts 1, no kill), once per
    campaign."""

    def __init__(self, build):
        self.build, self.dir, self.outs = build, None, {}

    def get(self, opt):
        if opt not in self.outs:
            self.dir = self.dir or tempfile.mkdtemp(prefix="ragshard-chaos-uninterrupted-",
                                                    dir=WORK_ROOT)
            out = os.path.join(self.dir, opt)
            with open(out + ".log", "w") as log, _cluster(self.build) as c:
                run_to_end(_launch(c, f"uninterrupted-{opt}", out, opt, log), out + ".log",
                           f"the uninterrupted {opt} run")
            self.outs[opt] = out
        return self.outs[opt]

    def cleanup(self):
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)


def recovery_trial(trial, build, ref, keep_dir):
    """One trial: a random rank killed after rank 0 printed a random step, a random fraction
    of a step later."""
    rng = random.Random(f"rank-recovery-{trial}")
    rank, after = rng.randrange(4), rng.randint(1, STEPS - 5)
    delay = rng.uniform(0.0, 1.0)  # in steps (the last step's seconds, from rank 0's lines)
    opt = optimizer(trial)
    res = {"trial": trial, "passed": False, "error": None, "optimizer": opt, "rank": rank,
           "after_step": after, "stuck_at_stop": [], "leftover_after_launcher": []}
    with TrialRun(res, "rank-recovery", trial, keep_dir) as t:
        out, log_path = t.out, t.log_path
        reference = ref.get(opt)
        with t.cluster(_cluster(build)) as c:
            job = f"rank-recovery-{trial}"
            log = t.open_log()
            t0 = time.monotonic()
            p = _launch(c, job, out, opt, log)
            t.launch = p
            seen = {}  # step -> when rank 0's line for it appeared
            while after not in seen:
                for line in read_from(log_path).splitlines():
                    m = STEP_LINE.match(line)
                    if m:
                        seen.setdefault(int(m.group(1)), time.monotonic())
                if p.poll() is not None or p.failed() is not None:
                    raise RuntimeError(f"a launcher exited ({p.failed() or p.returncode}) "
                                       f"before step {after}: {brief_tail(log_path)}")
                if time.monotonic() - t0 > 600:
                    raise TimeoutError(f"no step {after} in 600 s")
                time.sleep(POLL)
            step_s = seen[after] - seen[after - 1] if after - 1 in seen else 0.05
            time.sleep(delay * step_s)
            pid = _rank_pid(p, rank)
            if pid is None:
                raise RuntimeError(f"rank {rank}'s process not found after step {after}")
            os.kill(pid, signal.SIGKILL)
            tk = time.monotonic()
            res["killed_at_seconds"] = round(tk - t0, 3)
            await_launcher(p, tk, RECOVERY_LIMIT, log_path, res)
            body = read_from(log_path)
            if p.returncode != 0:
                raise RuntimeError(f"the training exited {p.returncode}: "
                                   f"{brief_tail(log_path)}")
            if f"rank {rank} exited with -9; restarting it" not in body:
                raise RuntimeError(f"the launcher did not restart rank {rank}: "
                                   f"{brief_tail(log_path)}")
            show = job_show(build, c, job)
            res["recoveries_shown"] = "recoveries:   1 recovery" in show.stdout
            if "READY" not in show.stdout or not res["recoveries_shown"]:
                raise RuntimeError(f"the job is not READY with one recovery: "
                                   f"{' '.join(show.stdout.split())[:600]}")
            res["resumed_at_step"] = _first_step(out)
            res["max_abs_diff"] = max_abs_diff(out, reference)
            if res["max_abs_diff"] > PARAM_ATOL:
                raise RuntimeError(f"diverged: max |delta| {res['max_abs_diff']:.3g} against "
                                   f"the uninterrupted run (> {PARAM_ATOL:g})")
            res["passed"] = True
    return res



def _first_step(out):
    with open(out + ".json") as f:
        return json.load(f)["first_step"]
