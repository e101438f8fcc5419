"""The rank-recovery fault of bench/chaos_report.py: a rank of a recovering training (4 ranks of
examples/train_tiny.py over 2 daemons, ragshard.launch --max-restarts 1) killed with SIGKILL
from outside at a random moment of its training, and the job recovered in place (issue 54).

A trial (its own LocalCluster) passes when the launcher exits 0 within RECOVERY_LIMIT seconds of
the kill (the recovery deadline plus 30 s; past it the trial is a hang, and everything it
started is killed), the launcher restarted the killed rank, the planner shows the job READY
with one recovery, and every final parameter is within PARAM_ATOL of an uninterrupted run's
with the same seed (no divergence). The configuration cycles trial by trial through AdamW,
Muon, bf16 parameters, FP8 gathers, 8-bit Adam, Shampoo and NAdam (`CONFIGS`); the uninterrupted runs (one per configuration, with --max-restarts 1) are made
once per campaign (`Uninterrupted`)."""
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from chaos_procs import TrialRun, _live, await_launcher, brief_tail, kill_session, read_from
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


def _env():
    return dict(os.environ)  # setup_imports put the build's python/ on PYTHONPATH


def _launch(cluster, job, out, opt, log):
    cmd = [sys.executable, "-m", "ragshard.launch", "--planner", cluster.planner, "--job", job,
           "--nproc", "4", "--sockets", ",".join(cluster.sockets), "--create-job",
           "--max-restarts", "1", "--recovery-deadline", f"{DEADLINE:g}", EXAMPLE, "--out", out,
           "--steps", str(STEPS)] + CONFIGS[opt] + MODEL
    p = subprocess.Popen(cmd, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL, start_new_session=True)
    _live["sessions"].append(p.pid)
    return p


def _rank_pid(launcher, rank):
    """The pid of the launcher's child that runs rank `rank` (RAGSHARD_RANK in its
    environment: ranks without --preload are interpreters of their own), or None."""
    try:
        kids = [int(x) for t in os.listdir(f"/proc/{launcher}/task")
                for x in open(f"/proc/{launcher}/task/{t}/children").read().split()]
    except OSError:
        return None
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
            from ragshard.cluster import LocalCluster
            self.dir = self.dir or tempfile.mkdtemp(prefix="ragshard-chaos-uninterrupted-")
            out = os.path.join(self.dir, opt)
            with open(out + ".log", "w") as log, LocalCluster(self.build, daemons=2) as c:
                p = _launch(c, f"uninterrupted-{opt}", out, opt, log)
                try:
                    p.wait(timeout=600)
                finally:
                    kill_session(p.pid)
                    p.wait()
            if p.returncode != 0:
                raise RuntimeError(f"the uninterrupted {opt} run exited {p.returncode}: "
                                   f"{brief_tail(out + '.log')}")
            self.outs[opt] = out
        return self.outs[opt]

    def cleanup(self):
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)


def recovery_trial(trial, build, ref, keep_dir):
    """One trial: a random rank killed after rank 0 printed a random step, a random fraction
    of a step later."""
    from ragshard.cluster import LocalCluster
    rng = random.Random(f"rank-recovery-{trial}")
    rank, after = rng.randrange(4), rng.randint(1, STEPS - 5)
    delay = rng.uniform(0.0, 1.0)  # in steps (the last step's seconds, from rank 0's lines)
    opt = optimizer(trial)
    res = {"trial": trial, "passed": False, "error": None, "optimizer": opt, "rank": rank,
           "after_step": after, "stuck_at_stop": [], "leftover_after_launcher": []}
    with TrialRun(res, "rank-recovery", trial, keep_dir) as t:
        out, log_path = t.out, t.log_path
        reference = ref.get(opt)
        with t.cluster(LocalCluster(build, daemons=2)) as c:
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
                if p.poll() is not None:
                    raise RuntimeError(f"the training exited ({p.returncode}) before step "
                                       f"{after}: {brief_tail(log_path)}")
                if time.monotonic() - t0 > 600:
                    raise TimeoutError(f"no step {after} in 600 s")
                time.sleep(POLL)
            step_s = seen[after] - seen[after - 1] if after - 1 in seen else 0.05
            time.sleep(delay * step_s)
            pid = _rank_pid(p.pid, rank)
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
            show = subprocess.run(
                [os.path.join(build, "ctl", "ragshardctl"), "--planner", c.planner,
                 "--token-file", c.token_file, "job", "show", job],
                capture_output=True, text=True, timeout=60)
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
