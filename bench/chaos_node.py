"""The node-rebuild fault of bench/chaos_report.py: a whole node lost (everything on its host
killed with SIGKILL: its daemon, its launcher and both its ranks) in the middle of a training
under ragshard.launch --max-restarts 1 --redundancy R (6 ranks of examples/train_tiny.py on 3
hosts of their own, a daemon and a `ragshard.launch --nnodes 3 --node-rank K` on each; AdamW,
bf16 parameters or Shampoo: `CONFIGS`), and a replacement daemon started with the lost node's
id on a spare host with a launcher for its node rank, which rebuilds its ranks' state from the
other nodes' parity (parity:2) or copy (replica) (issue 55; docs/recovery.md, "A lost node").
The kill resets the host's connections (its kernel lives on); bench/chaos_hosts.py loses hosts
without a reset.

Each trial (its own NamespacedCluster) draws the node (0 to 2), the step (1 to STEPS - 1) and
the phase (forward, backward, step, protected: after the step's protection and before it
commits, between) from a seeded RNG; both ranks of that node are held
there (train_tiny.py --hold-at: each writes its pid into a mark file and sleeps), then the
daemon, the launcher and the two ranks are killed, and the replacement daemon and launcher are
started, as tests/python/test_node_loss.py does. The scheme: parity:2 in odd trials, replica
in even ones; the configuration: AdamW in trials 1-2, bf16 in 3-4, Shampoo in 5-6, and so on. A
trial passes when every launcher (the lost one's excepted) exits 0 within RECOVERY_LIMIT seconds
of the daemon's kill (the recovery deadline plus 30 s; past it the trial is a hang, and everything it started
is killed), the job is READY with `rebuilds:     1` in `ragshardctl job show`, and every final
parameter is within PARAM_ATOL of an uninterrupted run's with the same redundancy
and configuration (`Uninterrupted`, one per scheme and configuration per campaign)."""
import os
import random
import re
import shutil
import signal
import statistics
import tempfile
import time

from chaos_procs import (WORK_ROOT, HostLaunch, TrialRun, await_launcher, brief_tail,
                         host_launchers, job_show, read_from, run_to_end)
from recovery_runs import max_abs_diff

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_tiny.py")
# tests/python/test_node_loss.py's small model, with 8 steps.
MODEL = ["--layers", "2", "--dim", "64", "--heads", "4", "--seq", "16", "--batch", "2",
         "--vocab", "32", "--quiet"]
# The configurations the trials cycle through, two trials each (parity:2, then replica).
CONFIGS = {"adamw": ["--optimizer", "adamw"], "bf16": ["--param-dtype", "bf16"],
           "shampoo": ["--optimizer", "shampoo", "--precondition-every", "2"]}
STEPS = 8
DAEMONS, PER_NODE = 3, 2
PHASES = ["forward", "backward", "step", "protected", "between"]
DEADLINE = 60.0  # the job's recovery deadline (s)
RECOVERY_LIMIT = DEADLINE + 30.0  # from the daemon's kill to the launcher's exit
HOLD_LIMIT = 300.0  # from the launch to both held ranks' marks
PARAM_ATOL = 1e-6
NODE_TIMEOUT_MS = 2000  # the planner's heartbeat timeout (as the test's cluster)
POOL_BYTES = 128 << 20
REBUILDS = re.compile(r"rebuilds:\s+(\d+) \((\d+) bytes\)")
POLL = 0.01


def scheme(trial):
    return "parity:2" if trial % 2 else "replica"


