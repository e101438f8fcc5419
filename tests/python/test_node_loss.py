"""A lost node (docs/recovery.md, "A lost node"), on hosts of their own
(ragshard.cluster.NamespacedCluster): a training of 3 hosts x 2 ranks (examples/train_tiny.py,
AdamW; one `ragshard-launch --nnodes 3 --node-rank K --max-restarts 1 --redundancy R` per host)
loses node 1's host in the middle of a step: its link goes down, then everything on it dies (its
daemon, its launcher and both its ranks), no packet leaving it. A replacement daemon with the same
node id starts on a spare host with a launcher for node rank 1; its ranks wait for it, it rebuilds
their state from the other nodes' parity (or copy), and the job goes on from the last completed
step with no checkpoint. The final parameters equal an uninterrupted run's within 1e-6. Also Muon
under replica, a loss after the step's protection (ranks roll forward), and HSDP's default
(2 hosts x 2 ranks, --replicate 2: node 1 rebuilt from its replicas on node 0), and host 0
lost, whose replacement runs the same command as host 0's launcher (which made the job) and
joins the recovering job. Without a
replacement the job shrinks: HSDP's survivors take their state over when a host is lost; plain
FSDP's re-cut the shards when a daemon dies on a host that lives on (its launcher's restarted
ranks then leave, named).

Namespaces need root: cluster_runs.require_namespaces says what happens where they cannot be
made."""
import json
import os
import signal
import sys

import pytest
# beside this file; they put the build's package on the path
from cluster_runs import BUILD, ROOT, env, require_namespaces
from host_runs import (EXAMPLE, assert_resumed, assert_same, ctl, finish, held, launchers,
                       lose_host, outputs, stop)

from ragshard.cluster import NamespacedCluster  # noqa: E402

require_namespaces()

# The ranks import the tests' fault hooks (fault_hooks.py: RAGSHARD_SHRINK_FAULT).
LAUNCH = ["--preload", "torch,fault_hooks", "--max-restarts", "1"]
STEPS = ["--steps", "6"]
DEADLINE = ("--recovery-deadline", "90")
SPARE = "spare-0"


@pytest.fixture(scope="module")
def cluster():
    with NamespacedCluster(BUILD, daemons=3, spare_hosts=1, pool_bytes=128 << 20,
                           node_timeout_ms=2000, heartbeat_ms=250, shared=[ROOT]) as c:
        c.references = {}
        c.at = list(c.nodes)  # the host each node's daemon is on
        yield c


def layout(redundancy):
    """The hosts and the launchers' layout flags of a redundancy: 3 hosts x 2 ranks under
    --redundancy R; "hsdp+": 2 hosts x 2 ranks, 2 HSDP replica groups (--replicate 2, hsdp by
    default); "replica-2": 2 hosts x 2 ranks, one shard group of 4, --redundancy replica."""
    if redundancy == "hsdp+":
        return 2, ["--replicate", "2"]
    if redundancy == "replica-2":
        return 2, ["--redundancy", "replica"]
    return 3, ["--redundancy", redundancy]


def launch(cluster, job, redundancy, extra=(), launcher=DEADLINE, where=None, **envs):
    """The launchers of `job` on its layout's hosts (`where`: only these (node rank, host)):
    `launcher`, the launchers' recovery flags beside --max-restarts 1; `extra`, the script's;
    `envs`, more environment. The output path and the launchers."""
    n, flags = layout(redundancy)
    out = os.path.join(cluster.dir, job)
    if where is None:
        restore(cluster)
        where = [(k, cluster.at[k]) for k in range(n)]
    return out, launchers(cluster, job, out, where, STEPS + list(extra), flags + list(launcher),
                          nnodes=n, base=LAUNCH, **envs)


def restore(cluster):
    """A node that a test left without a daemon (no replacement came) gets one again, on the
    host it was on, its link up: for the tests after, once that test checked its job (a daemon
    registering with the node's id counts the one before as lost, in every job it was in)."""
    for i, host in enumerate(cluster.at):
        if cluster.daemon(i).poll() is not None:
            cluster.hosts.link_up(host)
            cluster.start_daemon(i, log_suffix=f"-back-{len(cluster.procs)}", host=host)


