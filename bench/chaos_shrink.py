"""The node-shrink fault of bench/chaos_report.py: a whole node lost for good (everything on its
host killed with SIGKILL: its daemon, its launcher and both its ranks; no replacement) in the
middle of a training under ragshard.launch --max-restarts 1 --on-node-loss shrink (4 ranks of
examples/train_tiny.py on 2 hosts of their own, a daemon and a `ragshard.launch --nnodes 2
--node-rank K` on each, AdamW),
which shrinks the job in place from 2 x 2 to 1 x 2 at the recovery deadline (issue 55;
docs/recovery.md, "Shrinking in place"). In trials 1 to HSDP_TRIALS the 4 ranks are 2 HSDP
replica groups (the survivors keep their cuts); after, one shard group of 4 with --redundancy
replica (the survivors re-cut the shards, the lost node's share from its copy).

Each trial (its own NamespacedCluster) draws the node (0 or 1), the step (1 to STEPS - 1) and
the phase (forward, backward, step, between) from a seeded RNG; both ranks of that node are held
there (train_tiny.py --hold-at), then the daemon, the launcher and the two ranks are killed. A
trial passes when the other host's launcher exits 0 within SHRINK_LIMIT seconds of the daemon's kill (the recovery deadline
plus 30 s; past it the trial is a hang, and everything it started is killed), the job is SHRUNK
and its successor READY in `ragshardctl job show`, the run's `world_sizes` say 4 up to the step it
resumed from and 2 after, and its losses after the shrink (and final parameters) are within
LOSS_ATOL of a reference that changes the world size at the same step with the same global batch:
saved at 2 x 2 after that step, resumed at 1 x 2 (`References`, one per step and layout per
campaign)."""
import os
import random
import shutil
import statistics
import tempfile
import time

from chaos_node import kill_held_node
from chaos_procs import WORK_ROOT, HostLaunch, TrialRun, host_launchers, job_show, run_to_end
from recovery_runs import max_abs_diff

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_tiny.py")
# tests/python/test_node_loss.py's small model and global batch, with 6 steps.
MODEL = ["--layers", "2", "--dim", "64", "--heads", "4", "--seq", "16", "--batch", "2",
         "--global-batch", "8", "--vocab", "32", "--quiet", "--optimizer", "adamw"]
STEPS = 6
DAEMONS, PER_NODE = 2, 2
HSDP_TRIALS = 5  # trials 1-5: 2 HSDP replica groups; after: one shard group, replica, re-cut
LAYOUTS = {"hsdp": ["--replicate", "2"], "re-cut": ["--redundancy", "replica"]}
PHASES = ["forward", "backward", "step", "between"]
DEADLINE = 10.0  # the job's recovery deadline (s): the wait for a replacement before shrinking
SHRINK_LIMIT = DEADLINE + 30.0  # from the daemon's kill to the launcher's exit
LOSS_ATOL = 1e-5
NODE_TIMEOUT_MS = 2000
POOL_BYTES = 128 << 20


def layout_of(trial):
    return "hsdp" if trial <= HSDP_TRIALS else "re-cut"


def draw(trial):
    """The trial's (node, step, phase), from a seeded RNG."""
    rng = random.Random(f"node-shrink-{trial}")
    return rng.randrange(DAEMONS), rng.randint(1, STEPS - 1), rng.choice(PHASES)


def _cluster(build):
    from ragshard.cluster import NamespacedCluster
    return NamespacedCluster(build, daemons=DAEMONS, pool_bytes=POOL_BYTES,
                             node_timeout_ms=NODE_TIMEOUT_MS, shared=[ROOT])


def _launch(cluster, job, out, log, hosts, layout, extra=()):
    """A launcher on each of the first `hosts` hosts, 2 ranks each."""
    return host_launchers(
        HostLaunch(), cluster, job, [(k, cluster.nodes[k], k) for k in range(hosts)], hosts,
        PER_NODE, ["--preload", "torch", *layout, EXAMPLE, "--out", out, "--steps", str(STEPS)] +
        MODEL + list(extra), log)


def _run(cluster, job, out, hosts, layout, extra):
    with open(out + ".log", "w") as log:
        run_to_end(_launch(cluster, job, out, log, hosts, layout, extra), out + ".log",
                   f"the reference run {job}")


class References:
    """Per resume step s and layout: 2 x 2 (HSDP, or one shard group) saved after step s,
    resumed at 1 x 2 to STEPS (for s = 0, 1 x 2 from the start: the initial state is the
    seed's at any world size); once per step and layout per campaign."""

    def __init__(self, build):
        self.build, self.dir, self.outs = build, None, {}

    def get(self, step, layout="hsdp"):
        if (step, layout) not in self.outs:
            self.dir = self.dir or tempfile.mkdtemp(prefix="ragshard-chaos-shrink-ref-",
                                                    dir=WORK_ROOT)
            tag = f"{step}-{layout}"
            ckpt, out = os.path.join(self.dir, f"ckpt{tag}"), os.path.join(self.dir, f"ref{tag}")
            plain = [] if layout == "re-cut" else LAYOUTS[layout]
            with _cluster(self.build) as c:
                if step == 0:  # (the state every run starts from: 1 x 2 from the start)
                    _run(c, f"fresh-{tag}", out, 1, [], [])
                else:
                    _run(c, f"save-{tag}", out + "-a", 2, plain,
                         ["--steps", str(step), "--save", ckpt, "--save-step", str(step)])
                    _run(c, f"resume-{tag}", out, 1, [], ["--resume", ckpt])
            self.outs[(step, layout)] = out
        return self.outs[(step, layout)]

    def cleanup(self):
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)