def config(trial):
    """The trial's configuration (a key of CONFIGS)."""
    return list(CONFIGS)[(trial - 1) // 2 % len(CONFIGS)]


def draw(trial):
    """The trial's (node, step, phase), from a seeded RNG."""
    rng = random.Random(f"node-rebuild-{trial}")
    return rng.randrange(DAEMONS), rng.randint(1, STEPS - 1), rng.choice(PHASES)


def _cluster(build):
    from ragshard.cluster import NamespacedCluster
    return NamespacedCluster(build, daemons=DAEMONS, spare_hosts=1, pool_bytes=POOL_BYTES,
                             node_timeout_ms=NODE_TIMEOUT_MS, shared=[ROOT])


def _launchers(cluster, job, out, redundancy, log, extra=(), where=None, launch=None):
    """The launchers of `job` (each host's own, or those of `where`: (node rank, host, daemon
    index)), their ranks forked from each one's import of torch: a HostLaunch, or `launch`
    with them added."""
    where = where or [(k, node, k) for k, node in enumerate(cluster.nodes)]
    return host_launchers(launch or HostLaunch(), cluster, job, where, DAEMONS, PER_NODE, [
        "--preload", "torch", "--max-restarts", "1", "--recovery-deadline", f"{DEADLINE:g}",
        "--redundancy", redundancy, EXAMPLE, "--out", out, "--steps", str(STEPS)] + MODEL +
        list(extra), log)


class Uninterrupted:
    """Each scheme's uninterrupted run (same launch, no fault), once per campaign."""

    def __init__(self, build):
        self.build, self.dir, self.outs = build, None, {}

    def get(self, redundancy, conf):
        if (redundancy, conf) not in self.outs:
            self.dir = self.dir or tempfile.mkdtemp(prefix="ragshard-chaos-node-ref-",
                                                    dir=WORK_ROOT)
            name = f"{redundancy.replace(':', '')}-{conf}"
            out = os.path.join(self.dir, name)
            with open(out + ".log", "w") as log, _cluster(self.build) as c:
                run_to_end(_launchers(c, f"uninterrupted-{name}", out, redundancy, log,
                                      CONFIGS[conf]), out + ".log",
                           f"the uninterrupted {redundancy} run")
            self.outs[redundancy, conf] = out
        return self.outs[redundancy, conf]

    def cleanup(self):
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)


def kill_held_node(c, launch, node, marks, log_path, t0, res, limit, replace=None):
    """Once the node's ranks are at the hold (their marks), kills everything on its host (its
    daemon, then its launcher with its ranks, with SIGKILL); `replace`, where given, starts the
    replacement (`replace()`: a daemon with its id and a launcher for its node rank on a spare
    host). Then waits up to `limit` s for the other launchers to exit 0. Records the kill's
    time, the replacement's start, the seconds to the exit, the exit code and what the
    launchers left running in `res`; raises naming what went wrong (a hang, an early exit)."""
    while not all(os.path.exists(m) for m in marks):
        if launch.failed() is not None or launch.poll() is not None:
            raise RuntimeError(f"a launcher exited ({launch.failed() or launch.returncode}) "
                               f"before node {node}'s ranks reached the hold: "
                               f"{brief_tail(log_path)}")
        if time.monotonic() - t0 > HOLD_LIMIT:
            raise TimeoutError(f"node {node}'s ranks not at the hold in {HOLD_LIMIT:g} s: "
                               f"{brief_tail(log_path)}")
        time.sleep(POLL)
    pids = [int(read_from(m)) for m in marks]
    c.kill_daemon(node)
    tk = time.monotonic()
    res["killed_at_seconds"] = round(tk - t0, 3)
    launch.drop(launch.procs[node])
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # (gone with its launcher's session)
            pass
    if replace is not None:
        replace()
        res["replacement_up_seconds"] = round(time.monotonic() - tk, 3)
    await_launcher(launch, tk, limit, log_path, res)
    if launch.returncode != 0:
        raise RuntimeError(f"the training exited {launch.returncode}: {brief_tail(log_path)}")