def lose_node(cluster, job, redundancy, step, phase, also=(), extra=(), node=1, replace=True,
              host_lost=True, launcher=DEADLINE, **envs):
    """Runs the training; when both ranks of `node` (ranks 2 and 3 of node 1), and the ranks
    `also` of the other nodes, are held at `phase` of `step`, the node is lost: its host
    (`host_lost`: link down, then its launcher, ranks and daemon killed), or only its daemon and
    held ranks (SIGKILL; its launcher restarts them); and the ranks `also` are killed (their
    launchers restart them). With `replace`, a replacement daemon with the node's id starts on
    another host (its own or the spare, whichever it was not on) with a launcher for its node
    rank, or, where only the daemon died, on the same host. The output path and each launcher's
    (exit code, output) but the lost host's; each exited 0."""
    ranks = (2 * node, 2 * node + 1) + tuple(also)
    marks = [os.path.join(cluster.dir, f"{job}-hold{r}") for r in ranks]
    extra = list(extra) + [f"--hold-at={r}:{step}:{phase}:{m}" for r, m in zip(ranks, marks)]
    out, procs = launch(cluster, job, redundancy, extra, launcher, **envs)
    was = cluster.at[node]
    try:
        pids = held(procs, marks)
        if host_lost:
            lose_host(cluster, procs, node, was)
        else:
            cluster.kill_daemon(node)
        for pid in pids if not host_lost else pids[2:]:
            os.kill(pid, signal.SIGKILL)
        if replace:
            if host_lost:
                cluster.at[node] = cluster.nodes[node] if was == SPARE else SPARE
                cluster.hosts.link_up(cluster.at[node])
            cluster.start_daemon(node, log_suffix=f"-{job}", host=cluster.at[node])
            if host_lost:
                procs.update(launch(cluster, job, redundancy, extra, launcher,
                                    [(node, cluster.at[node], node)], **envs)[1])
        got = outputs(procs)
    finally:
        stop(procs.values())
    for k, (rc, text) in got.items():
        assert rc == 0, f"node rank {k}'s launcher: {text[-4000:]}"
    return out, got


