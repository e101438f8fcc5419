"""The measuring side of bench/recovery_report.py: one launch of examples/train_tiny.py through
ragshard.launch (4 ranks over 2 daemons of a fresh LocalCluster) with the time of every line
of its output (`Launch`), and the report's three kinds of run: uninterrupted, a rank killed and
recovered in place (--max-restarts 1), and a rank killed under checkpoints, the job failed and
started again from its last checkpoint (`Runner`). bench/chaos_recovery.py launches through
`Launch` too."""
import json
import os
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_tiny.py")
WORLD, DAEMONS = 4, 2
STEP_LINE = re.compile(r"^step (\d+)/(\d+) loss ")
LOST_LINE = re.compile(r"rank (\d+) exited with -9")
WATCH_S = 0.05


def children(pid):
    """The pids of `pid`'s children, from /proc (none once it is gone)."""
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return out


def _busy_seconds():
    """The CPU seconds this machine's cores have run anything (user, nice, system, irq,
    softirq; from /proc/stat), since boot."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:8]]
    user, nice, system, _idle, _iowait, irq, softirq = fields
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def _own_seconds():
    """The CPU seconds of this process and of its children that it waited for (theirs and
    their own waited-for children's: the launcher's ranks, the cluster's servers)."""
    return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))


def wait_quiet(limit, below, window=2.0):
    """Between launches (nothing of ours runs): waits until the cores ran less than `below`
    cores' worth over `window` seconds, or `limit` seconds passed. Returns (seconds waited,
    the last window's busy cores)."""
    t0 = time.time()
    while True:
        b0 = _busy_seconds()
        time.sleep(window)
        busy = (_busy_seconds() - b0) / window
        if busy < below or time.time() - t0 >= limit:
            return time.time() - t0, busy


class Others:
    """The CPU seconds that processes other than this one and its children ran while the
    block ran (the machine's busy time less ours): how much else competed for the cores."""

    def __enter__(self):
        self.t, self.busy, self.own = time.time(), _busy_seconds(), _own_seconds()
        return self

    def __exit__(self, *exc):
        self.wall = time.time() - self.t
        self.seconds = max(0.0, (_busy_seconds() - self.busy) - (_own_seconds() - self.own))
        return False

    def cores(self):
        return self.seconds / self.wall if self.wall > 0 else 0.0


def sh(cmd):
    return " ".join(shlex.quote(c) for c in cmd)


class Launch:
    """`cmd` in a process session of its own, every line of its output (stdout and stderr)
    kept with its time in seconds since the start; after `timeout` seconds the session is
    killed (exit code None). Wall clock (time.time()), so that a file's mtime compares."""

    def __init__(self, cmd, env, timeout, watch=False):
        self.cmd, self.lines, self.start = cmd, [], time.time()
        self.children = {}  # with watch: the launcher's children, pid -> [first, last] seen
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     text=True, start_new_session=True)
        reader = threading.Thread(target=self._read, daemon=True)
        reader.start()
        if watch:
            threading.Thread(target=self._watch, daemon=True).start()
        try:
            self.proc.wait(timeout=timeout)
            self.code = self.proc.returncode
        except subprocess.TimeoutExpired:
            self.code = None
        finally:
            self.wall = time.time() - self.start
            try:  # whatever the launcher left behind, and on a timeout the launcher itself
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
            reader.join(timeout=10)

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.time() - self.start, line.rstrip("\n")))

    def _watch(self):
        """Every WATCH_S while the launcher runs: its children (the ranks' processes)."""
        while self.proc.poll() is None:
            now = time.time() - self.start
            for pid in children(self.proc.pid):
                self.children.setdefault(pid, [now, now])[1] = now
            time.sleep(WATCH_S)

    def steps(self):
        """[(seconds, step number)] of rank 0's step lines."""
        return [(t, int(m.group(1))) for t, text in self.lines
                for m in [STEP_LINE.match(text)] if m]

    def first(self, pattern, after=0.0):
        """The time of the first line at or after `after` seconds that matches `pattern`."""
        return next((t for t, text in self.lines if t >= after and re.search(pattern, text)),
                    None)

    def tail(self, n=2000):
        return "\n".join(text for _, text in self.lines)[-n:]


def slowest_step(ranks, skip=2):
    """The slowest rank's time of each step, the first `skip` steps left out."""
    n = min(len(r["step_seconds"]) for r in ranks)
    return [max(r["step_seconds"][s] for r in ranks) for s in range(skip, n)]


