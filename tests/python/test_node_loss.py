"""A lost node (docs/recovery.md, "A lost node"): a 3 daemons x 2 ranks training
(examples/train_tiny.py, AdamW) under `ragshard-launch --max-restarts 1 --redundancy R` loses
daemon 1 and both its ranks to SIGKILL in the middle of a step; a replacement daemon starts with
the same node id, the ranks restart and wait for it, it rebuilds their state from the other
nodes' parity (or copy), and the job goes on from the last completed step with no checkpoint.
The final parameters equal an uninterrupted run's within 1e-6. Also Muon under replica, a loss
after the step's protection (ranks roll forward), and HSDP's default (2 daemons x 2 ranks,
--replicate 2: node 1 rebuilt from its replicas on node 0)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import preloaded  # beside this file: the launches forked from one torch import
import torch
# beside this file; it puts the build's package on the path
from cluster_runs import BUILD, ROOT, ctl, env

import ragshard  # noqa: E402
from ragshard.cluster import LocalCluster  # noqa: E402

EXAMPLE = os.path.join(ROOT, "examples", "train_tiny.py")
# The ranks import the tests' fault hooks (fault_hooks.py: RAGSHARD_SHRINK_FAULT).
LAUNCH = [sys.executable, "-m", "ragshard.launch", "--preload", "torch,fault_hooks"]
SMALL = ["--layers", "2", "--dim", "64", "--heads", "4", "--seq", "16", "--batch", "2",
         "--vocab", "32", "--quiet", "--steps", "6", "--optimizer", "adamw"]


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(BUILD, daemons=3, pool_bytes=128 << 20, node_timeout_ms=2000,
                      heartbeat_ms=250) as c:
        yield c


def command(cluster, tmp_path, job, redundancy, extra=(),
            launcher=("--recovery-deadline", "90")):
    """The launch of `job` over the cluster's 3 daemons x 2 ranks; `redundancy` "hsdp+": over
    2 daemons, 2 HSDP replica groups of 2 ranks and no --redundancy (hsdp is the default).
    `launcher`: the launcher's recovery flags beside --max-restarts 1; `extra`: the script's."""
    out = str(tmp_path / job)
    if redundancy == "hsdp+":
        layout = ["--nproc", "4", "--sockets", ",".join(cluster.sockets[:2]), "--replicate", "2"]
    elif redundancy == "replica-2":  # 2 daemons x 2 ranks, one shard group of 4
        layout = ["--nproc", "4", "--sockets", ",".join(cluster.sockets[:2]),
                  "--redundancy", "replica"]
    else:
        layout = ["--nproc", "6", "--sockets", ",".join(cluster.sockets),
                  "--redundancy", redundancy]
    return out, LAUNCH + ["--planner", cluster.planner, "--job", job, "--create-job", *layout,
                          "--max-restarts", "1", *launcher, EXAMPLE, "--out", out] + SMALL + \
        list(extra)


def same(out, ref, atol=1e-6):
    a, b = torch.load(out + ".pt"), torch.load(ref + ".pt")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=0, atol=atol), \
            f"{name}: max |delta| {float((a[name] - b[name]).abs().max()):.3g}"


def lose_node(cluster, tmp_path, job, redundancy, step, phase, also=(), extra=(), node=1,
              replace=True, launcher=("--recovery-deadline", "90"), **envs):
    """Runs the training; when both ranks of `node` (ranks 2 and 3 of node 1), and the ranks
    `also` of the other nodes, are held at `phase` of `step`, kills the node's daemon and all of
    them with SIGKILL and starts a replacement daemon (unless `replace` is False: then it is
    started again only once the training is over, for the tests after). Returns the output path
    and the launcher's stderr. `envs`: more environment variables of the launch."""
    ranks = (2 * node, 2 * node + 1) + tuple(also)
    marks = [str(tmp_path / f"{job}-hold{r}") for r in ranks]
    out, cmd = command(cluster, tmp_path, job, redundancy, list(extra) +
                       [f"--hold-at={r}:{step}:{phase}:{m}" for r, m in zip(ranks, marks)],
                       launcher)
    p = subprocess.Popen(cmd, env=dict(env(), **envs), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 240
        while not all(os.path.exists(m) for m in marks):
            assert p.poll() is None, p.communicate()
            assert time.time() < deadline, f"node {node}'s ranks did not reach the hold"
            time.sleep(0.05)
        cluster.kill_daemon(node)
        for m in marks:
            with open(m) as f:
                os.kill(int(f.read()), signal.SIGKILL)
        if replace:
            cluster.start_daemon(node, log_suffix=f"-{job}")
        stdout, stderr = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
        if not replace:
            cluster.start_daemon(node, log_suffix=f"-{job}")  # for the tests after this one
    assert p.returncode == 0, stdout + stderr
    return out, stderr


_REFERENCES = {}  # (layout, arguments) -> the uninterrupted run's output, once per session


def reference(cluster, tmp_path, redundancy, extra=()):
    """The uninterrupted run of the same layout and arguments. Redundancy only copies state,
    so parity:2 and replica share one (it runs under the first asked for). HSDP's (2 x 2) also
    saves a checkpoint after step 1, in its output's path + ".ckpt" (the shrink's reference
    resumes from it at 1 x 2)."""
    key = (redundancy == "hsdp+", tuple(extra))
    if key not in _REFERENCES:
        ref, cmd = command(cluster, tmp_path, f"ref-{redundancy[:4]}-{len(_REFERENCES)}",
                           redundancy, extra)
        if key == (True, ()):
            cmd += ["--save", ref + ".ckpt", "--save-step", "1"]
        r = preloaded.run(cmd, env=env(), capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        _REFERENCES[key] = ref
    return _REFERENCES[key]


@pytest.mark.parametrize("redundancy,step,phase,also,extra", [
    ("parity:2", 3, "step", (), ()), ("replica", 3, "between", (), ()),
    # Lost before the first step commits: rebuilt to the state every rank started from.
    ("parity:2", 1, "forward", (), ()),
    # Lost once step 3 committed and its protection started (it runs in the background of
    # step 4), rank 0 of node 0 lost with node 1: no node holds step 3's parity whole, so every
    # rank rolls back to step 2, whose parity every node still holds, and redoes step 3
    # (docs/recovery.md, "Which parity is held").
    ("parity:2", 3, "protected", (0,), ()),
    # Muon's step holds AdamW's inside it: the step is protected once, whole, after Muon's part
    # too (a protect after AdamW's part alone would protect a step half done).
    ("replica", 3, "protected", (0,), ("--optimizer", "muon")),
    # HSDP's default: node 1's ranks copied from their replicas on node 0, no parity kept.
    ("hsdp+", 3, "step", (), ())])
def test_a_lost_node_is_rebuilt_on_a_replacement(cluster, tmp_path, redundancy, step, phase,
                                                 also, extra):
    ref = reference(cluster, tmp_path, redundancy, extra)
    job = f"lost-{redundancy[:4]}-{step}-{phase}{'-' + extra[-1] if extra else ''}"
    out, stderr = lose_node(cluster, tmp_path, job, redundancy, step, phase, also, extra)
    assert "rank 2 exited with -9; restarting it" in stderr
    same(out, ref)
    show = ctl(cluster, "job", "show", job)
    assert show.returncode == 0, show.stderr
    assert "READY" in show.stdout, show.stdout
    assert "rebuilds:     1" in show.stdout, show.stdout
    if redundancy == "hsdp+":
        assert "redundancy:   hsdp" in show.stdout, show.stdout


SHRINK = ["--global-batch", "8"]  # the same global batch at 4 ranks and at 2


def launch(cluster, tmp_path, job, nproc, daemons, layout, extra):
    """One launch of train_tiny's `nproc` ranks over the first `daemons` daemons (a reference
    run): `layout` for the launcher, `extra` for the script."""
    out = str(tmp_path / job)
    cmd = LAUNCH + ["--planner", cluster.planner, "--job", job, "--create-job", "--nproc",
                    str(nproc), "--sockets", ",".join(cluster.sockets[:daemons]), *layout,
                    EXAMPLE, "--out", out] + SMALL + SHRINK + list(extra)
    r = preloaded.run(cmd, env=env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return out


def test_a_lost_node_without_a_replacement_shrinks_the_job(cluster, tmp_path):
    """--on-node-loss shrink over 2 daemons x 2 ranks, 2 HSDP replica groups: node 0 and both
    its ranks are killed inside step 1's optimizer step (the optimizers' state is made in that
    step) and no replacement comes. At the recovery deadline the job shrinks to node 1's ranks
    2 and 3, which go on as ranks 0 and 1 of a successor job and take their state over from the
    old job's buffers in their daemon's pool; node 0's restarted ranks leave. The successor's
    rank 0 is killed in the middle of its take-over: every rank takes the state over again.
    Then the successor's rank 1 is killed inside step 4: the launcher restarts it there (not in
    the shrunk job), and the successor recovers in place. The losses after the shrink equal,
    within 1e-5, a reference that saves at 2 x 2 after step 1 (the survivors completed it) and
    resumes at 1 x 2, with the same global batch; and the output still says where the shrink
    was."""
    job = "shrink-1"
    # The recovery deadline (the shrink's wait for a replacement, and the successor's recovery
    # after its rank 1 is killed) leaves the successor's two restarted ranks time to attach again
    # beside another Python test (ctest -j4 on 2 cores): 8 s ran out once there.
    later, midway = str(tmp_path / f"{job}-later"), str(tmp_path / f"{job}-midway")
    out, stderr = lose_node(cluster, tmp_path, job, "hsdp+", 1, "step",
                            extra=SHRINK + [f"--kill-at=1:4:step:{later}"], node=0,
                            replace=False, launcher=("--recovery-deadline", "15",
                                                     "--on-node-loss", "shrink"),
                            RAGSHARD_SHRINK_FAULT=f"rank=0,mark={midway}")
    assert "rank 0 left: the job shrank without it" in stderr, stderr
    assert os.path.exists(midway) and "rank 2 exited with -9; restarting it" in stderr, stderr
    assert os.path.exists(later) and "rank 3 exited with -9; restarting it" in stderr, stderr
    with open(out + ".json") as f:
        shrunk = json.load(f)
    # The last step every survivor completed before the shrink, and the one the recovery in the
    # successor resumed from.
    assert shrunk["shrink"]["step"] == 1 and shrunk["first_step"] == 4, shrunk["shrink"]
    assert shrunk["world_sizes"] == [4] + [2] * 5
    assert shrunk["shrink"]["job"] == f"{job}/shrink-1" and shrunk["shrink"]["bytes"] > 0
    assert (shrunk["shrink"]["world"], shrunk["shrink"]["from_world"]) == (2, 4)
    # The reference: 2 x 2 saved after that step (HSDP's uninterrupted run, whose default global
    # batch is 8 too), resumed at 1 x 2.
    ckpt = reference(cluster, tmp_path, "hsdp+") + ".ckpt"
    ref = launch(cluster, tmp_path, "shrink-ref", 2, 1, [], ["--resume", ckpt])
    with open(ref + ".json") as f:
        resumed_ref = json.load(f)
    assert resumed_ref["first_step"] == 2
    a, b = shrunk["losses"], resumed_ref["losses"][shrunk["first_step"] - 2:]
    assert len(a) == len(b) == 3
    assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-5, (a, b)
    same(out, ref, atol=1e-5)
    show = ctl(cluster, "job", "show", job)
    assert show.returncode == 0 and "SHRUNK" in show.stdout, show.stdout + show.stderr
    show = ctl(cluster, "job", "show", f"{job}/shrink-1")
    assert show.returncode == 0 and "READY" in show.stdout, show.stdout + show.stderr
    # Once the survivors took the state over, their daemon dropped the shrunk job (its buffers
    # back to the pool). A salvage attach is refused, by name: to that job, to a job that can
    # still run, to a job the daemon never held.
    for name, rank, refusal in ((job, 2, "holds no state of the job"),
                                (f"{job}/shrink-1", 0, "the job can still run"),
                                ("no-such-job", 0, "holds no state of the job")):
        c = ragshard.Client(cluster.planner, cluster.sockets[1], name, rank, timeout_ms=5000,
                            token_file=cluster.token_file)
        try:
            with pytest.raises(ragshard.Error, match=refusal):
                c.attach(salvage=True)
        finally:
            c.close()


def test_a_lost_node_of_one_shard_group_re_cuts_the_shards(cluster, tmp_path):
    """--on-node-loss shrink over 2 daemons x 2 ranks in one shard group of 4 (plain FSDP) with
    --redundancy replica: node 0 and both its ranks are killed inside step 3's optimizer step
    (step 2 is the last one every rank completed) and no replacement comes. The successor's
    ranks 0 and 1 (node 1's ranks 2 and 3) re-cut every unit's shards for 2 ranks over their
    data plane: their own old shards, and ranks 0 and 1's from the copy of node 0's state that
    node 1 held (recut.py), AdamW's moments too.
    The successor's rank 1 is killed once its re-cut is done, before its mark: every rank re-cuts
    again. The losses after the shrink equal, within 1e-5, a reference that saves at 2 x 2 after
    step 2 and resumes at 1 x 2 with the same global batch, and so do the final parameters."""
    job = "recut-1"
    midway = str(tmp_path / f"{job}-midway")
    out, stderr = lose_node(cluster, tmp_path, job, "replica-2", 3, "step", extra=SHRINK,
                            node=0, replace=False,
                            launcher=("--recovery-deadline", "15", "--on-node-loss", "shrink"),
                            RAGSHARD_SHRINK_FAULT=f"rank=1,mark={midway}")
    assert "rank 0 left: the job shrank without it" in stderr, stderr
    # The successor's rank 1 (rank 3) killed once its re-cut was done, before its mark: every
    # rank re-cut again from the old job.
    assert os.path.exists(midway) and "rank 3 exited with -9; restarting it" in stderr, stderr
    with open(out + ".json") as f:
        shrunk = json.load(f)
    assert shrunk["shrink"]["step"] == 2, shrunk["shrink"]
    assert (shrunk["shrink"]["world"], shrunk["shrink"]["from_world"]) == (2, 4)
    assert shrunk["world_sizes"][0] == 4 and shrunk["world_sizes"][-1] == 2
    ckpt = str(tmp_path / "recut-ref.ckpt")
    launch(cluster, tmp_path, "recut-ref", 4, 2, [], ["--save", ckpt, "--save-step", "2"])
    ref = launch(cluster, tmp_path, "recut-ref-resumed", 2, 1, [], ["--resume", ckpt])
    with open(ref + ".json") as f:
        resumed_ref = json.load(f)
    a = shrunk["losses"]
    b = resumed_ref["losses"][shrunk["first_step"] - resumed_ref["first_step"]:]
    assert len(a) == len(b) > 0, (shrunk, resumed_ref)
    assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-5, (a, b)
    same(out, ref, atol=1e-5)
    show = ctl(cluster, "job", "show", job)
    assert show.returncode == 0 and "re-cutting the shards" in show.stdout, show.stdout


def test_redundancy_is_refused_without_the_nodes_it_needs(cluster, tmp_path):
    """parity:2 over 2 daemons, without --max-restarts, and hsdp without replicas: refused by
    name, nothing starts."""
    base = LAUNCH + ["--planner", cluster.planner, "--job", "refused", "--nproc", "4",
                     "--sockets", ",".join(cluster.sockets[:2]), "--create-job"]
    r = preloaded.run(base + ["--max-restarts", "1", "--redundancy", "parity:2", EXAMPLE],
                       env=env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "groups of 3" in r.stderr, r.stderr
    r = preloaded.run(base + ["--redundancy", "replica", EXAMPLE], env=env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "needs --max-restarts" in r.stderr, r.stderr
    r = preloaded.run(base + ["--max-restarts", "1", "--redundancy", "hsdp", EXAMPLE],
                       env=env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "needs --replicate 2 or more" in r.stderr, r.stderr
    # shrink without whole copies of each daemon's state elsewhere
    r = preloaded.run(base + ["--max-restarts", "1", "--on-node-loss", "shrink", EXAMPLE],
                       env=env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--on-node-loss shrink needs the lost daemons' state held " \
        "elsewhere" in r.stderr and "--redundancy 'none'" in r.stderr, r.stderr