def reference(cluster, redundancy, extra=()):
    """The uninterrupted run of the same layout and arguments. Redundancy only copies state,
    so parity:2 and replica share one (it runs under the first asked for). HSDP's (2 x 2) also
    saves a checkpoint after step 1, in its output's path + ".ckpt" (the shrink's reference
    resumes from it at 1 x 2)."""
    key = (redundancy == "hsdp+", tuple(extra))
    if key not in cluster.references:
        job = f"ref-{redundancy[:4]}-{len(cluster.references)}"
        save = ["--save", os.path.join(cluster.dir, job) + ".ckpt", "--save-step", "1"]
        out, procs = launch(cluster, job, redundancy, list(extra) + save * (key == (True, ())))
        finish(procs)
        cluster.references[key] = out
    return cluster.references[key]


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
def test_a_lost_node_is_rebuilt_on_a_replacement(cluster, redundancy, step, phase, also, extra):
    ref = reference(cluster, redundancy, extra)
    job = f"lost-{redundancy[:4]}-{step}-{phase}{'-' + extra[-1] if extra else ''}"
    out, got = lose_node(cluster, job, redundancy, step, phase, also, extra)
    for r in also:  # restarted by their own host's launcher
        assert f"rank {r} exited with -9; restarting it" in got[r // 2][1], got[r // 2][1]
    assert_same(out, ref, atol=1e-6)
    show = ctl(cluster, "job", "show", job)
    assert "READY" in show and "rebuilds:     1" in show, show
    if redundancy == "hsdp+":
        assert "redundancy:   hsdp" in show, show


def test_a_lost_node_inside_a_commit_of_several_steps_goes_back_to_its_start(cluster):
    """--steps-per-commit 3: the state is protected after steps 3 and 6 only. Node 1 lost after
    step 5 (its daemon and ranks killed; a replacement daemon on the same host, which the other
    tests' hosts expect as they are): every rank goes back to the end of step 3 (the survivors by
    their undo copies, node 1's ranks rebuilt from step 3's copies on the next node), and the
    job redoes steps 4 to 6."""
    ref = reference(cluster, "replica")
    out, _ = lose_node(cluster, "lost-k3", "replica", 5, "between", host_lost=False,
                       launcher=DEADLINE + ("--steps-per-commit", "3"))
    assert_same(out, ref, atol=1e-6)
    for rank in range(6):
        with open(f"{out}.rank{rank}.json") as f:
            assert json.load(f)["first_step"] == 4, rank
    show = ctl(cluster, "job", "show", "lost-k3")
    assert "READY" in show and "rebuilds:     1" in show, show


def test_host_0_lost_is_rebuilt_by_the_same_command_on_a_replacement(cluster):
    """Host 0's launcher made the job; the same command on the spare host (--create-job, node
    rank 0) finds it recovering and joins it as the lost host's replacement. Another node rank
    0 launch of a job that does not wait for a replacement is refused, naming its state."""
    ref = reference(cluster, "replica")
    out, got = lose_node(cluster, "lost-host-0", "replica", 2, "step", node=0)
    assert "node rank 0 joins it as the replacement of a lost host" in got[0][1], got[0][1]
    assert_same(out, ref, atol=1e-6)
    show = ctl(cluster, "job", "show", "lost-host-0")
    assert "READY" in show and "rebuilds:     1" in show, show
    _, again = launch(cluster, "lost-host-0", "replica", where=[(0, cluster.at[0])],
                      RAGSHARD_JOB_WAIT_S="1")
    rc, text = outputs(again)[0]
    assert rc != 0 and "job 'lost-host-0' exists already (JOB_READY)" in text, text


SHRINK = ["--global-batch", "8"]  # the same global batch at 4 ranks and at 2
SHRINKS = ("--recovery-deadline", "15", "--on-node-loss", "shrink")
# A salvage attach (`planner socket token job rank`): the refusal's text, or "attached".
SALVAGE = """
import sys
import ragshard
planner, socket, token, job, rank = sys.argv[1:]
c = ragshard.Client(planner, socket, job, int(rank), timeout_ms=5000, token_file=token)
try:
    c.attach(salvage=True)
    print("attached")
except ragshard.Error as e:
    print(e)
finally:
    c.close()
"""


def plain(cluster, job, hosts, extra):
    """One run of train_tiny's `hosts` x 2 ranks on the first hosts, no recovery (a shrink's
    reference): `extra` for the script. Its output path."""
    out = os.path.join(cluster.dir, job)
    restore(cluster)
    finish(launchers(cluster, job, out, [(k, cluster.at[k]) for k in range(hosts)],
                     STEPS + SHRINK + list(extra), nnodes=hosts, base=["--preload", "torch"]))
    return out


def test_a_lost_node_without_a_replacement_shrinks_the_job(cluster):
    """--on-node-loss shrink over 2 hosts x 2 ranks, 2 HSDP replica groups: node 0's host is lost
    inside step 1's optimizer step (the optimizers' state is made in that step) and no
    replacement comes. At the recovery deadline the job shrinks to node 1's ranks 2 and 3, which
    go on as ranks 0 and 1 of a successor job and take their state over from the old job's
    buffers in their daemon's pool. The successor's rank 0 is killed in the middle of its
    take-over: every rank takes the state over again. Then the successor's rank 1 is killed
    inside step 4: the launcher restarts it there (not in the shrunk job), and the successor
    recovers in place. The losses after the shrink equal, within 1e-5, a reference that saves at
    2 x 2 after step 1 (the survivors completed it) and resumes at 1 x 2, with the same global
    batch; and the output still says where the shrink was."""
    job = "shrink-1"
    # The recovery deadline (the shrink's wait for a replacement, and the successor's recovery
    # after its rank 1 is killed) leaves the successor's two restarted ranks time to attach again
    # beside another Python test (ctest -j4 on 2 cores): 8 s ran out once there.
    later, midway = (os.path.join(cluster.dir, f"{job}-{m}") for m in ("later", "midway"))
    out, got = lose_node(cluster, job, "hsdp+", 1, "step",
                         extra=SHRINK + [f"--kill-at=1:4:step:{later}"], node=0, replace=False,
                         launcher=SHRINKS, RAGSHARD_SHRINK_FAULT=f"rank=0,mark={midway}")
    text = got[1][1]
    assert os.path.exists(midway) and "rank 2 exited with -9; restarting it" in text, text
    assert os.path.exists(later) and "rank 3 exited with -9; restarting it" in text, text
    # The reference: 2 x 2 saved after that step (HSDP's uninterrupted run, whose default global
    # batch is 8 too), resumed at 1 x 2.
    ref = plain(cluster, "shrink-ref", 1, ["--resume", reference(cluster, "hsdp+") + ".ckpt"])
    shrunk = assert_resumed(out, ref)
    # The last step every survivor completed before the shrink, and the one the recovery in the
    # successor resumed from.
    assert shrunk["shrink"]["step"] == 1 and shrunk["first_step"] == 4, shrunk["shrink"]
    assert shrunk["world_sizes"] == [4] + [2] * 5
    assert shrunk["shrink"]["job"] == f"{job}/shrink-1" and shrunk["shrink"]["bytes"] > 0
    assert (shrunk["shrink"]["world"], shrunk["shrink"]["from_world"]) == (2, 4)
    assert "SHRUNK" in ctl(cluster, "job", "show", job)
    assert "READY" in ctl(cluster, "job", "show", f"{job}/shrink-1")
    # Once the survivors took the state over, their daemon dropped the shrunk job (its buffers
    # back to the pool). A salvage attach is refused, by name: to that job, to a job that can
    # still run, to a job the daemon never held.
    for name, rank, refusal in ((job, 2, "holds no state of the job"),
                                (f"{job}/shrink-1", 0, "the job can still run"),
                                ("no-such-job", 0, "holds no state of the job")):
        r = cluster.run(cluster.at[1], [sys.executable, "-c", SALVAGE, cluster.planner,
                                   cluster.sockets[1], cluster.token_file, name, str(rank)],
                        env=cluster.env(PYTHONPATH=env()["PYTHONPATH"]), capture_output=True,
                        text=True, timeout=60)
        assert r.returncode == 0 and refusal in r.stdout, r.stdout + r.stderr


def test_a_lost_node_of_one_shard_group_re_cuts_the_shards(cluster):
    """--on-node-loss shrink over 2 hosts x 2 ranks in one shard group of 4 (plain FSDP) with
    --redundancy replica: node 0's daemon dies with both its ranks inside step 3's optimizer step
    (step 2 is the last one every rank completed); its host lives on and no replacement comes.
    Node 0's launcher restarts its ranks, and when the job shrinks they leave, named. The
    successor's ranks 0 and 1 (node 1's ranks 2 and 3) re-cut every unit's shards for 2 ranks
    over their data plane: their own old shards, and ranks 0 and 1's from the copy of node 0's
    state that node 1 held (recut.py), AdamW's moments too.
    The successor's rank 1 is killed once its re-cut is done, before its mark: every rank re-cuts
    again. The losses after the shrink equal, within 1e-5, a reference that saves at 2 x 2 after
    step 2 and resumes at 1 x 2 with the same global batch, and so do the final parameters."""
    job = "recut-1"
    midway = os.path.join(cluster.dir, f"{job}-midway")
    out, got = lose_node(cluster, job, "replica-2", 3, "step", extra=SHRINK, node=0,
                         replace=False, host_lost=False, launcher=SHRINKS,
                         RAGSHARD_SHRINK_FAULT=f"rank=1,mark={midway}")
    assert "rank 0 left: the job shrank without it" in got[0][1], got[0][1]
    # The successor's rank 1 (rank 3) killed once its re-cut was done, before its mark: every
    # rank re-cut again from the old job.
    assert os.path.exists(midway) and "rank 3 exited with -9; restarting it" in got[1][1], \
        got[1][1]
    ckpt = os.path.join(cluster.dir, "recut-ref.ckpt")
    plain(cluster, "recut-ref", 2, ["--save", ckpt, "--save-step", "2"])
    ref = plain(cluster, "recut-ref-resumed", 1, ["--resume", ckpt])
    shrunk = assert_resumed(out, ref)
    assert shrunk["shrink"]["step"] == 2, shrunk["shrink"]
    assert (shrunk["shrink"]["world"], shrunk["shrink"]["from_world"]) == (2, 4)
    assert shrunk["world_sizes"][0] == 4 and shrunk["world_sizes"][-1] == 2
    assert "re-cutting the shards" in ctl(cluster, "job", "show", job)


def test_redundancy_is_refused_without_the_nodes_it_needs(cluster):
    """parity:2 over 2 hosts, without --max-restarts, and hsdp without replicas: refused by
    name, nothing starts."""
    restore(cluster)

    def refused(*flags):
        r = cluster.run(cluster.at[0], [sys.executable, "-m", "ragshard.launch", "--planner",
                                   cluster.planner, "--job", "refused", "--nproc", "4",
                                   "--nnodes", "2", "--node-rank", "0", "--sockets",
                                   cluster.sockets[0], "--create-job", *flags, EXAMPLE],
                        env=cluster.env(PYTHONPATH=env()["PYTHONPATH"]), capture_output=True,
                        text=True, timeout=60)
        assert r.returncode == 2, r.stdout + r.stderr
        return r.stderr
    assert "groups of 3" in refused("--max-restarts", "1", "--redundancy", "parity:2")
    assert "needs --max-restarts" in refused("--redundancy", "replica")
    assert "needs --replicate 2 or more" in refused("--max-restarts", "1", "--redundancy", "hsdp")
    # shrink without whole copies of each daemon's state elsewhere
    e = refused("--max-restarts", "1", "--on-node-loss", "shrink")
    assert "--on-node-loss shrink needs the lost daemons' state held elsewhere" in e and \
        "--redundancy 'none'" in e, e