def node_trial(trial, build, ref, keep_dir):
    """One trial: node `node`'s ranks held at `phase` of `step`, the node killed (daemon, then
    its ranks) and a replacement daemon started."""
    node, step, phase = draw(trial)
    redundancy, conf = scheme(trial), config(trial)
    ranks = [node * PER_NODE + i for i in range(PER_NODE)]
    res = {"trial": trial, "passed": False, "error": None, "scheme": redundancy,
           "config": conf, "node": node,
           "step": step, "phase": phase, "stuck_at_stop": [], "leftover_after_launcher": []}
    with TrialRun(res, "node-rebuild", trial, keep_dir) as t:
        marks = [os.path.join(t.workdir, f"hold{r}") for r in ranks]
        reference = ref.get(redundancy, conf)
        with t.cluster(_cluster(build)) as c:
            job = f"node-rebuild-{trial}"
            t0 = time.monotonic()
            log = t.open_log()
            t.launch = _launchers(c, job, t.out, redundancy, log, CONFIGS[conf] + [
                f"--hold-at={r}:{step}:{phase}:{m}" for r, m in zip(ranks, marks)])

            def replace():
                c.start_daemon(node, log_suffix="-replacement", host="spare-0")
                _launchers(c, job, t.out, redundancy, log, CONFIGS[conf],
                           [(node, "spare-0", node)], t.launch)
            kill_held_node(c, t.launch, node, marks, t.log_path, t0, res, RECOVERY_LIMIT,
                           replace)
            show = job_show(build, c, job)
            m = REBUILDS.search(show.stdout)
            res["rebuilds"] = int(m.group(1)) if m else 0
            res["rebuilt_bytes"] = int(m.group(2)) if m else None
            if "READY" not in show.stdout or "rebuilds:     1 " not in show.stdout:
                raise RuntimeError(f"the job is not READY with one rebuild: "
                                   f"{' '.join((show.stdout + show.stderr).split())[:600]}")
            res["max_abs_diff"] = max_abs_diff(t.out, reference)
            if res["max_abs_diff"] > PARAM_ATOL:
                raise RuntimeError(f"diverged: max |delta| {res['max_abs_diff']:.3g} against "
                                   f"the uninterrupted {redundancy} run (> {PARAM_ATOL:g})")
            res["passed"] = True
    return res


# ------------------------------------------------------------------------------- the report

def node_text(trials):
    """node-rebuild's figures beyond the spread: the kills, the bytes rebuilt, the distance."""
    L = []
    killed = [t for t in trials if "killed_at_seconds" in t]
    if killed:
        by = {s: sum(t["scheme"] == s for t in killed) for s in ("parity:2", "replica")}
        nodes, phases = sorted({t["node"] for t in killed}), sorted({t["phase"] for t in killed})
        steps = sorted({t["step"] for t in killed})
        L.append(f"Killed: node{'s' * (len(nodes) > 1)} {', '.join(map(str, nodes))}, at "
                 f"step{'s' * (len(steps) > 1)} {', '.join(map(str, steps))}, in "
                 f"{', '.join(phases)} ({by['parity:2']} parity:2, {by['replica']} replica "
                 f"trials).\n")
    for s in ("parity:2", "replica"):
        xs = [t["seconds"] for t in trials if t["scheme"] == s and t.get("seconds") is not None]
        if xs:
            L.append(f"{s}: seconds from the kill to the exit {min(xs):.2f} to {max(xs):.2f} "
                     f"(median {statistics.median(xs):.2f}, n = {len(xs)}).\n")
    nb = sorted({t["rebuilt_bytes"] for t in trials if t.get("rebuilt_bytes") is not None})
    if nb:
        L.append(f"Bytes rebuilt per lost node (job show): "
                 f"{', '.join(f'{b:,}' for b in nb)}.\n")
    diffs = [t["max_abs_diff"] for t in trials if "max_abs_diff" in t]
    if diffs:
        L.append(f"Largest |final parameter − the uninterrupted run's| over the trials: "
                 f"{max(diffs):.1e} (limit {PARAM_ATOL:g}).\n")
    return L


def node_table(trials):
    L = ["| trial | result | scheme | configuration | node | step | phase | "
         "s from the kill to the exit | bytes rebuilt | max abs Δ |",
         "|---:|---|---|---|---:|---:|---|---:|---:|---:|"]
    for t in trials:
        d, b, s = t.get("max_abs_diff"), t.get("rebuilt_bytes"), t.get("seconds")
        L.append(f"| {t['trial']} | {'pass' if t['passed'] else 'FAIL'} | {t['scheme']} | "
                 f"{t.get('config', 'adamw')} | {t['node']} | {t['step']} | {t['phase']} | "
                 f"{'—' if s is None else f'{s:.2f}'} | {'—' if b is None else f'{b:,}'} | "
                 f"{'—' if d is None else f'{d:.1e}'} |")
    return L
