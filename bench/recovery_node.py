"""The node-loss runs of bench/recovery_report.py (issue 55): examples/train_tiny.py at 3 daemons x
2 ranks through ragshard.launch, each launch on a fresh LocalCluster of 3 daemons.

* uninterrupted, --max-restarts 1, with --redundancy none, parity:2 and replica (the step time,
  and each daemon's protected_bytes, parity_bytes and pool use from the ranks' --out JSON);
* a whole node lost (its daemon and both its ranks killed with SIGKILL while the ranks are held
  at a step and phase, train_tiny.py --hold-at) and a replacement daemon started with its node
  id, which rebuilds the node's state from the others' parity or copy (`rebuilt`);
* the same loss in a job that saves a checkpoint every N steps and has no restarts: the launch
  fails, a replacement daemon comes up, and a second launch resumes all ranks from the newest
  checkpoint (`checkpoint_restart`);
* the same loss with no replacement in a job of 3 HSDP replica groups (--replicate 3, the same
  global batch) under --on-node-loss shrink, which shrinks to the 2 other nodes' 4 ranks once
  SHRINK_DEADLINE has passed (`shrunk`), and that job uninterrupted (redundancy "hsdp").

`NodeRunner` shares recovery_runs.Runner's waits for a quiet machine and its bookkeeping."""
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

from recovery_runs import EXAMPLE, ROOT, Launch, Others, Runner, RunFailed, sh, slowest_step

WORLD, DAEMONS, PER_NODE = 6, 3, 2
SCHEMES = ["none", "parity:2", "replica"]
PHASES = ["forward", "backward", "step", "between"]
NODE_TIMEOUT_MS = 2000  # the planner's heartbeat timeout (as tests/python/test_node_loss.py)
REBUILDS = re.compile(r"rebuilds:\s+(\d+) \((\d+) bytes\)")
REPLICAS = 3  # the shrink's layout: 3 HSDP replica groups of 2 ranks, one per daemon
SHRINK_DEADLINE = 5.0  # how long the shrinking job waits for a replacement (its deadline, s)


def node_kills(trials, steps, seed):
    """Each trial's (node, step, phase): the phases in shuffled blocks of four."""
    rng = random.Random(f"node-{seed}")
    out, phases = [], []
    for _ in range(trials):
        if not phases:
            phases = rng.sample(PHASES, len(PHASES))
        out.append((rng.randrange(DAEMONS), rng.randint(1, steps - 1), phases.pop()))
    return out


class _NodeKiller(threading.Thread):
    """Waits for the held ranks' marks, then kills the node: its daemon (kill -9), its held
    ranks (SIGKILL), and starts the replacement daemon with the node's id. `killed` is the
    wall-clock time of the daemon's kill; `error` what went wrong, if anything."""

    def __init__(self, cluster, node, marks, timeout, suffix, replace=True):
        super().__init__(daemon=True)
        self.cluster, self.node, self.marks, self.timeout = cluster, node, marks, timeout
        self.replace = replace
        self.suffix, self.killed, self.replaced, self.error = suffix, None, None, None
        self.stop = threading.Event()

    def run(self):
        t0 = time.time()
        try:
            while not all(os.path.exists(m) for m in self.marks):
                if self.stop.is_set() or time.time() - t0 > self.timeout:
                    self.error = "the node's ranks did not reach the hold"
                    return
                time.sleep(0.01)
            pids = [int(open(m).read()) for m in self.marks]
            self.cluster.kill_daemon(self.node)
            self.killed = time.time()
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            if self.replace:
                self.cluster.start_daemon(self.node, log_suffix=self.suffix)
            self.replaced = time.time()
        except Exception as e:  # reported by the run
            self.error = f"{type(e).__name__}: {e}"