def _losses(out):
    import json
    with open(out + ".json") as f:
        return json.load(f)


def shrink_trial(trial, build, refs, keep_dir):
    """One trial: node `node`'s ranks held at `phase` of `step`, everything on its host killed
    (its daemon, then its launcher and ranks) and no replacement started."""
    node, step, phase = draw(trial)
    layout = layout_of(trial)
    ranks = [node * PER_NODE + i for i in range(PER_NODE)]
    res = {"trial": trial, "passed": False, "error": None, "node": node, "step": step,
           "phase": phase, "layout": layout, "stuck_at_stop": [],
           "leftover_after_launcher": []}
    with TrialRun(res, "node-shrink", trial, keep_dir) as t:
        out, log_path = t.out, t.log_path
        marks = [os.path.join(t.workdir, f"hold{r}") for r in ranks]
        with t.cluster(_cluster(build)) as c:
            job = f"node-shrink-{trial}"
            log = t.open_log()
            t0 = time.monotonic()
            p = _launch(c, job, out, log, DAEMONS,
                        LAYOUTS[layout] + ["--max-restarts", "1", "--recovery-deadline",
                         f"{DEADLINE:g}", "--on-node-loss", "shrink"],
                        [f"--hold-at={r}:{step}:{phase}:{m}" for r, m in zip(ranks, marks)])
            t.launch = p
            kill_held_node(c, p, node, marks, log_path, t0, res, SHRINK_LIMIT)
            shown = job_show(build, c, job).stdout + job_show(build, c, f"{job}/shrink-1").stdout
            if "SHRUNK" not in shown or "READY" not in shown:
                raise RuntimeError(f"not SHRUNK with a READY successor: "
                                   f"{' '.join(shown.split())[:600]}")
            run = _losses(out)
            resumed = (run.get("shrink") or {}).get("step")  # where the survivors took over
            if resumed is None:
                raise RuntimeError(f"the output says no shrink: {run.get('shrink')}")
            res["resumed_at_step"] = resumed
            res["shrunk_bytes"] = (run.get("shrink") or {}).get("bytes")
            if run.get("world_sizes") != [4] * resumed + [2] * (STEPS - resumed):
                raise RuntimeError(f"world_sizes {run.get('world_sizes')} after resuming at "
                                   f"step {resumed}")
            ref = refs.get(resumed, layout)
            a, b = run["losses"], _losses(ref)["losses"]
            if len(a) != len(b):
                raise RuntimeError(f"{len(a)} losses after the shrink, {len(b)} in the "
                                   "reference")
            res["max_loss_diff"] = max(abs(x - y) for x, y in zip(a, b))
            res["max_abs_diff"] = max_abs_diff(out, ref)
            if max(res["max_loss_diff"], res["max_abs_diff"]) > LOSS_ATOL:
                raise RuntimeError(f"diverged: losses {res['max_loss_diff']:.3g}, parameters "
                                   f"{res['max_abs_diff']:.3g} from the reference saved at "
                                   f"2 x 2 after step {resumed} and resumed at 1 x 2 "
                                   f"(> {LOSS_ATOL:g})")
            res["passed"] = True
    return res


# ------------------------------------------------------------------------------- the report

def shrink_text(trials):
    """node-shrink's figures beyond the spread."""
    L = []
    killed = [t for t in trials if "killed_at_seconds" in t]
    if killed:
        nodes, phases = sorted({t["node"] for t in killed}), sorted({t["phase"] for t in killed})
        steps = sorted({t["step"] for t in killed})
        L.append(f"Killed: node{'s' * (len(nodes) > 1)} {', '.join(map(str, nodes))}, at "
                 f"step{'s' * (len(steps) > 1)} {', '.join(map(str, steps))}, in "
                 f"{', '.join(phases)}.\n")
    xs = [t["seconds"] for t in trials if t.get("seconds") is not None]
    if xs:
        L.append(f"Seconds from the kill to the exit {min(xs):.2f} to {max(xs):.2f} (median "
                 f"{statistics.median(xs):.2f}, n = {len(xs)}), of which {DEADLINE:g} s are the "
                 "recovery deadline (the wait for a replacement).\n")
    d = [max(t["max_loss_diff"], t["max_abs_diff"]) for t in trials if "max_loss_diff" in t]
    if d:
        L.append(f"Largest |loss or final parameter − the reference's| over the trials: "
                 f"{max(d):.1e} (limit {LOSS_ATOL:g}).\n")
    return L


def shrink_table(trials):
    L = ["| trial | result | layout | node | step | phase | resumed at step | s from the kill to "
         "the exit | bytes taken over (rank 0) | max abs Δ loss | max abs Δ parameter |",
         "|---:|---|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for t in trials:
        s, b = t.get("seconds"), t.get("shrunk_bytes")
        dl, dp = t.get("max_loss_diff"), t.get("max_abs_diff")
        L.append(f"| {t['trial']} | {'pass' if t['passed'] else 'FAIL'} | "
                 f"{t.get('layout', 'hsdp')} | {t['node']} | "
                 f"{t['step']} | {t['phase']} | {t.get('resumed_at_step', '—')} | "
                 f"{'—' if s is None else f'{s:.2f}'} | {'—' if b is None else f'{b:,}'} | "
                 f"{'—' if dl is None else f'{dl:.1e}'} | {'—' if dp is None else f'{dp:.1e}'} |")
    return L
