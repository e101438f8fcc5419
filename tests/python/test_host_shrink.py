"""A host lost for good on hosts of their own (ragshard.cluster.NamespacedCluster; docs/recovery.md,
"Partitions and fencing" and "Shrinking"): no replacement comes, and the job shrinks.

train_tiny at 2 hosts x 2 ranks (one `ragshard-launch --nnodes 2 --node-rank K` per host),
--max-restarts 1 --redundancy replica --on-node-loss shrink, plain FSDP over the 4 ranks, the
planner's node timeout 6 s and a recovery deadline of 10 s. Node-1's two ranks are held inside
step 3's optimizer step; then either

- the host is lost without a reset: its link goes down and everything on it dies, no packet
  leaving it; or
- the host is partitioned: its link goes down while everything on it lives; its daemon fences
  itself once its lease runs out, its ranks exit naming the fence and its launcher gives up,
  named.

The planner declares node-1 lost at its node timeout; no replacement registers by the recovery
deadline, so node-0's ranks go on as ranks 0 and 1 of a successor job, re-cutting every unit's
shards for 2 ranks from their own shards and the copy of node-1's state node-0 held. The losses
after the shrink and the final parameters equal, within 1e-5, a reference that saves at 2 x 2
after step 2 (the last step every rank completed) and resumes on one host at 1 x 2 with the same
global batch (the reference the node-loss tests define). After the partition, the link returns:
the fenced daemon's heartbeats are acknowledged again, so the fence ends, named in its log; its
node is back for new jobs, and the job it was fenced out of stays failed there (a SHRUNK job's
operations fail naming the successor, which runs on node-0's host alone).

Namespaces need root: cluster_runs.require_namespaces says what happens where they cannot be
made."""
import os
import time

from cluster_runs import BUILD, ROOT, require_namespaces  # beside this file; the package
from host_runs import (assert_resumed, ctl, finish, held, launchers, lose_host, outputs,
                       partition, stop)

from ragshard.cluster import NamespacedCluster  # noqa: E402

require_namespaces()

NODE_TIMEOUT_MS = 6000
LEASE_S = NODE_TIMEOUT_MS * 3 / 4 / 1000
SHRINK = ["--on-node-loss", "shrink", "--recovery-deadline", "10"]
SIX = ["--steps", "6", "--global-batch", "8"]  # the same global batch at 4 ranks and at 2
HOLDS = [(r, 3, "step") for r in (2, 3)]  # node-1's ranks, inside step 3's optimizer step


def cluster():
    return NamespacedCluster(BUILD, daemons=2, pool_bytes=128 << 20,
                             node_timeout_ms=NODE_TIMEOUT_MS, heartbeat_ms=250, shared=[ROOT])


def saved_reference(c):
    """The uninterrupted training at 2 x 2, saved after step 2."""
    ckpt = os.path.join(c.dir, "ref.ckpt")
    finish(launchers(c, "ref", os.path.join(c.dir, "ref"), enumerate(c.nodes),
                     SIX + ["--save", ckpt, "--save-step", "2"]))
    return ckpt


def check_shrunk(c, job, out, ckpt):
    """The shrink's record, the planner's view of both jobs, and the training after the shrink
    against the reference resumed at 1 x 2 on node-0's host."""
    ref = os.path.join(c.dir, f"{job}-ref-resumed")
    finish(launchers(c, f"{job}-ref-resumed", ref, [(0, "node-0")], SIX + ["--resume", ckpt],
                     flags=["--redundancy", "none"], nnodes=1))
    shrunk = assert_resumed(out, ref)
    assert shrunk["shrink"]["step"] == 2, shrunk["shrink"]
    assert (shrunk["shrink"]["world"], shrunk["shrink"]["from_world"]) == (2, 4)
    assert shrunk["shrink"]["job"] == f"{job}/shrink-1"
    assert shrunk["world_sizes"][0] == 4 and shrunk["world_sizes"][-1] == 2, shrunk
    shown = ctl(c, "job", "show", job)
    assert "SHRUNK" in shown and "re-cutting the shards" in shown, shown
    assert "READY" in ctl(c, "job", "show", f"{job}/shrink-1")


def hold(c, job, out, **more_env):
    """The job's launchers, once node-1's ranks are held; and the held ranks' pids."""
    marks = [os.path.join(c.dir, f"{job}-hold{r}") for r, _, _ in HOLDS]
    procs = launchers(c, job, out, enumerate(c.nodes),
                      SIX + [f"--hold-at={r}:{s}:{p}:{m}" for (r, s, p), m in zip(HOLDS, marks)],
                      SHRINK, **more_env)
    try:
        pids = held(procs, marks)
    except AssertionError as e:
        raise AssertionError(f"{e}: {outputs(procs, timeout=60)}") from e
    return procs, marks, pids


def test_a_host_lost_without_a_replacement_shrinks_the_job():
    with cluster() as c:
        ckpt = saved_reference(c)
        job, out = "lost", os.path.join(c.dir, "lost")
        procs, _, _ = hold(c, job, out)
        try:
            cut = lose_host(c, procs, 1)
            (rc, text), = outputs(procs).values()
            assert rc == 0, text[-4000:]
            print(f"the job ended {time.time() - cut:.1f} s after the cut")
        finally:
            stop(procs.values())
        check_shrunk(c, job, out, ckpt)


def test_a_partitioned_host_fences_itself_and_the_job_shrinks_without_it():
    with cluster() as c:
        ckpt = saved_reference(c)
        job, out = "cut", os.path.join(c.dir, "cut")
        # Their planner calls give up after 5 s (RAGSHARD_PLANNER_RETRY_S): the partitioned
        # host's launcher restarts its ranks once, and they fail at their first call.
        procs, marks, pids = hold(c, job, out, RAGSHARD_PLANNER_RETRY_S="5")
        old = c.daemon(1)
        try:
            cut, stopped = partition(c, "node-1", marks, pids, LEASE_S)
            got = outputs(procs)
            rc, text = got[1]
            assert rc != 0 and "this node is fenced: the planner acknowledged no heartbeat " \
                "for" in text, text[-4000:]
            rc, text = got[0]
            assert rc == 0, text[-4000:]
            print(f"node-1's ranks stopped {stopped:.1f} s after the cut; the job ended "
                  f"{time.time() - cut:.1f} s after it")
            # The link returns: the fenced daemon's heartbeats are acknowledged again and the
            # fence ends; the node is back for new jobs, while the job it was fenced out of stays
            # failed on it, naming its successor, which runs on node-0 alone.
            c.hosts.link_up("node-1")
            log, deadline = "", time.time() + 120
            while "the fence ends" not in log:
                assert old.poll() is None and time.time() < deadline, log[-4000:]
                time.sleep(0.1)
                with open(os.path.join(c.dir, "daemon1.log")) as f:
                    log = f.read()
            assert "the jobs it stopped stay failed" in log, log[-4000:]
            nodes = ctl(c, "nodes")
            assert "node-1" in nodes and "LOST" not in nodes, nodes
        finally:
            stop(procs.values())
        check_shrunk(c, job, out, ckpt)