def max_abs_diff(a, b):
    """The largest |a - b| over every parameter of two runs' final parameters (PREFIX.pt)."""
    import torch
    pa, pb = torch.load(a + ".pt"), torch.load(b + ".pt")
    if pa.keys() != pb.keys():
        raise RuntimeError(f"{a}.pt and {b}.pt hold different parameters")
    return max(float((pa[k] - pb[k]).abs().max()) for k in pa)


class RunFailed(RuntimeError):
    pass


class Runner:
    """Runs the report's launches in `work`, each on a fresh LocalCluster (a planner and 2
    daemons) of `build`; `model` and `steps` are train_tiny's arguments. `commands` keeps one
    command line of each kind, as run."""

    def __init__(self, build, work, model, steps, save_every, deadline, timeout,
                 quiet_wait=0.0, quiet_cores=0.3, quiet_total=0.0):
        self.build, self.work, self.model, self.steps = build, work, model, steps
        self.quiet_wait, self.quiet_cores = quiet_wait, quiet_cores
        self.quiet_left = quiet_total  # the waits' budget over the whole run
        self.saves = ",".join(str(s) for s in range(save_every, steps + 1, save_every))
        self.deadline, self.timeout = deadline, timeout
        self.commands = {}
        if os.path.join(build, "python") not in sys.path:
            sys.path.insert(0, os.path.join(build, "python"))

    def _env(self):
        # Read at each launch: inside a LocalCluster the environment names its planner's token.
        env = dict(os.environ, PYTHONPATH=os.path.join(self.build, "python"))
        for k in ("OMP_NUM_THREADS", "RAGSHARD_TRACE"):
            env.pop(k, None)
        return env

    def _launch(self, cluster, kind, job, restarts, extra, watch=False):
        out = os.path.join(self.work, job)
        # --preload torch, as the tests launch: the ranks (and, with --max-restarts, the spares
        # that restarted ranks become) are forked from the launcher's one torch import.
        cmd = [sys.executable, "-m", "ragshard.launch", "--preload", "torch", "--planner",
               cluster.planner, "--job",
               job, "--nproc", str(WORLD), "--sockets", ",".join(cluster.sockets),
               "--create-job"]
        if restarts:
            cmd += ["--max-restarts", "1", "--recovery-deadline", str(self.deadline)]
        cmd += [EXAMPLE, "--out", out, "--steps", str(self.steps)] + self.model + extra
        self.commands.setdefault(kind, sh(cmd).replace(ROOT + os.sep, ""))
        return Launch(cmd, self._env(), self.timeout, watch), out

    def _quiet(self):
        """Before a measured launch: wait_quiet (within what is left of the waits' budget),
        with the wait and the machine's load kept."""
        if self.quiet_wait <= 0 or self.quiet_left <= 0:
            return {}
        waited, busy = wait_quiet(min(self.quiet_wait, self.quiet_left), self.quiet_cores)
        self.quiet_left -= waited
        return {"waited": waited, "busy_before": busy}

    def _cluster(self):
        from ragshard.cluster import LocalCluster
        return LocalCluster(self.build, daemons=DAEMONS, pool_bytes=256 << 20)

    world = WORLD  # the ranks of a launch

    def _outputs(self, out, launch, what, world=None):
        """rank 0's --out JSON and each rank's, of `world` ranks (default the runner's)."""
        if launch.code != 0:
            raise RunFailed(f"{what}: exited with {launch.code}:\n{launch.tail()}")
        try:
            return json.load(open(out + ".json")), [
                json.load(open(f"{out}.rank{r}.json")) for r in range(world or self.world)]
        except (OSError, ValueError) as e:
            raise RunFailed(f"{what}: no output: {e}\n{launch.tail()}")

    def uninterrupted(self, job, restarts, save=False):
        """One run without a fault: its wall time, its start (the launch to rank 0's first step:
        the time of rank 0's line `step 1/N`, printed after the step, less that step's
        seconds), its steps and the slowest rank's step times after the first two."""
        extra = ["--save", os.path.join(self.work, job + ".ckpt"), "--save-step",
                 self.saves] if save else []
        if save:
            shutil.rmtree(extra[1], ignore_errors=True)
        quiet = self._quiet()
        with Others() as others, self._cluster() as c:
            launch, out = self._launch(c, "save" if save else
                                       "restarts" if restarts else "plain", job, restarts, extra)
        main, ranks = self._outputs(out, launch, job)
        first = launch.first(r"^step 1/")
        return {"job": job, "out": out, "wall": launch.wall, "restarts": restarts,
                "save": save, "others_cores": others.cores(), **quiet,
                "steps": main["step_seconds"],
                "start": None if first is None else first - main["step_seconds"][0],
                "slowest_steps": slowest_step(ranks),
                "save_seconds": main["checkpoint"]["save_seconds"]}

    def _kill(self, job, rank, step, phase):
        mark = os.path.join(self.work, job + ".killed")
        if os.path.exists(mark):  # a run before this one's, in the same --work
            os.remove(mark)
        return mark, ["--kill-at", f"{rank}:{step}:{phase}:{mark}"]

    def recovered(self, job, rank, step, phase):
        """Rank `rank` killed (SIGKILL, by itself) at `phase` of step `step`; the launcher
        restarts it and the job recovers in place. Its wall time, when the kill, the launcher's
        notice and the first step after it came (seconds since the launch), and the step
        the ranks resumed from."""
        mark, extra = self._kill(job, rank, step, phase)
        quiet = self._quiet()
        with Others() as others, self._cluster() as c:
            launch, out = self._launch(c, "recovered", job, True, extra, watch=True)
        main, _ = self._outputs(out, launch, job)
        if not os.path.exists(mark):
            raise RunFailed(f"{job}: rank {rank} was not killed")
        if f"rank {rank} exited with -9; restarting it" not in launch.tail(10**7):
            raise RunFailed(f"{job}: the launcher did not restart rank {rank}:\n"
                            f"{launch.tail()}")
        killed = os.path.getmtime(mark) - launch.start
        after = [(t, s) for t, s in launch.steps() if t > killed]
        # The rank processes from before the kill: when the last of them was gone (the others
        # leave on the recovery notice); and when the last of their successors had started.
        old = [seen for seen in launch.children.values() if seen[0] < killed]
        new = [seen for seen in launch.children.values() if seen[0] >= killed]
        return {"job": job, "out": out, "wall": launch.wall, "rank": rank, "step": step,
                "phase": phase, "killed_at": killed, "others_cores": others.cores(), **quiet,
                "noticed_at": launch.first(LOST_LINE.pattern, killed),
                # The other ranks' lines that they leave on their daemons' recovery notice.
                "notices_at": [t for t, text in launch.lines
                               if t >= killed and "recovery in progress" in text],
                "resumed_step_line_at": after[0][0] if after else None,
                "resumed_step_line": after[0][1] if after else None,
                "first_step": main["first_step"],
                "old_gone_at": max(last for _, last in old) if old else None,
                "new_started_at": max(first for first, _ in new) if len(new) >= WORLD else None,
                "first_step_seconds": main["step_seconds"][0] if main["step_seconds"] else None}

    def checkpoint_restart(self, job, rank, step, phase):
        """The same kill in a job that saves a checkpoint every N steps and has no restarts:
        the launch fails; a second launch, a job of its own, resumes from the newest checkpoint
        (from the start where none was saved) and saves on. Both launches' wall times."""
        ckpt = os.path.join(self.work, job + ".ckpt")
        shutil.rmtree(ckpt, ignore_errors=True)
        mark, kill = self._kill(job, rank, step, phase)
        save = ["--save", ckpt, "--save-step", self.saves]
        quiet = self._quiet()
        with Others() as others, self._cluster() as c:
            failed, _ = self._launch(c, "checkpointed-kill", job + "-a", False, save + kill)
            if failed.code in (0, None) or not os.path.exists(mark):
                raise RunFailed(f"{job}-a: expected the kill to fail the launch; exit code "
                                f"{failed.code}:\n{failed.tail()}")
            resume = ["--resume", ckpt] if os.path.exists(os.path.join(ckpt, "latest")) else []
            again, out = self._launch(c, "checkpoint-resume" if resume else "from-scratch",
                                      job + "-b", False, save + resume)
        main, _ = self._outputs(out, again, job + "-b")
        return {"job": job, "out": out, "rank": rank, "step": step, "phase": phase,
                "walls": [failed.wall, again.wall], "others_cores": others.cores(), **quiet,
                "killed_at": os.path.getmtime(mark) - failed.start,
                "resumed_from": main["first_step"] - 1 if resume else 0,
                "load_seconds": main["checkpoint"]["load_seconds"]}