class NodeRunner(Runner):
    """Runner's launches at 3 daemons x 2 ranks, with --redundancy."""

    world = WORLD

    def _cluster(self):
        from ragshard.cluster import LocalCluster
        return LocalCluster(self.build, daemons=DAEMONS, pool_bytes=256 << 20,
                            node_timeout_ms=NODE_TIMEOUT_MS)

    def _launch(self, cluster, kind, job, redundancy, extra, watch=False):
        """redundancy None: no restarts; "none", "parity:2", "replica": --max-restarts 1 with it;
        "hsdp", "shrink": --replicate 3 and the same global batch, "shrink" with --on-node-loss
        shrink and a deadline of SHRINK_DEADLINE; "recut": one shard group with --redundancy
        replica, --on-node-loss shrink, that deadline and the same global batch."""
        out = os.path.join(self.work, job)
        cmd = [sys.executable, "-m", "ragshard.launch", "--preload", "torch", "--planner",
               cluster.planner, "--job", job, "--nproc", str(WORLD), "--sockets",
               ",".join(cluster.sockets), "--create-job"]
        if redundancy in ("hsdp", "shrink"):
            cmd += ["--replicate", str(REPLICAS), "--max-restarts", "1", "--recovery-deadline",
                    str(SHRINK_DEADLINE if redundancy == "shrink" else self.deadline)]
            cmd += ["--on-node-loss", "shrink"] if redundancy == "shrink" else []
            batch = int(self.model[self.model.index("--batch") + 1])
            extra = ["--global-batch", str(WORLD * batch)] + extra
        elif redundancy == "recut":
            cmd += ["--max-restarts", "1", "--recovery-deadline", str(SHRINK_DEADLINE),
                    "--redundancy", "replica", "--on-node-loss", "shrink"]
            batch = int(self.model[self.model.index("--batch") + 1])
            extra = ["--global-batch", str(WORLD * batch)] + extra
        elif redundancy is not None:
            cmd += ["--max-restarts", "1", "--recovery-deadline", str(self.deadline),
                    "--redundancy", redundancy]
        cmd += [EXAMPLE, "--out", out, "--steps", str(self.steps)] + self.model + extra
        self.commands.setdefault(kind, sh(cmd).replace(ROOT + os.sep, ""))
        return Launch(cmd, self._env(), self.timeout, watch), out

    @staticmethod
    def _memory(ranks):
        """Per node (its first rank's figures, from its daemon): the protected state, the
        parities, the pool in use between the last two steps and at the end."""
        nodes = {}
        for r in ranks:
            if r["node"] not in nodes:
                nodes[r["node"]] = {"protected": r.get("protected_bytes", 0),
                                    "parity": r.get("parity_bytes", 0),
                                    "pool_between": r["pool_trace"][-1]["pool_used"],
                                    "pool_end": r["pool_used_bytes"]}
        return nodes

    def _marks(self, job, node, step, phase):
        marks = [os.path.join(self.work, f"{job}.hold{node * PER_NODE + i}")
                 for i in range(PER_NODE)]
        for m in marks:
            if os.path.exists(m):
                os.remove(m)
        return marks, [f"--hold-at={node * PER_NODE + i}:{step}:{phase}:{m}"
                       for i, m in enumerate(marks)]

    def uninterrupted(self, job, redundancy, save=False):
        """One run without a fault (redundancy None: without restarts, as the checkpointing
        runs): its wall time, start, steps, the slowest rank's steps after the first two, and
        the daemons' memory."""
        extra = ["--save", os.path.join(self.work, job + ".ckpt"), "--save-step",
                 self.saves] if save else []
        quiet = self._quiet()
        with Others() as others, self._cluster() as c:
            launch, out = self._launch(c, "save" if save else f"uninterrupted {redundancy}",
                                       job, redundancy, extra)
        main, ranks = self._outputs(out, launch, job)
        first = launch.first(r"^step 1/")
        return {"job": job, "out": out, "wall": launch.wall, "redundancy": redundancy,
                "save": save, "others_cores": others.cores(), **quiet,
                "steps": main["step_seconds"],
                "start": None if first is None else first - main["step_seconds"][0],
                "slowest_steps": slowest_step(ranks), "memory": self._memory(ranks)}

    def _lose(self, job, kind, redundancy, node, step, phase, replace, world=WORLD):
        """A launch in which node `node` is lost at `phase` of step `step` (with a replacement
        daemon where `replace`): the launch, rank 0's output, `ragshardctl job show`, and what
        every such run reports (the wall time, when the kill and the first step after it came,
        the step the ranks resumed from, the machine's quiet)."""
        marks, extra = self._marks(job, node, step, phase)
        quiet = self._quiet()
        with Others() as others, self._cluster() as c:
            killer = _NodeKiller(c, node, marks, self.timeout, f"-{job}", replace=replace)
            killer.start()
            launch, out = self._launch(c, kind, job, redundancy, extra)
            killer.stop.set()
            killer.join(timeout=60)
            show = subprocess.run([os.path.join(self.build, "ctl", "ragshardctl"), "--planner",
                                   c.planner, "--token-file", c.token_file, "job", "show",
                                   job], capture_output=True, text=True, timeout=60)
        if killer.error or killer.killed is None:
            raise RunFailed(f"{job}: the node was not killed: {killer.error}\n{launch.tail()}")
        main, _ = self._outputs(out, launch, job, world)
        killed = killer.killed - launch.start
        after = [(t, s) for t, s in launch.steps() if t > killed]
        row = {"job": job, "out": out, "wall": launch.wall, "redundancy": redundancy,
               "node": node, "step": step, "phase": phase, "killed_at": killed,
               "others_cores": others.cores(), **quiet,
               "resumed_step_line_at": after[0][0] if after else None,
               "first_step": main["first_step"],
               "first_step_seconds": main["step_seconds"][0] if main["step_seconds"] else None}
        if replace:
            row["replacement_up"] = killer.replaced - killer.killed
        return main, show, row

    def rebuilt(self, job, redundancy, node, step, phase):
        """Node `node` lost at `phase` of step `step` and rebuilt on a replacement daemon:
        `_lose`'s figures and the bytes rebuilt (job show)."""
        _, show, row = self._lose(job, f"rebuilt {redundancy}", redundancy, node, step, phase,
                                  True)
        m = REBUILDS.search(show.stdout)
        if "READY" not in show.stdout or not m or m.group(1) != "1":
            raise RunFailed(f"{job}: the job is not READY with one rebuild:\n{show.stdout}"
                            f"{show.stderr}")
        return {**row, "rebuilt_bytes": int(m.group(2))}

    def shrunk(self, job, node, step, phase, how="shrink"):
        """Node `node` lost at `phase` of step `step` with no replacement, in the --replicate 3
        job that shrinks (`how` "shrink"), or the job of one shard group with replica that
        re-cuts ("recut"): `_lose`'s figures, the world size of every step and the bytes rank 0
        took over (ShardedModule.shrink)."""
        main, show, row = self._lose(job, "shrunk" if how == "shrink" else "re-cut", how, node,
                                     step, phase, False,
                                     WORLD - PER_NODE)  # the successor's ranks write outputs
        if "SHRUNK" not in show.stdout:
            raise RunFailed(f"{job}: the job is not SHRUNK:\n{show.stdout}{show.stderr}")
        return {**row, "world_sizes": main.get("world_sizes"),
                "shrunk_bytes": (main.get("shrink") or {}).get("bytes")}

    def checkpoint_restart(self, job, node, step, phase):
        """The same loss in a job that saves a checkpoint every N steps and has no restarts:
        the launch fails; the replacement daemon is up; a second launch, a job of its own,
        resumes all ranks from the newest checkpoint. Both launches' wall times."""
        ckpt = os.path.join(self.work, job + ".ckpt")
        marks, hold = self._marks(job, node, step, phase)
        save = ["--save", ckpt, "--save-step", self.saves]
        quiet = self._quiet()
        with Others() as others, self._cluster() as c:
            killer = _NodeKiller(c, node, marks, self.timeout, f"-{job}")
            killer.start()
            failed, _ = self._launch(c, "checkpointed-kill", job + "-a", None, save + hold)
            killer.stop.set()
            killer.join(timeout=60)
            if failed.code in (0, None) or killer.killed is None:
                raise RunFailed(f"{job}-a: expected the node's loss to fail the launch; exit "
                                f"code {failed.code}, {killer.error}:\n{failed.tail()}")
            resume = ["--resume", ckpt] if os.path.exists(os.path.join(ckpt, "latest")) else []
            again, out = self._launch(c, "checkpoint-resume" if resume else "from-scratch",
                                      job + "-b", None, save + resume)
        main, _ = self._outputs(out, again, job + "-b")
        return {"job": job, "out": out, "node": node, "step": step, "phase": phase,
                "walls": [failed.wall, again.wall], "others_cores": others.cores(), **quiet,
                "killed_at": killer.killed - failed.start,
                "resumed_from": main["first_step"] - 1 if resume else 0,
                "load_seconds": main["checkpoint"]["load_seconds"]}
